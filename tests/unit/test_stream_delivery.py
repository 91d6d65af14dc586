"""Delta delivery from the scheduler actor to a RequestStream: merging, deferred wake-up, and its ordering
against the worker's next step."""

from __future__ import annotations

import asyncio

import pytest

from actors.base import Actor
from actors.scheduler import AddRequestMsg, SchedulerActor
from actors.stream import RequestStream
from tests.api.fake_engine import ByteTokenizer
from tests.helpers import make_scheduler, make_seq
from voltserve.config import EngineConfig
from voltserve.errors import ConfigError, EngineDeadError
from voltserve.request import FinishReason, RequestOutput
from voltserve.runner import StepHandle

A = 3 + ord("a")  # ByteTokenizer: id 3 + b is byte b


def _out(index: int, token: int, text: str, finish=None, num_output_tokens=1) -> RequestOutput:
    return RequestOutput("r", index, [token], text, None, finish, None, 3, 0, num_output_tokens)


async def test_deferred_wake_and_merge():
    stream = RequestStream("r", 2, abort=lambda rid: None)
    got = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the consumer now waits
    stream.put(_out(0, A, "a"), wake=False)
    stream.put(_out(0, A + 1, "b", num_output_tokens=2), wake=False)  # not taken yet: merges
    stream.put(_out(1, A, "a"), wake=False)
    await asyncio.sleep(0)
    assert not got.done()  # no wake-up yet
    stream.wake()
    first = await got
    assert (first.index, first.token_ids, first.text, first.num_output_tokens) == (0, [A, A + 1], "ab", 2)
    second = await stream.__anext__()
    assert (second.index, second.token_ids, second.text) == (1, [A], "a")
    stream.put(_out(0, A, "a", FinishReason.LENGTH, 3))
    stream.put(_out(0, A, "late"))  # nothing follows a finished sequence
    stream.put(_out(1, A, "", FinishReason.STOP, 2))
    assert [(o.index, o.text, o.finish_reason) for o in [o async for o in stream]] == [
        (0, "a", FinishReason.LENGTH), (1, "", FinishReason.STOP)]
    assert stream.finished


class _Worker(Actor):
    """Answers StepMsg like WorkerActor for steps that run synchronously: a launch runs the step (token `A` for
    every sampling entry after a short "device" wait) and returns its handle; a collect returns its results.
    Counts the steps handed to it."""

    def __init__(self):
        super().__init__("worker-double")
        self.steps_started = 0

    async def handle(self, msg):
        launched = None
        if msg.launch is not None:
            self.steps_started += 1
            await asyncio.sleep(0.002)
            launched = StepHandle(msg.launch, result=({e.seq.seq_id: A for e in msg.launch.entries if e.sample}, {}))
        return launched, msg.collect.result if msg.collect is not None else None


async def test_consumers_wake_after_the_next_step_is_handed_to_the_worker():
    worker = _Worker()
    actor = SchedulerActor(make_scheduler(), worker, ByteTokenizer())
    worker.start()
    actor.start()
    streams = [RequestStream(f"r{i}", 1, abort=lambda rid: None) for i in range(3)]
    for i, stream in enumerate(streams):
        actor.tell(AddRequestMsg((make_seq([A, A], max_tokens=4, request_id=f"r{i}"),), stream))

    async def consume(stream):  # steps the worker had been given when each delta arrived
        return [(out.text, worker.steps_started) async for out in stream]

    seen = await asyncio.wait_for(asyncio.gather(*(consume(s) for s in streams)), 5)
    await actor.stop()
    await worker.stop()
    # delta k (from step k) arrives once step k + 1 is already with the worker; the last one has no next step
    assert seen == [[("a", 2), ("a", 3), ("a", 4), ("a", 4)]] * 3


class _RecordingStream(RequestStream):
    """Records, for every delta put, how many steps the worker had been handed by then."""

    def __init__(self, request_id: str, worker: _Worker):
        super().__init__(request_id, 1, abort=lambda rid: None)
        self.worker = worker
        self.put_at: list[int] = []

    def put(self, out, wake=True):
        self.put_at.append(self.worker.steps_started)
        super().put(out, wake)


async def test_detokenization_overlaps_the_next_step_unless_stop_strings():
    worker = _Worker()
    actor = SchedulerActor(make_scheduler(), worker, ByteTokenizer())
    worker.start()
    actor.start()
    plain, stopping = _RecordingStream("plain", worker), _RecordingStream("stop", worker)
    actor.tell(AddRequestMsg((make_seq([A, A], max_tokens=4, request_id="plain"),), plain))
    seq = make_seq([A, A], max_tokens=4, request_id="stop")
    seq.params.stop = ["zz"]  # never matches, but must be checked before the next step
    actor.tell(AddRequestMsg((seq,), stopping))
    async def texts(stream) -> str:
        return "".join([o.text async for o in stream])

    got = await asyncio.wait_for(asyncio.gather(texts(plain), texts(stopping)), 5)
    await actor.stop()
    await worker.stop()
    assert got == ["aaaa", "aaaa"]
    # delta k (step k) is detokenized and put once step k + 1 is with the worker; with stop strings, before it
    assert plain.put_at == [2, 3, 4, 4] and stopping.put_at == [1, 2, 3, 4]


