"""The draft gate (`voltserve.spec.gate`): the mode it picks from measured output tokens per second (a fake clock,
no real timing), per concurrency bucket; the scheduler's steps under it (no drafts and planned ahead while it says
plain); its setting (`speculative_gate`)."""

from __future__ import annotations

import asyncio

import pytest

from actors.build import speculation
from actors.scheduler import AddRequestMsg, SchedulerActor
from actors.stream import RequestStream
from actors.worker import WorkerActor
from tests.api.fake_engine import ByteTokenizer
from tests.helpers import OracleDrafter, make_scheduler, make_seq
from tests.unit.test_speculative import FakeDrafter, fake_sample
from tests.unit.test_verify_steps_actor import PROMPTS, VerifyRunner, _plain
from voltserve.cli import build_parser
from voltserve.config import EngineConfig
from voltserve.errors import ConfigError
from voltserve.spec.gate import DraftGate, concurrency_bucket
from voltserve.spec.ladder import DraftLadder

W, P = 4, 32  # a small window and probe period keep the step sequences short


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_gate(mode="auto", margin=0.03):
    clock = FakeClock()
    return DraftGate(mode, window=W, probe_every=P, margin=margin, clock=clock), clock


def drive(gate, clock, steps, draft, plain, num_running=1) -> list[bool]:
    """`steps` decode-only steps at `num_running` sequences, each in the mode the gate picks, after a prefill step
    (as a request starts); draft / plain: (output tokens, seconds) of a step in that mode. Returns the modes."""
    if gate._last_s is None:
        gate.record(num_running, gate.drafts_on(num_running), num_running, False)
    modes = []
    for _ in range(steps):
        on = gate.drafts_on(num_running)
        tokens, seconds = draft if on else plain
        clock.now_s += seconds
        gate.record(num_running, on, tokens, True)
        modes.append(on)
    return modes


# explore: W measured draft steps, then plain's W (its first step, a switch, is not measured)
EXPLORE = [True] * W + [False] * (W + 1)
SLOW_DRAFT, FAST_DRAFT, PLAIN = (2, 1.0e-3), (3, 0.9e-3), (1, 0.4e-3)  # 2000, 3333 and 2500 tokens/s


def test_picks_plain_when_plain_steps_are_measured_faster():
    gate, clock = make_gate()
    modes = drive(gate, clock, 20, SLOW_DRAFT, PLAIN)
    assert modes == EXPLORE + [False] * 11


def test_keeps_drafting_when_draft_steps_emit_more_tokens_per_second():
    gate, clock = make_gate()
    modes = drive(gate, clock, 20, FAST_DRAFT, PLAIN)
    assert modes == EXPLORE + [True] * 11


def test_a_near_tie_goes_to_plain():
    """Draft 2% faster than plain is within the 3% margin: plain; 5% faster: draft."""
    for lead, want in ((1.02, False), (1.05, True)):
        gate, clock = make_gate()
        modes = drive(gate, clock, 12, (lead, 1e-3), (1, 1e-3))
        assert modes[len(EXPLORE):] == [want] * 3, lead


def test_reprobes_the_loser_every_p_steps_and_follows_a_workload_change():
    """Free prose (drafts slow) then copying (drafts fast): the gate keeps plain until the loser's re-probe, which
    measures drafts afresh and switches to them; a re-probe that finds the loser still slower changes nothing."""
    gate, clock = make_gate()
    modes = drive(gate, clock, P + 10, SLOW_DRAFT, PLAIN)
    # after P measured steps in the bucket, W + 1 draft steps (the first a switch, unmeasured), then plain again
    probe = modes.index(True, len(EXPLORE))
    assert modes[len(EXPLORE):probe] == [False] * (probe - len(EXPLORE)) and probe == P + 1
    assert modes[probe:probe + W + 1] == [True] * (W + 1) and not any(modes[probe + W + 1:])
    modes = drive(gate, clock, P + W + 10, FAST_DRAFT, PLAIN)  # the workload changes: drafts now pay
    switch = modes.index(True)
    assert 0 < switch <= P and all(modes[switch:])


