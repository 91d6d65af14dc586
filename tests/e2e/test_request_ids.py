"""One request in flight per id, held by the engine itself (`actors.request_ids`, claimed in AsyncEngine.submit):
through add_request and submit of an embedded AsyncEngine, a ProcessEngine, and two API processes of one shared
engine that use the same id. A refused request leaves the one in flight under its id untouched (its tokens, its
KV blocks), and an abort never reaches a later request that reused the id. On the tiny random-weight model."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from actors.core_outputs import OutputForwarder
from actors.engine import AsyncEngine
from actors.engine_process import ProcessEngine
from actors.stream import RequestStream
from tests.e2e.test_shared_engine import _config
from voltserve.config import EngineConfig
from voltserve.errors import InvalidRequestError
from voltserve.request import FinishReason, SamplingParams

pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 8, 9]
SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONGER = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
REFUSED = "request id 'dup' is already in flight"


async def _run(stream) -> tuple[list[int], FinishReason]:
    tokens, last = [], None
    async for out in stream:
        tokens += out.token_ids
        last = out
    return tokens, last.finish_reason


@contextlib.asynccontextmanager
async def _engine(tiny_dir):
    engine = AsyncEngine(EngineConfig(model=str(tiny_dir), device="cpu", max_model_len=512, num_kv_blocks=64))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def test_submit_refuses_an_id_in_flight(tiny_dir):
    """AsyncEngine.submit (the engine process's way in, and add_request's) refuses an id in flight, whatever the
    stream; it used to queue the second request, whose outputs went to one stream while the other waited
    forever."""
    async with _engine(tiny_dir) as engine:
        alone = await _run(engine.add_request(PROMPT, LONGER))
        first = RequestStream("dup", 1, engine.abort)
        engine.submit(PROMPT, LONGER, 160, first)
        forwarder = OutputForwarder(lambda msg: None, engine.kv_stats)
        for second in (RequestStream("dup", 1, engine.abort), forwarder.stream("dup")):
            with pytest.raises(InvalidRequestError) as refused:
                engine.submit([1, 2, 3], SHORT, 6, second)
            assert (str(refused.value), refused.value.param) == (REFUSED, "request_id")
        with pytest.raises(InvalidRequestError, match=REFUSED):
            engine.add_request([1, 2, 3], SHORT, request_id="dup")
        got = await asyncio.wait_for(_run(first), 60)
        again = await asyncio.wait_for(_run(engine.add_request(PROMPT, LONGER, request_id="dup")), 60)
        forwarder.close()
        stats = engine.kv_stats()
    assert got == again == alone and alone[1] is FinishReason.LENGTH and len(alone[0]) == 160
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == stats["num_waiting"] == 0


async def _abort_settled_then_reuse(engine) -> tuple[list[int], FinishReason]:
    """Run a short request under "dup" until its final delta was put (not yet read), start a longer one under
    the same id, then abort the first stream (its consumer leaves); returns the second's tokens and reason."""
    first = engine.add_request(PROMPT, SHORT, request_id="dup")
    await asyncio.wait_for(first.__anext__(), 60)
    while not first.settled:
        await asyncio.sleep(0.01)
    second = engine.add_request(PROMPT, LONGER, request_id="dup")
    first.abort()
    return await asyncio.wait_for(_run(second), 60)


@pytest.mark.parametrize("in_process", [True, False])
async def test_abort_of_a_settled_stream_spares_the_ids_next_request(tiny_dir, in_process):
    """An abort is by id: a stream whose request ended must not abort the request that took its id meanwhile
    (it used to, in an AsyncEngine and through a ProcessEngine alike)."""
    if in_process:
        async with _engine(tiny_dir) as engine:
            tokens, reason = await _abort_settled_then_reuse(engine)
            stats = engine.kv_stats()
    else:
        engine = ProcessEngine(EngineConfig(model=str(tiny_dir), device="cpu", max_model_len=512,
                                            num_kv_blocks=64, engine_process=True))
        await engine.start()
        try:
            tokens, reason = await _abort_settled_then_reuse(engine)
            stats = await engine.refresh_kv_stats()
        finally:
            await engine.stop()
    assert reason is FinishReason.LENGTH and len(tokens) == 160
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == 0


async def _tokens_until(stream, tokens: list[int], num_tokens: int) -> FinishReason | None:
    """Read `stream` into `tokens` until it holds `num_tokens` or the stream ends; returns its finish reason."""
    while len(tokens) < num_tokens:
        out = await asyncio.wait_for(stream.__anext__(), 60)
        tokens += out.token_ids
        if out.finish_reason is not None:
            return out.finish_reason
    return None


async def test_two_api_processes_of_one_engine_cannot_share_an_id(tiny_dir, sock_path):
    """Each API process only knows its own ids, so the shared engine refuses the second process's request under an
    id the first one's request holds (its stream fails with the 400 error), and that process's abort of the id
    leaves the first one's request running. It used to take the first one's outputs or kill the engine
    (KeyError in the scheduler actor)."""
    first, second = ProcessEngine(_config(tiny_dir, sock_path)), ProcessEngine(_config(tiny_dir, sock_path))
    await first.start()
    await second.start()
    try:
        alone = await asyncio.wait_for(_run(first.add_request(PROMPT, LONGER)), 60)
        # runs until aborted (its context is 4,096 tokens)
        running = first.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                                    request_id="dup")
        tokens = list((await asyncio.wait_for(running.__anext__(), 60)).token_ids)
        refused = second.add_request([1, 2, 3], SHORT, request_id="dup")
        with pytest.raises(InvalidRequestError) as error:
            await asyncio.wait_for(_run(refused), 60)
        assert (str(error.value), error.value.param) == (REFUSED, "request_id")
        second.abort("dup")  # not its request: ignored
        await second.refresh_kv_stats()  # a round trip: the engine has handled the abort
        # an abort would end it within 2 steps
        assert await _tokens_until(running, tokens, len(tokens) + 40) is None
        running.abort()
        reason = None
        while reason is None:
            reason = await _tokens_until(running, tokens, len(tokens) + 1)
        later = await asyncio.wait_for(_run(second.add_request(PROMPT, LONGER, request_id="dup")), 60)
        stats = await second.refresh_kv_stats()
    finally:
        await second.stop()
        await first.stop()
    assert reason is FinishReason.ABORT and len(tokens) > 40 and tokens[:40] == alone[0][:40]
    assert later == alone and len(alone[0]) == 160
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == stats["num_waiting"] == 0