async def _waits(fut) -> bool:
    """Whether the consumer's __anext__ still waits after the loop ran every ready callback."""
    for _ in range(3):
        await asyncio.sleep(0)
    return not fut.done()


async def _got(fut):
    return await asyncio.wait_for(fut, 1)  # a regression fails here instead of hanging the run


async def test_stream_interval_first_delta_at_once_then_groups():
    """interval 3 (EngineConfig.stream_interval): the first delta goes out at once (time to first token); then
    deltas stay pending (merged) until 3 tokens wait and go out as one; a finished sequence goes out at once."""
    stream = RequestStream("r", 1, abort=lambda rid: None, interval=3)
    got = asyncio.ensure_future(stream.__anext__())
    stream.put(_out(0, A, "a"))
    assert (await _got(got)).text == "a"
    got = asyncio.ensure_future(stream.__anext__())
    stream.put(_out(0, A + 1, "b", num_output_tokens=2))
    stream.put(_out(0, A + 2, "c", num_output_tokens=3))
    assert await _waits(got)
    stream.put(_out(0, A + 3, "d", num_output_tokens=4))
    first = await _got(got)
    assert (first.token_ids, first.text, first.num_output_tokens) == ([A + 1, A + 2, A + 3], "bcd", 4)
    got = asyncio.ensure_future(stream.__anext__())
    stream.put(_out(0, A + 4, "e", num_output_tokens=5))
    assert await _waits(got)
    stream.put(_out(0, A + 5, "f", FinishReason.LENGTH, 6))
    last = await _got(got)
    assert (last.token_ids, last.text, last.finish_reason) == ([A + 4, A + 5], "ef", FinishReason.LENGTH)
    assert [o async for o in stream] == [] and stream.finished


async def test_stream_interval_counts_every_sequence_and_defers_wakes():
    """n = 2 at interval 4: tokens of both sequences count together; the producer's deferred wake-up (`put(...,
    wake=False)` then `wake()`, as the scheduler actor and the engine process deliver a step) waits for them too;
    one sequence's finish hands over everything pending."""
    stream = RequestStream("r", 2, abort=lambda rid: None, interval=4)
    stream.put(_out(0, A, "a"), wake=False)
    stream.wake()
    assert (await _got(stream.__anext__())).text == "a"
    got = asyncio.ensure_future(stream.__anext__())
    for step in range(1, 3):  # two steps of both sequences: 4 tokens
        stream.put(_out(0, A + step, "x"), wake=False)
        stream.put(_out(1, A + step, "y"), wake=False)
        stream.wake()
        if step == 1:
            assert await _waits(got)
    assert ((await _got(got)).index, stream.pop_ready().index) == (0, 1)
    got = asyncio.ensure_future(stream.__anext__())
    stream.put(_out(1, A, "z"), wake=False)
    stream.wake()
    assert await _waits(got)
    stream.put(_out(0, A, "", FinishReason.STOP, 4))
    outs = [await _got(got), stream.pop_ready()]
    assert {(o.index, o.text, o.finish_reason) for o in outs} == {(1, "z", None), (0, "", FinishReason.STOP)}


async def test_stream_interval_yields_to_keep_alive_and_errors():
    """Below the interval, `interrupt()` (the SSE keep-alive) hands over what is pending (None when nothing is),
    and a failed stream hands over its pending delta before the error."""
    stream = RequestStream("r", 1, abort=lambda rid: None, interval=4)
    got = asyncio.ensure_future(stream.__anext__())
    assert await _waits(got)
    stream.interrupt()
    assert await _got(got) is None
    stream.put(_out(0, A, "a"))
    assert (await _got(stream.__anext__())).text == "a"  # the first delta: at once
    got = asyncio.ensure_future(stream.__anext__())
    stream.put(_out(0, A + 1, "b", num_output_tokens=2))
    assert await _waits(got)
    stream.interrupt()
    assert (await _got(got)).text == "b"
    got = asyncio.ensure_future(stream.__anext__())
    stream.put(_out(0, A + 2, "c", num_output_tokens=3))
    stream.fail(RuntimeError("device lost"))
    assert (await _got(got)).text == "c"
    with pytest.raises(EngineDeadError):
        await _got(stream.__anext__())


def test_stream_interval_must_be_positive():
    with pytest.raises(ConfigError, match="stream_interval"):
        EngineConfig(stream_interval=0).validate()
