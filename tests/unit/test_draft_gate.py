"""The draft gate (`voltserve.spec.gate`): the mode it picks from measured output tokens per second (a fake clock,
no real timing), per concurrency bucket; the scheduler's steps under it (no drafts and planned ahead while it says
plain); its setting (`speculative_gate`)."""

from __future__ import annotations

import asyncio
import random

import pytest

from actors.build import speculation
from actors.scheduler import AddRequestMsg, SchedulerActor
from actors.stream import RequestStream
from actors.worker import WorkerActor
from tests.api.fake_engine import ByteTokenizer
from tests.helpers import FakeAsyncRunner, OracleDrafter, make_scheduler, make_seq
from tests.unit.test_speculative import FakeDrafter, fake_sample
from tests.unit.test_verify_steps_actor import PROMPTS, VerifyRunner, _plain
from voltserve.cli import build_parser
from voltserve.config import DEFAULT_GATE, EngineConfig
from voltserve.errors import ConfigError
from voltserve.offline import run_steps
from voltserve.spec.gate import DraftGate, concurrency_bucket, window_rate
from voltserve.spec.ladder import DraftLadder

W, P = 4, 32  # a small window and exploit phase keep the step sequences short


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_gate(mode="auto", margin=0.03, window=W, exploit_steps=P):
    clock = FakeClock()
    return DraftGate(mode, window=window, exploit_steps=exploit_steps, margin=margin, clock=clock), clock


def drive(gate, clock, steps, draft, plain, num_running=1) -> list[bool]:
    """`steps` decode-only steps at `num_running` sequences, each in the mode the gate picks, after a prefill step
    (as a request starts); draft / plain: (output tokens, seconds) of a step in that mode, or a function of the
    step's index returning them. Returns the modes."""
    if gate._last_s is None:
        gate.record(num_running, gate.drafts_on(num_running), num_running, False)
    modes = []
    for i in range(steps):
        on = gate.drafts_on(num_running)
        mode = draft if on else plain
        tokens, seconds = mode(i) if callable(mode) else mode
        clock.now_s += seconds
        gate.record(num_running, on, tokens, True)
        modes.append(on)
    return modes


# the first epoch: W draft steps, then W plain ones (each window's first step, a switch, is measured)
EXPLORE = [True] * W + [False] * W
SLOW_DRAFT, FAST_DRAFT, PLAIN = (2, 1.0e-3), (3, 0.9e-3), (1, 0.4e-3)  # 2000, 3333 and 2500 tokens/s


def test_picks_plain_when_plain_steps_are_measured_faster():
    gate, clock = make_gate()
    assert drive(gate, clock, 20, SLOW_DRAFT, PLAIN) == EXPLORE + [False] * 12


def test_keeps_drafting_when_draft_steps_emit_more_tokens_per_second():
    gate, clock = make_gate()
    assert drive(gate, clock, 20, FAST_DRAFT, PLAIN) == EXPLORE + [True] * 12


def test_a_near_tie_goes_to_plain():
    """Draft 2% faster than plain is within the 3% margin: plain; 5% faster: draft."""
    for lead, want in ((1.02, False), (1.05, True)):
        gate, clock = make_gate()
        modes = drive(gate, clock, 12, (lead, 1e-3), (1, 1e-3))
        assert modes[len(EXPLORE):] == [want] * 4, lead


def test_epochs_measure_the_loser_first_then_the_winner_and_follow_a_workload_change():
    """After P exploit steps the next epoch measures the loser for W steps, then the winner for W, back to back;
    a workload change (drafts now pay) is followed at the next epoch, whose order is then reversed."""
    gate, clock = make_gate()
    modes = drive(gate, clock, 2 * W + P + 2 * W + P, SLOW_DRAFT, PLAIN)
    assert modes == EXPLORE + [False] * P + [True] * W + [False] * W + [False] * P
    modes = drive(gate, clock, 2 * W + 4, FAST_DRAFT, PLAIN)
    assert modes == [True] * W + [False] * W + [True] * 4
    assert gate.num_epochs == 3


def test_no_switch_on_a_dip_inside_the_exploit_phase():
    """Draft wins; a window's run of bad verifies (1 token each, slower than plain) inside the exploit phase does
    not switch (the check at 4 windows sees those steps as a whole); the next epoch comes after P steps."""
    gate, clock = make_gate(exploit_steps=P)
    dip = lambda i: (1, 0.9e-3) if 2 * W + 5 <= i < 3 * W + 5 else FAST_DRAFT  # noqa: E731
    modes = drive(gate, clock, 2 * W + P + 1, dip, PLAIN)
    assert modes == EXPLORE + [True] * P + [False]


