"""Keep-alive comments (case S1), client disconnects aborting the engine request, engine death mid-stream."""

from __future__ import annotations

import asyncio

import orjson
from tests.api.conftest import MODEL, chat_body, leave_mid_stream, stream_until_engine_dies, wait_for_abort
from tests.api.fake_engine import ScriptedEngine
from voltserve.request import SamplingParams

from api import sse


async def _stream(serve, engine, path, body, **config) -> bytes:
    async with serve(engine, **config) as (client, _):
        response = await client.post(path, json=body)
        assert response.status_code == 200
        return await response.get_data()


async def test_S1_keep_alive_when_engine_stalls(serve):
    body = chat_body(stream=True)
    slow = await _stream(serve, ScriptedEngine(scripts=["ab"], first_delay_s=0.5), "/v1/chat/completions", body,
                         sse_keep_alive_interval=0.2)
    plain = await _stream(serve, ScriptedEngine(scripts=["ab"]), "/v1/chat/completions", body)
    assert slow.count(sse.KEEP_ALIVE) >= 1
    # Comments come only between events, and removing them gives the plain stream back.
    assert slow.replace(sse.KEEP_ALIVE, b"") == plain


async def test_S1_keep_alive_completions(serve):
    body = {"model": MODEL, "prompt": "x", "stream": True}
    slow = await _stream(serve, ScriptedEngine(scripts=["ab"], first_delay_s=0.5), "/v1/completions", body,
                         sse_keep_alive_interval=0.2)
    assert slow.count(sse.KEEP_ALIVE) >= 1


async def test_S1_no_keep_alive_by_default(serve):
    body = chat_body(stream=True)
    stalled = await _stream(serve, ScriptedEngine(scripts=["ab"], first_delay_s=0.5), "/v1/chat/completions", body)
    assert sse.KEEP_ALIVE not in stalled
    assert all(event.startswith(b"data: ") for event in stalled.split(b"\n\n")[:-1])


async def test_keep_alive_does_not_close_source():
    """The pitfall DESIGN.md section 9 names: a timeout must not close the wrapped generator."""
    async def source():
        yield b"a"
        await asyncio.sleep(0.35)
        yield b"b"

    chunks = [c async for c in sse.with_keep_alive(source(), 0.1)]
    assert chunks[0] == b"a" and chunks[-1] == b"b"
    assert set(chunks[1:-1]) == {sse.KEEP_ALIVE} and len(chunks) >= 3


async def test_client_disconnect_aborts_request(serve):
    engine = ScriptedEngine(scripts=["x" * 200], delay_s=0.02)
    async with serve(engine) as (client, _):
        first = await leave_mid_stream(client, chat_body(stream=True))
        assert first.startswith(b"data: ")
        (_, _, request_id), = engine.requests
        await wait_for_abort(engine)
        # the generator's finally aborts at once; the collected-generator backstop may repeat it (abort is
        # idempotent)
        assert engine.aborted and set(engine.aborted) == {request_id}
        # and the server keeps serving
        response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert response.status_code == 200


async def test_finished_stream_is_not_aborted(serve):
    engine = ScriptedEngine(scripts=["ab"])
    await _stream(serve, engine, "/v1/chat/completions", chat_body(stream=True))
    assert engine.aborted == []


async def test_engine_death_mid_stream_reports_error_event(serve):
    engine = ScriptedEngine(scripts=["abcdef"], delay_s=0.05)
    async with serve(engine) as (client, _):
        body = await stream_until_engine_dies(client, engine, "/v1/chat/completions", chat_body(stream=True))
        health = await client.get("/health")
    events = body.split(b"\n\n")
    assert events[-3] == (b'data: {"error":{"message":"scripted engine died","type":"server_error","param":null,'
                          b'"code":"engine_dead"}}')
    assert body.endswith(b"data: [DONE]\n\n")
    assert health.status_code == 503
    assert orjson.loads(await health.get_data())["error"]["code"] == "engine_dead"


async def test_response_dropped_before_first_byte_aborts_request():
    """A client gone before the body starts: the event generator never runs its `finally`, so the request is
    aborted when the unstarted generator is collected (no request runs on for nobody)."""
    import gc

    from api.openai.common import sse_response

    engine = ScriptedEngine(scripts=["x" * 50])
    stream = engine.add_request([5, 6], SamplingParams(max_tokens=50))

    async def events():
        try:
            async for out in stream:
                yield out.text.encode()
        finally:
            stream.abort()

    response = sse_response(events(), stream)
    del response
    gc.collect()
    assert engine.aborted == [stream.request_id]


async def test_E1_watcher_ends_the_server_once_the_engine_dies():
    """Case E1: with exit_on_engine_death the app shuts its process down when the engine dies (a supervisor
    restarts it); a deliberate stop does not count."""
    from api.app import watch_engine

    engine = ScriptedEngine()
    deaths = []
    watcher = asyncio.create_task(watch_engine(engine, lambda: deaths.append(1), interval_s=0.01))
    await asyncio.sleep(0.05)
    assert deaths == [] and not watcher.done()
    engine.healthy = False
    await asyncio.wait_for(watcher, 1)
    assert deaths == [1]

    stopped = ScriptedEngine()
    stopped.healthy, stopped._stopped = False, True
    await watch_engine(stopped, lambda: deaths.append(2), interval_s=0.01)
    assert deaths == [1]


async def test_E1_watcher_returns_at_shutdown():
    """The watcher ends as soon as the server shuts down (Quart waits up to 5 s for background tasks first:
    Ctrl-C on `voltserve serve` took 5.5 s), without calling on_death."""
    from api.app import watch_engine

    engine = ScriptedEngine()
    deaths = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_engine(engine, lambda: deaths.append(1), interval_s=60, stop=stop))
    await asyncio.sleep(0.02)
    assert not watcher.done()
    stop.set()
    await asyncio.wait_for(watcher, 1)
    assert deaths == []