def test_a_winner_that_slows_down_gives_way_without_waiting_for_a_probe():
    gate, clock = make_gate()
    assert drive(gate, clock, 12, FAST_DRAFT, PLAIN)[-1]
    modes = drive(gate, clock, 2 * W, SLOW_DRAFT, PLAIN)  # its EWMA follows; plain's estimate is older
    assert modes[-1] is False and modes.index(False) < 2 * W


def test_buckets_are_independent():
    """1 stream measures plain faster, 3 streams (bucket 4) drafts faster; 4 shares bucket 4, 5 (bucket 8) is
    unmeasured and explores with drafts."""
    assert [concurrency_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 1, 2, 4, 4, 8, 8, 16, 64, 128]
    gate, clock = make_gate()
    drive(gate, clock, 20, SLOW_DRAFT, PLAIN, num_running=1)
    drive(gate, clock, 20, (9, 1e-3), (3, 0.5e-3), num_running=3)
    assert [gate.drafts_on(n) for n in (1, 2, 3, 4, 5)] == [False, True, True, True, True]
    assert drive(gate, clock, 3, SLOW_DRAFT, PLAIN, num_running=1) == [False] * 3  # bucket 1 kept its choice


def test_steps_with_prefill_or_no_gate_mode_are_not_measured():
    """Slow prefill steps emitting many tokens, and steps where the ladder gave no drafts (mode None), between
    plain steps: neither counts, nor does their time leak into the next step's; plain stays faster."""
    gate, clock = make_gate()
    drive(gate, clock, W, SLOW_DRAFT, PLAIN)
    for _ in range(3 * W):  # plain steps, each after a 10 s prefill step of 1000 tokens or a 10 s unmeasured one
        on = gate.drafts_on(1)
        clock.now_s += 10.0
        gate.record(1, on, 1000, False)
        clock.now_s += 10.0
        gate.record(1, None, 1000, True)
        clock.now_s += PLAIN[1]
        gate.record(1, on, PLAIN[0], True)
    assert not gate.drafts_on(1)
    # only the draft steps were measured: plain still has its W steps to run
    assert gate._buckets[1].plain.num_steps == 0 and gate._buckets[1].draft.num_steps == W


def test_off_always_drafts_and_bad_settings_fail():
    gate, clock = make_gate("off")
    assert drive(gate, clock, 20, SLOW_DRAFT, PLAIN) == [True] * 20
    with pytest.raises(ConfigError, match="speculative_gate must be one of auto, off, not 'on'"):
        DraftGate("on")
    with pytest.raises(ConfigError, match="probe_every >= window"):
        DraftGate(window=8, probe_every=4)


def test_the_setting_reaches_the_scheduler():
    assert EngineConfig().speculative_gate == "auto"
    with pytest.raises(ConfigError, match="speculative_gate must be one of auto, off"):
        EngineConfig(speculative_gate="always").validate()  # fails at startup with speculation off too
    assert speculation(EngineConfig(speculative_method="ngram").validate())["gate"].is_auto
    assert not speculation(EngineConfig(speculative_method="ngram", speculative_gate="off"))["gate"].is_auto
    args = build_parser().parse_args(["serve", "--speculative-gate", "off"])
    assert args.speculative_gate == "off"


class FixedGate:
    """A gate that always answers `on` and keeps what it is told."""

    is_auto = True

    def __init__(self, on: bool):
        self.on = on
        self.records: list[tuple] = []

    def drafts_on(self, num_running: int) -> bool:
        return self.on

    def record(self, *args) -> None:
        self.records.append(args)


def _step(s):
    """One step over the fake model, fed to the gate as the engine's loop does. Returns (plan, tokens emitted)."""
    plan = s.schedule()
    sampled = fake_sample(plan)
    before = sum(len(seq.output_ids) for seq in s.running)
    s.update(plan, sampled)
    s.record_step(plan, sampled)
    return plan, sum(len(seq.output_ids) for seq in s.running) - before