def test_a_wrong_draft_choice_is_checked_and_re_measured_early():
    """Drafts that looked fast in their window but are slow afterwards: 4 windows into the exploit phase the
    winner's steps lose to plain's window, so the epoch ends early (loser, plain, first), not after P steps."""
    gate, clock = make_gate(exploit_steps=10 * P)
    draft = lambda i: FAST_DRAFT if i < W else SLOW_DRAFT  # noqa: E731
    modes = drive(gate, clock, 2 * W + 4 * W + 2 * W + 3, draft, PLAIN)
    assert modes == EXPLORE + [True] * 4 * W + [False] * W + [True] * W + [False] * 3


def test_one_long_step_does_not_decide():
    """A 100 ms step (a GC pause) among 0.4 ms plain steps counts as 4 medians: draft, 1.25x plain's rate in this
    bucket, still wins; in the draft window, plain still wins against draft at 0.8x."""
    for at, draft, want in ((W + 1, FAST_DRAFT, True), (1, SLOW_DRAFT, False)):
        gate, clock = make_gate()
        plain = lambda i: (1, 0.1) if i == at else PLAIN  # noqa: E731
        slow = lambda i: (draft[0], 0.1) if i == at else draft  # noqa: E731
        modes = drive(gate, clock, 2 * W + 4, slow if at < W else draft, plain if at >= W else PLAIN)
        assert modes[2 * W:] == [want] * 4, at


def test_the_rate_is_per_sequence():
    """Draft measured at 5 sequences, plain at 8 in one bucket (8), the same time a step: per sequence draft's
    1.5 tokens a step beat plain's 1 (total tokens would say 7.5 < 8)."""
    assert window_rate([(1.5, 1e-3)] * 4) > window_rate([(1.0, 1e-3)] * 4)
    gate, clock = make_gate()
    gate.record(5, True, 5, False)
    for n, on in [(5, True)] * W + [(8, False)] * W:
        assert gate.drafts_on(n) is on
        clock.now_s += 1e-3
        gate.record(n, on, round(n * 1.5) if on else n, True)
    assert gate.drafts_on(8) and gate.drafts_on(5)


def test_buckets_are_independent():
    """1 stream measures plain faster, 3 streams (bucket 4) drafts faster; 4 shares bucket 4, 5 (bucket 8) is
    unmeasured and starts with drafts."""
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
    for _ in range(W):  # plain steps, each after a 10 s prefill step of 1000 tokens or a 10 s unmeasured one
        on = gate.drafts_on(1)
        clock.now_s += 10.0
        gate.record(1, on, 1000, False)
        clock.now_s += 10.0
        gate.record(1, None, 1000, True)
        clock.now_s += PLAIN[1]
        gate.record(1, on, PLAIN[0], True)
    assert not gate.drafts_on(1) and gate.num_epochs == 1


def test_off_always_drafts_and_bad_settings_fail():
    gate, clock = make_gate("off")
    assert drive(gate, clock, 20, SLOW_DRAFT, PLAIN) == [True] * 20
    with pytest.raises(ConfigError, match="speculative_gate must be one of auto, off, not 'on'"):
        DraftGate("on")
    with pytest.raises(ConfigError, match="exploit_steps >= 0"):
        DraftGate(window=8, exploit_steps=-1)


def test_the_setting_reaches_the_scheduler():
    assert EngineConfig().speculative_gate == DEFAULT_GATE
    with pytest.raises(ConfigError, match="speculative_gate must be one of auto, off"):
        EngineConfig(speculative_gate="always").validate()  # fails at startup with speculation off too
    assert speculation(EngineConfig(speculative_method="ngram", speculative_gate="auto").validate())["gate"].is_auto
    assert not speculation(EngineConfig(speculative_method="ngram", speculative_gate="off"))["gate"].is_auto
    args = build_parser().parse_args(["serve", "--speculative-gate", "off"])
    assert args.speculative_gate == "off"


class _Fixed:
    """A gate stub that always answers `on` (a fixed mode, the baseline)."""

    is_auto = False

    def __init__(self, on: bool):
        self.on = on

    def drafts_on(self, num_running: int) -> bool:
        return self.on

    def record(self, *args) -> None:
        pass


def simulate(gate, clock, ratio, seed, steps=12000, k=4, running=lambda i: 1, spike_at=None, persist=0.8):
    """Output tokens per second of `steps` decode steps in the modes `gate` picks, on the fake clock. Plain: 1
    token per sequence in 1 ms (+-10%); draft: 1..k + 1 tokens per sequence, the same as its last verify with
    probability `persist` (acceptance correlated along an answer), else uniform, in a time that makes draft's
    mean rate `ratio` times plain's; step time independent of the sequences (memory bound); spike_at: that step
    takes 100 ms more (a GC pause)."""
    rng = random.Random(seed)
    draft_s = (k + 2) / 2 * 1e-3 / ratio
    state: dict[int, int] = {}
    tokens, start_s = 0, clock.now_s
    gate.record(running(0), gate.drafts_on(running(0)), 1, False)
    for i in range(steps):
        n = running(i)
        on = gate.drafts_on(n)
        if on:
            for j in range(n):
                if j not in state or rng.random() >= persist:
                    state[j] = rng.randint(1, k + 1)
            step_tokens, seconds = sum(state[j] for j in range(n)), draft_s * rng.uniform(0.9, 1.1)
        else:
            step_tokens, seconds = n, 1e-3 * rng.uniform(0.9, 1.1)
        clock.now_s += seconds + (0.1 if i == spike_at else 0.0)
        tokens += step_tokens
        gate.record(n, on, step_tokens, True)
    return tokens / (clock.now_s - start_s)


