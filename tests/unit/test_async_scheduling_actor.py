"""SchedulerActor with asynchronous scheduling (StepMsg launch + feed + collect on a real WorkerActor thread),
driving tests.helpers.FakeAsyncRunner: the streamed tokens equal the synchronous loop's, steps are fed on the
'device', and aborts and stop strings free every KV block."""

from __future__ import annotations

import asyncio

from actors.scheduler import AbortRequestMsg, AddRequestMsg, SchedulerActor
from actors.stream import RequestStream
from actors.worker import WorkerActor
from tests.api.fake_engine import ByteTokenizer
from tests.helpers import FakeAsyncRunner, make_scheduler, make_seq
from voltserve.errors import StepFailedError
from voltserve.offline import run_steps
from voltserve.request import FinishReason

PROMPTS = [[40, 41, 42], [50, 51, 52, 53, 54], [60] * 9]


async def _start(runner, **scheduler_args):
    sched = make_scheduler(block_size=4, eos=(0,), **scheduler_args)
    worker = WorkerActor(runner, name="worker-test")
    actor = SchedulerActor(sched, worker, ByteTokenizer())
    worker.start()
    actor.start()
    return sched, worker, actor


def _add(actor, prompt, max_tokens, rid, **params):
    stream = RequestStream(rid, 1, abort=lambda r: None)
    actor.tell(AddRequestMsg((make_seq(prompt, max_tokens=max_tokens, request_id=rid, **params),), stream))
    return stream


async def _tokens(stream):
    ids, last = [], None
    async for out in stream:
        ids.extend(out.token_ids)
        last = out
    return ids, last.finish_reason


def _sync_tokens(prompts, max_tokens):
    s = make_scheduler(block_size=4, eos=(0,))
    seqs = [make_seq(p, max_tokens=max_tokens) for p in prompts]
    for seq in seqs:
        s.add(seq)
    run_steps(s, FakeAsyncRunner(), pipelined=False)
    return [(seq.output_ids, seq.finish_reason) for seq in seqs]


async def test_streams_equal_the_synchronous_loop_and_steps_are_fed():
    runner = FakeAsyncRunner()
    sched, worker, actor = await _start(runner)
    streams = [_add(actor, p, 12, f"r{i}") for i, p in enumerate(PROMPTS)]
    got = await asyncio.wait_for(asyncio.gather(*(_tokens(s) for s in streams)), 10)
    await actor.stop()
    await worker.stop()
    assert got == _sync_tokens(PROMPTS, 12)
    assert all(reason is FinishReason.LENGTH and len(ids) == 12 for ids, reason in got)
    assert runner.fed >= 5
    assert sched.pool.num_free == sched.pool.num_blocks and not sched.has_work()


async def test_abort_and_stop_string_with_a_step_in_flight_free_every_block():
    runner = FakeAsyncRunner()
    sched, worker, actor = await _start(runner)
    long = _add(actor, PROMPTS[0], 500, "long")
    first = await asyncio.wait_for(long.__anext__(), 5)
    assert first.token_ids
    actor.tell(AbortRequestMsg("long"))
    rest = [out async for out in long]
    assert rest[-1].finish_reason is FinishReason.ABORT
    # a stop string on the text of the third token: the byte of next_token(...) is chr(id - 3)
    ids, _ = _sync_tokens([PROMPTS[1]], 20)[0]
    stop = ByteTokenizer().decode(ids[2:3])
    stopped = _add(actor, PROMPTS[1], 20, "stop", stop=[stop])
    out_ids, reason = await asyncio.wait_for(_tokens(stopped), 5)
    await actor.stop()
    await worker.stop()
    assert reason is FinishReason.STOP and out_ids == ids[:3]
    assert sched.pool.num_free == sched.pool.num_blocks and not sched.has_work()


class _AheadLaunchFails(FakeAsyncRunner):
    """The first launch of a step ahead (fed) raises, as ModelRunner.launch can after its replay (the device
    sampler's checks, an allocation); records which asynchronous steps were launched and collected."""

    def __init__(self):
        super().__init__()
        self.failed = False
        self.launched, self.collected = [], []

    def launch(self, plan, feed=None):
        if feed is not None and not self.failed:
            self.failed = True
            raise RuntimeError("launch of the step ahead failed")
        handle = super().launch(plan, feed)
        if handle.is_async:
            self.launched.append(handle)
        return handle

    def collect(self, handle):
        self.collected.append(handle)
        return super().collect(handle)


async def test_a_failing_launch_ahead_still_waits_for_the_step_in_flight():
    """The step in flight (whose launch succeeded) must complete before the failure is handled: _fail_step frees
    its sequences' KV blocks and the next launch refills the pinned input mirror that step uploads from, so the
    worker collects it (a device sync) before it reports the failure."""
    runner = _AheadLaunchFails()
    sched, worker, actor = await _start(runner)
    failing = _add(actor, PROMPTS[0], 12, "fails")
    try:
        await asyncio.wait_for(_tokens(failing), 5)
        raise AssertionError("the request should have failed")
    except StepFailedError:
        pass
    assert runner.failed
    assert all(any(c is h for c in runner.collected) for h in runner.launched), \
        "a launched step was left in flight when its failure was handled"
    ok = _add(actor, PROMPTS[1], 6, "ok")  # the engine goes on
    ids, reason = await asyncio.wait_for(_tokens(ok), 5)
    await actor.stop()
    await worker.stop()
    assert reason is FinishReason.LENGTH and len(ids) == 6
    assert sched.pool.num_free == sched.pool.num_blocks and not sched.has_work()