@pytest.mark.parametrize("on", [False, True])
def test_scheduler_drafts_only_while_the_gate_says_draft(on):
    """Plain: entries carry no drafts, the plan has none, the drafter is not asked and the next step is planned
    ahead; draft: drafts as without a gate. Every step is recorded with its mode, tokens and kind."""
    drafter = FakeDrafter(lambda tokens: tokens[-3:])  # the fake model rejects most of them
    gate = FixedGate(on)
    s = make_scheduler(drafter=drafter, ladder=DraftLadder(3), gate=gate, num_blocks=128, draft_max_pause=0)
    for _ in range(2):
        s.add(make_seq([5, 6, 7], max_tokens=30))
    steps = [_step(s) for _ in range(5)]  # both prefills, then decodes
    plans = [p for p, _ in steps[1:]]
    assert all(p.drafts_on is on and p.has_drafts is on for p in plans)
    assert all(len(e.drafts) == (3 if on else 0) for p in plans for e in p.entries)
    assert (drafter.asked != []) is on
    assert (s.schedule_ahead(s.schedule()) is not None) is (not on)
    # the prefill step is not measured (its tokens are not counted)
    assert gate.records == [(2, on, tokens if i else 0, i > 0) for i, (_, tokens) in enumerate(steps)]
    assert (s.num_gate_draft_steps, s.num_gate_plain_steps) == ((5, 0) if on else (0, 5))


class TimedVerifyRunner(VerifyRunner):
    """VerifyRunner on a fake clock: a step with drafts takes `verify_s`, one without `decode_s`."""

    def __init__(self, clock: FakeClock, decode_s: float, verify_s: float):
        super().__init__()
        self.clock, self.decode_s, self.verify_s = clock, decode_s, verify_s

    def launch(self, plan, feed=None):
        self.clock.now_s += self.verify_s if plan.has_drafts else self.decode_s
        return super().launch(plan, feed)


@pytest.mark.parametrize("verify_s", [10e-3, 1e-3])
async def test_the_engine_loop_feeds_the_gate(verify_s):
    """The scheduler actor times its steps on the gate's clock: verifies 10x a decode step's cost turn drafting
    off (after exploring), verifies as cheap as a decode keep it on; the streams carry plain decoding's tokens
    either way."""
    max_tokens = 60
    plain = _plain(max_tokens)
    clock = FakeClock()
    gate = DraftGate(window=W, probe_every=P, clock=clock)
    sched = make_scheduler(eos=(0,), drafter=OracleDrafter(PROMPTS, [t for t, _, _ in plain], 97),
                           ladder=DraftLadder(3), gate=gate, num_blocks=128)
    worker = WorkerActor(TimedVerifyRunner(clock, 1e-3, verify_s), name="worker-gate")
    actor = SchedulerActor(sched, worker, ByteTokenizer())
    worker.start()
    actor.start()
    streams = [RequestStream(f"r{i}", 1, abort=lambda rid: None) for i in range(len(PROMPTS))]
    for i, (prompt, stream) in enumerate(zip(PROMPTS, streams)):
        actor.tell(AddRequestMsg((make_seq(prompt, max_tokens=max_tokens, request_id=f"r{i}"),), stream))

    async def tokens(stream):
        return [t async for out in stream for t in out.token_ids]

    got = await asyncio.wait_for(asyncio.gather(*(tokens(s) for s in streams)), 10)
    await actor.stop()
    await worker.stop()
    assert got == [t for t, _, _ in plain]
    draft, held = sched.num_gate_draft_steps, sched.num_gate_plain_steps
    if verify_s > 1e-3:
        assert held > draft >= W
    else:
        assert draft > 2 * held and sched.num_accepted_tokens > 20
    assert sched.pool.num_free == sched.pool.num_blocks
