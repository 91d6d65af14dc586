"""SSE keep-alive over a RequestStream: `RequestStream.interrupt()` wakes an idle consumer, `sse.IdleTimer` calls
it after `--sse-keep-alive-interval` seconds without a chunk, and `drive_stream` writes the comment (no task or
timer per chunk, unlike `sse.with_keep_alive`)."""

from __future__ import annotations

import asyncio

from actors.stream import RequestStream
from api import sse
from api.openai.common import drive_stream
from tests.api.conftest import chat_body
from tests.api.fake_engine import ScriptedEngine, StreamedEngine
from voltserve.request import FinishReason, RequestOutput


def _out(text: str, finish=None, n: int = 1) -> RequestOutput:
    return RequestOutput("r", 0, [3 + ord(text[:1] or "x")], text, None, finish, None, 2, 0, n)


async def test_interrupt_wakes_a_waiting_consumer_with_none():
    stream = RequestStream("r", 1, abort=lambda rid: None)
    assert stream.interrupt() is False  # nobody waits: no effect
    got = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    assert not got.done()
    assert stream.interrupt() is True
    assert await got is None
    # a delta put after an interrupt but before the consumer ran wins over it
    got = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    stream.interrupt()
    stream.put(_out("a"))
    out = await got
    assert (out.text, out.token_ids) == ("a", [3 + ord("a")])
    stream.put(_out("b", FinishReason.STOP, 2))
    assert [(o.text, o.finish_reason) for o in [o async for o in stream]] == [("b", FinishReason.STOP)]


async def test_idle_timer_fires_only_while_idle():
    calls: list[float] = []
    loop = asyncio.get_running_loop()
    timer = sse.IdleTimer(0.1, lambda: calls.append(loop.time()))
    for _ in range(8):  # 0.16 s of touches every 0.02 s: never idle for 0.1 s
        await asyncio.sleep(0.02)
        timer.touch()
    assert calls == []
    last_touch = loop.time()
    await asyncio.sleep(0.25)  # idle: calls ~0.1 and ~0.2 s after the last touch
    timer.close()
    assert len(calls) == 2
    assert calls[0] - last_touch >= 0.1 - 0.002 and calls[1] - calls[0] >= 0.1 - 0.002
    await asyncio.sleep(0.15)
    assert len(calls) == 2  # closed


async def test_idle_timer_fired_means_it_woke_the_consumer():
    """`fired` is set by a call that woke the consumer (on_idle returned True), kept by a later call that found
    nobody waiting (the woken consumer has not run yet), and cleared by `touch()`."""
    woke = [False, True, False]
    timer = sse.IdleTimer(100.0, lambda: woke.pop(0))

    def fire_now() -> None:  # as its timer handle would, once idle for the interval
        timer.last -= 100.0
        timer._fire()

    fire_now()
    assert not timer.fired  # nobody waited
    fire_now()
    assert timer.fired
    fire_now()
    assert timer.fired and woke == []  # still owed
    timer.touch()
    assert not timer.fired
    timer.close()


async def test_drive_stream_keep_alive_over_request_stream():
    stream = RequestStream("r", 1, abort=lambda rid: None)
    events = drive_stream(stream, lambda out, lps: b"data: " + out.text.encode() + b"\n\n", None, (b"first\n\n",),
                          keep_alive_s=0.1)

    async def produce() -> None:
        await asyncio.sleep(0.25)  # idle: two keep-alives
        stream.put(_out("a"))
        await asyncio.sleep(0.03)  # busy: none
        stream.put(_out("b", FinishReason.STOP, 2))

    producer = asyncio.ensure_future(produce())
    chunks = [c async for c in events]
    await producer
    # the final delta goes out in one write with [DONE]
    assert chunks == [b"first\n\n", sse.KEEP_ALIVE, sse.KEEP_ALIVE, b"data: a\n\n", b"data: b\n\n" + sse.DONE]


async def test_keep_alive_when_the_interval_holds_deltas_without_text():
    """With a stream interval, a delta below it that renders no text yet (a split character) is what the
    keep-alive's wake-up hands over: the comment still goes out, once per idle interval."""
    stream = RequestStream("r", 1, abort=lambda rid: None, interval=4)
    events = drive_stream(stream, lambda out, lps: b"data: " + out.text.encode() + b"\n\n", None,
                          keep_alive_s=0.2)

    async def produce() -> None:
        stream.put(_out("a"))  # the first delta: at once
        await asyncio.sleep(0.06)
        stream.put(_out("", n=2))  # no text yet, below the interval: waits
        await asyncio.sleep(0.44)  # idle: keep-alives at ~0.2 (taking the pending delta) and ~0.4 s
        stream.put(_out("b", FinishReason.STOP, 3))

    producer = asyncio.ensure_future(produce())
    chunks = [c async for c in events]
    await producer
    assert chunks == [b"data: a\n\n", sse.KEEP_ALIVE, sse.KEEP_ALIVE, b"data: b\n\n" + sse.DONE]


async def test_keep_alive_through_the_app_with_a_request_stream(serve):
    """Case S1 with the engines' real stream type: comments while the engine stalls, and the same events."""
    body = chat_body(stream=True)

    async def run(engine, **config) -> bytes:
        async with serve(engine, **config) as (client, _):
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            return await response.get_data()

    slow = await run(StreamedEngine(scripts=["ab"], first_delay_s=0.5, delay_s=0.02), sse_keep_alive_interval=0.2)
    plain = await run(ScriptedEngine(scripts=["ab"]))
    assert slow.count(sse.KEEP_ALIVE) == 2
    assert slow.replace(sse.KEEP_ALIVE, b"") == plain
    assert plain.count(b"\n\n") == 5  # role, "a", "b", finish, [DONE]: nothing merged
