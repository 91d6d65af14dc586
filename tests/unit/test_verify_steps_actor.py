"""SchedulerActor with speculative verify steps on a real WorkerActor thread: a step that runs at once (verify
steps, the CPU) is one trip to the compute thread, handed over without an event-loop turn, and its streams carry
the tokens, text and finish reasons of plain decoding."""

from __future__ import annotations

import asyncio
import threading

from actors.scheduler import AddRequestMsg, SchedulerActor
from actors.stream import RequestStream
from actors.worker import StepMsg, WorkerActor
from tests.api.fake_engine import ByteTokenizer
from tests.helpers import OracleDrafter, make_scheduler, make_seq, next_token
from voltserve.offline import run_steps
from voltserve.request import FinishReason
from voltserve.runner import StepHandle
from voltserve.spec.ladder import DraftLadder

PROMPTS = [[40, 41, 42], [50, 51, 52, 53, 54], [60] * 9]
EOS_AT = {5: 9}  # prompt length -> output index at which such a sequence samples EOS (id 0)


class VerifyRunner:
    """ModelRunner's launch / collect over the fake model (`next_token`), every step run at once: an entry with
    drafts gets the tokens a greedy verify emits (drafts while they equal the model's, then the model's own).
    Counts launches and the threads they ran on."""

    def __init__(self):
        self.launches = 0
        self.threads: set[str] = set()

    def _token(self, seq, input_id: int, position: int) -> int:
        if EOS_AT.get(len(seq.prompt_ids)) == position + 1 - len(seq.prompt_ids):
            return 0
        return next_token(input_id, position)

    def launch(self, plan, feed=None):
        assert feed is None
        self.launches += 1
        self.threads.add(threading.current_thread().name)
        sampled = {}
        for e in plan.entries:
            seq, last = e.seq, e.start + e.num_new - len(e.drafts) - 1
            token = self._token(seq, seq.token_at(last), last)
            if not e.drafts:
                if e.sample:
                    sampled[seq.seq_id] = token
                continue
            tokens = [token]
            for i, draft in enumerate(e.drafts, 1):
                if draft != tokens[-1]:
                    break
                tokens.append(self._token(seq, draft, last + i))
            sampled[seq.seq_id] = tokens
        return StepHandle(plan, result=(sampled, {}))

    def collect(self, handle):
        return handle.result


def _plain(max_tokens: int, **params) -> list:
    """(tokens, finish reason, stop reason) of each prompt, decoded one token a step without the engine."""
    s = make_scheduler(eos=(0,))
    seqs = [make_seq(p, max_tokens=max_tokens, **params) for p in PROMPTS]
    for seq in seqs:
        s.add(seq)
    run_steps(s, VerifyRunner())
    return [(seq.output_ids, seq.finish_reason, seq.stop_reason) for seq in seqs]


async def _run(max_tokens: int, **params):
    """The three prompts through the actors, drafted by an oracle of the plain outputs (right runs, wrong last
    drafts). Returns (each stream's deltas, the scheduler, the runner, compute-thread calls)."""
    outputs = [tokens for tokens, _, _ in _plain(max_tokens, **params)]
    sched = make_scheduler(eos=(0,), drafter=OracleDrafter(PROMPTS, outputs, 97), ladder=DraftLadder(3))
    runner = VerifyRunner()
    worker = WorkerActor(runner, name="worker-verify")
    calls = []
    step = worker._step
    worker._step = lambda msg: calls.append(msg) or step(msg)
    actor = SchedulerActor(sched, worker, ByteTokenizer())
    worker.start()
    actor.start()
    streams = [RequestStream(f"r{i}", 1, abort=lambda rid: None) for i in range(len(PROMPTS))]
    for i, (prompt, stream) in enumerate(zip(PROMPTS, streams)):
        seq = make_seq(prompt, max_tokens=max_tokens, request_id=f"r{i}", **params)
        actor.tell(AddRequestMsg((seq,), stream))

    async def deltas(stream):
        return [out async for out in stream]

    got = await asyncio.wait_for(asyncio.gather(*(deltas(s) for s in streams)), 10)
    await actor.stop()
    await worker.stop()
    return got, sched, runner, calls


async def test_verify_steps_stream_plain_decodings_tokens_one_trip_a_step():
    got, sched, runner, calls = await _run(14)
    plain = _plain(14)
    for deltas, (tokens, reason, stop_reason) in zip(got, plain):
        # every delta in order, each counting the tokens so far; only the last one finishes
        assert [t for d in deltas for t in d.token_ids] == tokens
        assert [d.num_output_tokens for d in deltas] == [sum(len(x.token_ids) for x in deltas[:i + 1])
                                                           for i in range(len(deltas))]
        assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [reason]
        assert (deltas[-1].stop_reason, "".join(d.text for d in deltas)) == \
            (stop_reason, ByteTokenizer().decode(tokens))
    assert [r for _, r, _ in plain] == [FinishReason.LENGTH, FinishReason.STOP, FinishReason.LENGTH]
    # drafts were verified, and some verify steps emitted several tokens at once
    assert sched.num_verify_steps > 5 and sched.num_accepted_tokens > 5 and any(len(d.token_ids) > 1 for d in got[0])
    # a step that ran at once brought its results back with its launch: no second trip to collect them
    assert len(calls) == runner.launches and all(m.launch is not None and m.collect is None for m in calls)
    assert runner.threads == {"worker-verify_0"}
    assert sched.pool.num_free == sched.pool.num_blocks and not sched.has_work()


async def test_a_stop_string_inside_accepted_drafts_ends_where_plain_decoding_does():
    """A stop string completed by a draft in the middle of a verify's accepted run: the text ends at it, the
    tokens after it are dropped, as in plain decoding (which never makes them)."""
    tokens = _plain(14)[2][0]
    stop = ByteTokenizer().decode(tokens[7:9])  # its verify step emits tokens 7..9
    got, sched, _, _ = await _run(14, stop=[stop])
    deltas = got[2]
    text = "".join(d.text for d in deltas)
    assert text == ByteTokenizer().decode(tokens).split(stop)[0]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (FinishReason.STOP, stop)
    assert [t for d in deltas for t in d.token_ids] == tokens[:9] and deltas[-1].num_output_tokens == 9
    assert deltas[-1].token_ids == tokens[7:9]  # the last delta: that verify's tokens up to the stop string
    assert sched.pool.num_free == sched.pool.num_blocks


async def test_worker_hands_a_step_to_its_thread_without_a_loop_turn():
    """`WorkerActor.ask_nowait` gives the step to the compute thread at once: the thread runs it while the
    caller still holds the event loop (through the actor's mailbox it waited for the loop's next turn)."""
    started = threading.Event()

    class Runner:
        def launch(self, plan, feed=None):
            started.set()
            return StepHandle(plan, result=({}, {}))

    worker = WorkerActor(Runner(), name="worker-direct")
    worker.start()
    plan = make_scheduler().schedule()
    reply = worker.ask_nowait(StepMsg(launch=plan))
    assert started.wait(5)  # blocks the loop: only a step already with the thread can set it
    handle, collected = await reply
    assert handle.result == ({}, {}) and collected is None
    await worker.stop()
