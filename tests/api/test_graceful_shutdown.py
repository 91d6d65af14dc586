"""Graceful shutdown (`ServerState.drain`, `api.app.SignalDrain`, what `voltserve serve` does on SIGINT /
SIGTERM): new requests and /health get 503 at once, requests in flight finish within the grace period, and the
ones still running after it end cleanly: a stream with an in-band error event and `[DONE]`, a non-streamed
request with a 503, both aborted in the engine (no KV block held)."""

from __future__ import annotations

import asyncio
import os
import signal

import orjson
import pytest
from tests.api.conftest import chat_body
from tests.api.fake_engine import ScriptedEngine, StreamedEngine

from actors.stream import RequestStream
from api.app import SignalDrain
from api.state import EXTENSION_KEY
from voltserve.errors import ServerShuttingDownError
from voltserve.request import FinishReason, RequestOutput, SamplingParams

SHUTDOWN_EVENT = (b'data: {"error":{"message":"the server is shutting down","type":"server_error","param":null,'
                  b'"code":"server_shutting_down"}}')
SHUTDOWN_JSON = {"error": {"message": "the server is shutting down", "type": "server_error", "param": None,
                           "code": "server_shutting_down"}}


def _state(client):
    return client.app.extensions[EXTENSION_KEY]


async def _wait_for(predicate, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_requests_in_flight_finish_within_the_grace_period(serve):
    """A stream that ends within the timeout is untouched (its normal chunks and [DONE]); meanwhile new requests
    and /health answer 503 in the OpenAI error shape, with Retry-After."""
    async with serve(StreamedEngine(scripts=["abcd"], delay_s=0.05)) as (client, engine):
        state = _state(client)
        reply = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(stream=True)))
        await _wait_for(lambda: engine.requests)
        drain = asyncio.create_task(state.drain(5.0))
        await _wait_for(lambda: state.draining)
        refused = await client.post("/v1/chat/completions", json=chat_body())
        health = await client.get("/health")
        body = await (await reply).get_data()
        assert await drain == 0
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert orjson.loads(await refused.get_data()) == SHUTDOWN_JSON
    assert health.status_code == 503
    assert b"server_shutting_down" not in body and body.endswith(b"data: [DONE]\n\n")
    assert b'"finish_reason":"stop"' in body
    assert engine.aborted == [] and len(engine.requests) == 1


@pytest.mark.parametrize("engine_cls", [StreamedEngine, ScriptedEngine])
async def test_requests_past_the_grace_period_end_with_an_error_event(serve, engine_cls):
    """Still running at the deadline: the stream gets the shutdown error event then [DONE] (byte-exact), the
    non-streamed request a 503, and both are aborted in the engine (a real RequestStream, and the test double's
    stream that other API tests use)."""
    async with serve(engine_cls(scripts=["x" * 200], delay_s=0.02)) as (client, engine):
        state = _state(client)
        streamed = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(stream=True)))
        plain = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body()))
        await _wait_for(lambda: len(engine.requests) == 2)
        assert await state.drain(0.1) == 2
        stream_reply, plain_reply = await streamed, await plain
        body = await stream_reply.get_data()
        assert stream_reply.status_code == 200
        events = body.split(b"\n\n")
        assert events[-3] == SHUTDOWN_EVENT and body.endswith(b"data: [DONE]\n\n")
        assert plain_reply.status_code == 503
        assert orjson.loads(await plain_reply.get_data()) == SHUTDOWN_JSON
        assert set(engine.aborted) == {rid for _, _, rid in engine.requests}  # abort is idempotent
        assert state.open_streams() == []
        metrics = (await (await client.get("/metrics")).get_data()).decode()  # still served while draining
    assert ('voltserve:request_failure_total{model_name="test-model",reason="server_shutting_down"} 2.0'
            in metrics.splitlines())


async def test_second_signal_ends_the_wait_at_once(serve):
    """SignalDrain: the first signal starts the drain (timeout 60 s), a second one ends it now; then the
    handlers are gone (a third signal would get the default action)."""
    async with serve(StreamedEngine(scripts=["x" * 200], delay_s=0.02)) as (client, engine):
        state = _state(client)
        streamed = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(stream=True)))
        await _wait_for(lambda: engine.requests)
        drain = SignalDrain(state, 60.0, signals=(signal.SIGUSR1,))
        trigger = asyncio.create_task(drain.trigger())
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)
        await _wait_for(lambda: state.draining)
        assert not trigger.done()
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.wait_for(trigger, 2.0)
        assert not asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)  # already removed
        body = await (await streamed).get_data()
    assert body.split(b"\n\n")[-3] == SHUTDOWN_EVENT
    assert set(engine.aborted) == {engine.requests[0][2]}


async def test_idle_server_drains_at_once(serve):
    async with serve(StreamedEngine()) as (client, _):
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await _state(client).drain(30.0) == 0
        assert loop.time() - start < 0.5


async def test_request_admitted_while_draining_is_refused(serve):
    """A handler that passed ready_engine() before the drain began and awaited (tokenization) meanwhile: its
    request is aborted as it is admitted and answers 503, so no stream the drain missed outlives it."""
    async with serve(StreamedEngine(scripts=["x" * 200], delay_s=0.02)) as (client, engine):
        state = _state(client)
        stream = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50))
        assert await state.drain(5.0) == 0
        with pytest.raises(ServerShuttingDownError):
            state.track(stream)
        assert engine.aborted == [stream.request_id]


async def test_failed_stream_takes_no_final_delta():
    """After fail() (the drain's cut), the engine's abort delta must not end the stream as a normal finish: the
    consumer gets the error."""
    stream = RequestStream("r", 1, lambda rid: None)
    stream.put(RequestOutput("r", 0, [5], "a", None, None, num_prompt_tokens=3, num_output_tokens=1))
    stream.fail(ServerShuttingDownError("the server is shutting down"))
    stream.put(RequestOutput("r", 0, [], "", None, FinishReason.ABORT, num_prompt_tokens=3, num_output_tokens=1))
    assert (await stream.__anext__()).text == "a"
    with pytest.raises(ServerShuttingDownError):
        await stream.__anext__()
    assert stream.done and not stream.finished


class _LoadingEngine:
    """An engine whose start (the model's load) never ends unless cancelled."""

    def __init__(self):
        self.starts, self.cancelled = 0, False

    async def start(self) -> None:
        self.starts += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_a_signal_during_the_start_cancels_it_and_one_before_skips_it():
    """SignalDrain's first signal cancels an engine start under way (`ServerState.cancel_start`): the start returns
    False at once, and the server then shuts down without serving; a signal before the start keeps it from
    beginning. Once the engine serves, a signal only drains (no start to cancel)."""
    from api.state import ServerState
    from voltserve.config import EngineConfig

    engine = _LoadingEngine()
    state = ServerState(engine=engine, config=EngineConfig())
    drain = SignalDrain(state, 1.0, signals=(signal.SIGUSR1,))
    starting = asyncio.create_task(state.start_engine())
    await _wait_for(lambda: engine.starts == 1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert await asyncio.wait_for(starting, 2.0) is False
    assert engine.cancelled and state.start_cancelled and drain.stop.is_set()
    await drain.trigger()  # the shutdown that follows: nothing in flight

    later = ServerState(engine=_LoadingEngine(), config=EngineConfig())
    later.cancel_start("SIGTERM")  # before the start: nothing to cancel yet
    assert await later.start_engine() is False
    assert later.engine.starts == 0 and later.start_cancelled