def _drift(i: int) -> int:
    return 5 + (i // 37) * 7 % 4  # 5..8 (bucket 8), changing every 37 steps


@pytest.mark.parametrize("ratio, kw", [
    (1.5, {}), (1.2, {}), (0.8, {}), (0.7, {}),
    (1.2, {"running": _drift}), (0.8, {"running": _drift}),
    (1.2, {"spike_at": 40}), (0.8, {"spike_at": 10}),
], ids=["1.5x", "1.2x", "0.8x", "0.7x", "drift-1.2x", "drift-0.8x", "spike-1.2x", "spike-0.8x"])
def test_noisy_steps_reach_the_better_fixed_mode(ratio, kw):
    """Default window and exploit phase, seeded noise: the gate's output tokens/s is >= 0.95 of the better of
    always drafting and never drafting (the simulation of docs/status.md; 1 stream unless the concurrency drifts
    5..8 inside bucket 8; one 100 ms step)."""
    got = []
    for seed in range(3):
        clock = FakeClock()
        gate = simulate(DraftGate(clock=clock), clock, ratio, seed, **kw)
        best = max(simulate(_Fixed(on), FakeClock(), ratio, seed, **kw) for on in (False, True))
        got.append(gate / best)
    assert sum(got) / len(got) >= 0.95, got


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
    gate_before = s.gate_output_len(plan)
    s.update(plan, sampled)
    s.record_step(plan, s.gate_output_len(plan) - gate_before)
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
    # the prefill step is not measured (is_decode_only False)
    assert gate.records == [(2, on, tokens, i > 0) for i, (_, tokens) in enumerate(steps)]
    assert (s.num_gate_draft_steps, s.num_gate_plain_steps) == ((5, 0) if on else (0, 5))


class PreparedDrafter(FakeDrafter):
    """A FakeDrafter that, like a draft model, computes its drafts before the plan (`needs_prepare`)."""

    needs_prepare = True


@pytest.mark.parametrize("on", [False, True])
def test_draft_work_follows_the_gate(on):
    """A draft model is asked for drafts only while the gate says draft (its work is wasted otherwise)."""
    s = make_scheduler(drafter=PreparedDrafter(lambda tokens: tokens[-3:]), ladder=DraftLadder(3),
                       gate=FixedGate(on), num_blocks=128, draft_max_pause=0)
    s.add(make_seq([5, 6, 7], max_tokens=30))
    _step(s)  # the prefill
    assert (s.draft_work() != []) is on
    assert s.draft_work() == ([(s.running[0], 3)] if on else [])


def test_the_gate_gets_the_tokens_a_step_really_added():
    """A verify whose tokens run past EOS: the gate is told the tokens kept (up to EOS), not the verify's."""
    gate = FixedGate(True)
    s = make_scheduler(eos=(0,), drafter=FakeDrafter(lambda tokens: [9, 9, 9]), ladder=DraftLadder(3), gate=gate,
                       num_blocks=128, draft_max_pause=0)
    seq = make_seq([5, 6, 7], max_tokens=30)
    s.add(seq)
    _step(s)  # the prefill
    plan = s.schedule()
    before = s.gate_output_len(plan)
    s.update(plan, {seq.seq_id: [9, 0, 9, 4]})  # two drafts pass, then EOS: the last two are dropped
    s.record_step(plan, s.gate_output_len(plan) - before)
    assert seq.is_finished and gate.records[-1] == (1, True, 2, True)


def test_planned_ahead_steps_count_only_the_tokens_they_add():
    """Plain steps planned ahead (`run_steps`, a fake asynchronous runner): a step ahead of a sequence that
    finished with the step before adds nothing to it, and the gate is told so (not 1 per entry)."""
    gate = FixedGate(False)
    s = make_scheduler(drafter=FakeDrafter(lambda tokens: tokens[-3:]), ladder=DraftLadder(3), gate=gate,
                       num_blocks=128, draft_max_pause=0)
    seqs = [make_seq([5, 6, 7], max_tokens=3), make_seq([8, 9], max_tokens=6)]
    for seq in seqs:
        s.add(seq)
    runner = FakeAsyncRunner()
    run_steps(s, runner)
    assert runner.fed > 0 and sum(tokens for _, _, tokens, _ in gate.records) == 9
    assert (2, False, 1, True) in gate.records  # the first sequence's step ahead after its last token


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
    gate = DraftGate(window=W, exploit_steps=P, clock=clock)
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
