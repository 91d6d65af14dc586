"""ProcessEngine (engine in a child process) on the real default model: the same tokens, text and HTTP bodies as
the in-process AsyncEngine; aborts and disconnects free KV blocks; bad requests fail in add_request.

One engine process serves the whole module (its start costs a model load in the child).
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
import pytest_asyncio

from actors.engine import AsyncEngine
from actors.engine_process import ProcessEngine
from api import create_app
from tests.e2e.engine_helpers import chat_ids, complete
from voltserve.config import EngineConfig
from voltserve.errors import ContextLengthError, InvalidRequestError
from voltserve.request import FinishReason, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
MODEL = "smollm2-135m-instruct"
# no prefix cache: usage.cached_tokens would depend on what the engine served before
CONFIG = dict(model=MODEL, device="cpu", num_kv_blocks=256, max_model_len=2048, enable_prefix_caching=False,
              engine_process=True)
CHAT = {"model": MODEL, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def _fixed_id(prefix: str) -> str:
    return prefix + "0"


def _app(engine):
    return create_app(engine, new_id=_fixed_id, clock=lambda: 1700000000)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served():
    """(Quart test client, ProcessEngine) of one app whose engine runs in a child process."""
    engine = ProcessEngine(EngineConfig(**CONFIG))
    app = _app(engine)
    async with app.test_app_class(app, startup_timeout=120) as test_app:  # the child loads the model
        yield test_app.test_client(), engine


async def _chat_bodies(client) -> tuple[bytes, str, list]:
    """(whole response bytes, streamed content joined, streamed frames after the role chunk, parsed)."""
    whole = await (await client.post("/v1/chat/completions", json=CHAT)).get_data()
    body = await (await client.post("/v1/chat/completions", json={
        **CHAT, "stream": True, "stream_options": {"include_usage": True}})).get_data()
    frames = [orjson.loads(f[6:]) for f in body.split(b"\n\n") if f.startswith(b"data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in frames if c["choices"])
    tail = [(c["choices"][0]["finish_reason"] if c["choices"] else None, c.get("usage")) for c in frames[-2:]]
    return whole, content, tail


async def test_http_greedy_stream_and_whole_equal_in_process(served, smollm2):
    client, _ = served
    got = await _chat_bodies(client)
    async with _app(AsyncEngine(EngineConfig(**CONFIG), loaded=smollm2)).test_app() as in_process:
        expected = await _chat_bodies(in_process.test_client())
    assert got[0] == expected[0]  # the whole JSON, byte for byte (fixed id and clock)
    assert orjson.loads(got[0])["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert got[1:] == expected[1:] and got[1] == "The capital of France is Paris."


async def test_tokens_greedy_seeded_and_n2_equal_in_process(served, smollm2):
    _, engine = served
    ids = chat_ids(engine, "Write a haiku about rain.")
    cases = [dict(temperature=0, max_tokens=20), dict(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20),
             dict(temperature=0.8, seed=7, n=2, max_tokens=8, stop=["\n"])]

    async def run_all(eng) -> list:
        out = []
        for params in cases:  # n=2 deltas per index, in order
            outs = [o async for o in eng.generate(ids, SamplingParams(**params))]
            out.append([(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs
                        if o.token_ids or o.finish_reason])
        return out

    got = await run_all(engine)
    in_process = AsyncEngine(EngineConfig(**CONFIG), loaded=smollm2)
    await in_process.start()
    try:
        expected = await run_all(in_process)
    finally:
        await in_process.stop()
    joined = [[t for d in case for t in d[1]] for case in got]
    assert joined == [[t for d in case for t in d[1]] for case in expected]
    assert len(joined[0]) == 20 and len(joined[1]) == 20 and joined[0] != joined[1]
    assert "".join(d[2] for d in got[0]) == "".join(d[2] for d in expected[0])
    assert [d[3:] for d in got[2] if d[3]] == [d[3:] for d in expected[2] if d[3]]


async def test_bad_requests_raise_in_add_request(served):
    _, engine = served
    with pytest.raises(ContextLengthError, match="maximum context length is 2048"):
        engine.add_request([1] * 2048, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError) as bad:
        engine.add_request([1, 2, 3], SamplingParams(temperature=-1))
    assert bad.value.param == "temperature"
    assert engine._streams == {} and engine._commands == []  # nothing registered or queued for the child
    assert engine.is_healthy


async def test_request_id_in_flight_is_refused(served):
    """A caller-chosen request id is refused while a request under it is in flight here (until its last delta came
    back from the child: that delta would end a new stream of the same id); then it is free again."""
    _, engine = served
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = chat_ids(engine, "Tell me a story.")
    first = engine.add_request(prompt, params, request_id="dup")
    with pytest.raises(InvalidRequestError, match="request id 'dup' is already in flight"):
        engine.add_request(prompt, params, request_id="dup")
    tokens = [t async for out in first for t in out.token_ids]
    again = [t async for out in engine.add_request(prompt, params, request_id="dup") for t in out.token_ids]
    assert len(tokens) == 4 and again == tokens and engine._streams == {}


async def test_abort_returns_kv_blocks(served):
    _, engine = served
    stream = engine.add_request(chat_ids(engine, "Count to one thousand."),
                                SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    first = await stream.__anext__()
    stats = engine.kv_stats()  # sent by the child with the step's outputs
    assert first.token_ids and stats["num_running"] == 1 and stats["num_free_blocks"] < stats["num_blocks"]
    stream.abort()
    outs = [o async for o in stream]
    assert outs[-1].finish_reason is FinishReason.ABORT
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] == 256 and stats["num_running"] == 0


async def test_http_disconnect_returns_kv_blocks(served):
    client, engine = served
    body = {**CHAT, "stream": True, "max_tokens": 400, "ignore_eos": True}
    async with client.request("/v1/chat/completions", method="POST",
                              headers={"content-type": "application/json"}) as connection:
        await connection.send(orjson.dumps(body))
        await connection.send_complete()
        assert (await connection.receive()).startswith(b"data: ")  # role delta
        assert b'"content"' in await connection.receive()  # a first token: blocks are in use
        assert engine.kv_stats()["num_free_blocks"] < engine.kv_stats()["num_blocks"]
        await connection.disconnect()
    for _ in range(200):  # the abort reaches the child, which frees the blocks at its next step boundary
        stats = engine.kv_stats()
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
            break
        await asyncio.sleep(0.02)
    assert stats == {**stats, "num_running": 0, "num_waiting": 0, "num_free_blocks": 256}
    _, tokens, last = await complete(engine, chat_ids(engine, "Hi"), temperature=0, max_tokens=3, ignore_eos=True)
    assert len(tokens) == 3 and last.finish_reason is FinishReason.LENGTH


async def test_a_grammar_failing_mid_output_fails_across_the_process_boundary(served):
    """A grammar llguidance fails on while decoding (the API's request-time walk would refuse this one; called
    here on the engine directly, it stands for any failure after tokens the model chose) fails the request in the
    API process with the engine process's InvalidRequestError, once, and frees its KV blocks there; a sibling
    request decoding beside it ends normally."""
    from voltserve.grammar import json_schema_grammar

    _, engine = served
    ids = chat_ids(engine, "Say hi.")
    plain = engine.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    failing = engine.generate(ids, SamplingParams(temperature=0, max_tokens=30, grammar=json_schema_grammar(
        {"type": "string", "pattern": "^a{1000000}$"})))

    async def drain(outputs):
        return [out async for out in outputs]

    done, error = await asyncio.gather(drain(plain), drain(failing), return_exceptions=True)
    assert isinstance(error, InvalidRequestError), error
    assert str(error) == ("constrained decoding failed on the grammar this request asks for (its JSON schema or "
                          "tool parameters): lexer error: too many expressions constructed")
    assert done[-1].finish_reason is FinishReason.LENGTH and done[-1].num_output_tokens == 8
    stats = await engine.refresh_kv_stats()
    assert (stats["num_running"], stats["num_waiting"], stats["num_free_blocks"]) == (0, 0, stats["num_blocks"])
    assert engine.is_healthy and engine._streams == {}