class _FirstLaunchFails(FakeAsyncRunner):
    def launch(self, plan, feed=None):
        if not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("launch failed")
        return super().launch(plan, feed)


async def test_a_failed_request_leaves_no_per_sequence_state():
    """A request that fails (its step raised; likewise a grammar failing mid-output) drops every per-sequence
    record, the logprobs held for its text included: none outlives it, however many requests fail."""
    sched, worker, actor = await _start(_FirstLaunchFails())
    failing = RequestStream("fails", 2, abort=lambda r: None)
    seqs = tuple(make_seq(PROMPTS[0], max_tokens=8, request_id="fails", logprobs=0) for _ in range(2))
    for index, seq in enumerate(seqs):
        seq.index = index
    actor.tell(AddRequestMsg(seqs, failing))
    try:
        await asyncio.wait_for(_tokens(failing), 5)
        raise AssertionError("the request should have failed")
    except StepFailedError:
        pass
    ids, reason = await asyncio.wait_for(_tokens(_add(actor, PROMPTS[1], 4, "ok", logprobs=0)), 5)
    await actor.stop()
    await worker.stop()
    assert reason is FinishReason.LENGTH and len(ids) == 4
    assert (actor.detoks, actor.held_logprobs, actor.seqs, actor.streams) == ({}, {}, {}, {})


async def test_the_last_steps_tokens_stream_while_a_draft_model_drafts():
    """With a drafter that computes its drafts before the step (a draft model: `DraftMsg` on the worker thread),
    the previous step's deferred deltas go out while it runs, not after: each `prepare` here waits (up to 10 s)
    for the stream to receive the token of the step before it."""
    import threading

    from voltserve.spec.ladder import DraftLadder

    delivered, seen = threading.Event(), []

    class WaitingDrafter:
        needs_prepare = True

        def prepare(self, wanted):
            seen.append(delivered.wait(10))  # returns at the delivery; long only on a loaded machine
            delivered.clear()

        def propose(self, seq, k):
            return []

    _, worker, actor = await _start(FakeAsyncRunner(), drafter=WaitingDrafter(), ladder=DraftLadder(2))
    stream = RequestStream("r0", 1, abort=lambda r: None)
    put = stream.put

    def put_and_signal(out, wake=True):
        put(out, wake)
        delivered.set()

    stream.put = put_and_signal
    actor.tell(AddRequestMsg((make_seq(PROMPTS[0], max_tokens=6, request_id="r0"),), stream))
    got = await asyncio.wait_for(_tokens(stream), 30)
    await actor.stop()
    await worker.stop()
    assert got == _sync_tokens(PROMPTS[:1], 6)[0]
    # a prepare before each decode step with room for a draft (not the last), each seeing the token before it
    assert seen == [True] * 4


async def test_a_failing_draft_model_costs_drafts_not_requests(caplog):
    """A draft model whose `prepare` raises: each step runs without drafts, the request streams the plain
    tokens, and the failure is logged at the 1st, 10th, 100th... time, not every step."""
    from voltserve.spec.ladder import DraftLadder

    class BrokenDrafter:
        needs_prepare = True

        def prepare(self, wanted):
            raise RuntimeError("draft model down")

        def propose(self, seq, k):
            return []  # as DraftModelDrafter after a failed prepare: nothing ready

    _, worker, actor = await _start(FakeAsyncRunner(), drafter=BrokenDrafter(), ladder=DraftLadder(2))
    stream = _add(actor, PROMPTS[1], 14, "r0")
    got = await asyncio.wait_for(_tokens(stream), 30)
    await actor.stop()
    await worker.stop()
    assert got == _sync_tokens(PROMPTS[1:2], 14)[0]
    assert actor.num_draft_failures == 12  # a prepare before each decode step with room for a draft
    assert [r.getMessage()[:45] for r in caplog.records if "drafting failed" in r.getMessage()] == \
        ["draft model: drafting failed (1 times so far)", "draft model: drafting failed (10 times so far"]


def test_only_sequences_with_logprobs_count_text_tokens():
    """Token positions (`IncrementalDetokenizer.num_text_tokens`) cost a list entry per token and a token-by-token
    push of a verify step's tokens: kept only for the sequences whose logprobs follow the text."""
    actor = SchedulerActor(make_scheduler(), None, ByteTokenizer())
    plain, counted = make_seq(PROMPTS[0], request_id="plain"), make_seq(PROMPTS[0], request_id="lp", logprobs=0)
    for seq in (plain, counted):
        actor._on_message(AddRequestMsg((seq,), RequestStream(seq.request_id, 1, abort=lambda r: None)))
    assert actor.detoks[plain.seq_id]._token_starts is None and plain.seq_id not in actor.held_logprobs
    assert actor.detoks[counted.seq_id]._token_starts == [] and actor.held_logprobs[counted.seq_id] == []
