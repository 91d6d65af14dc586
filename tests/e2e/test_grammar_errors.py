"""Schemas that compile but that llguidance cannot decode (its resource limits), through the APIs on the real
engine (default model, CPU): refused with a 400 at request time when they fail on the output's forced start, and,
where they fail later (the request-time walk switched off here), the request fails with an error (a 400, or an
error event mid-stream) instead of ending as a "stop" with truncated output. Cases A1 and T13 of
../shared/cases/api-behaviour.md: a forced tool never reports an empty answer as a normal end."""

from __future__ import annotations

import contextlib
import logging

import orjson

from actors.engine import AsyncEngine
from api import create_app
from voltserve import grammar
from voltserve.config import EngineConfig

MODEL = "smollm2-135m-instruct"
SELF_REF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # {"a": {"a": ...}} forever
HUGE_REGEX = {"type": "string", "pattern": "^a{1000000}$"}
TOO_MANY_ITEMS = "parser error: Too many items (limit 50000; ff_tokens); try avoiding single-byte/short lexemes"
TOO_MANY_EXPRESSIONS = "lexer error: too many expressions constructed"
CANNOT_FOLLOW = "constrained decoding cannot follow the grammar it asks for: "
AT_DECODE = "constrained decoding failed on the grammar this request asks for (its JSON schema or tool parameters): "
PARAMETERS = {"type": "object", "properties": {"p": HUGE_REGEX}, "required": ["p"]}
OK_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(schema: dict | None = None, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 30, "temperature": 0}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {**body, **extra}


CHAT_TOOL = _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": PARAMETERS}}],
                  tool_choice={"type": "function", "function": {"name": "f"}})
MESSAGES_TOOL = {"model": MODEL, "max_tokens": 30, "temperature": 0, "messages": [{"role": "user", "content": "go"}],
                 "tools": [{"name": "f", "input_schema": PARAMETERS}], "tool_choice": {"type": "tool", "name": "f"}}


def _openai_error(message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def _anthropic_error(message: str) -> dict:
    return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


@contextlib.asynccontextmanager
async def _served(loaded):
    engine = AsyncEngine(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=128, max_model_len=2048),
                         loaded=loaded)
    async with create_app(engine).test_app() as test_app:
        yield test_app.test_client(), engine


async def _post(client, url: str, body: dict) -> tuple[int, bytes]:
    response = await client.post(url, json=body)
    return response.status_code, await response.get_data()


async def _assert_serves_json_and_frees_blocks(client, engine) -> None:
    """A normal json_schema request right after: answered in full; no KV block or sequence left behind."""
    status, data = await _post(client, "/v1/chat/completions", _chat(OK_SCHEMA))
    choice = orjson.loads(data)["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop"
    assert set(orjson.loads(choice["message"]["content"])) == {"a"}
    stats = engine.kv_stats()
    assert (stats["num_running"], stats["num_waiting"], stats["num_free_blocks"]) == (0, 0, stats["num_blocks"])
    engine._scheduler_actor.scheduler.pool.check_invariants()


async def test_a_schema_that_fails_on_its_forced_start_is_a_400(smollm2):
    """Its first tokens are forced (`{"a":` again and again; `"` then a million a's): llguidance's limits fail
    there, so the request is refused before it is queued, naming the field."""
    def fails(param: str, why: str) -> str:
        return f"invalid {param}: {CANNOT_FOLLOW}{why}"

    cases = [  # (url, request, the error body)
        ("/v1/chat/completions", _chat(SELF_REF), _openai_error(fails("response_format", TOO_MANY_ITEMS),
                                                                "response_format")),
        ("/v1/chat/completions", _chat(HUGE_REGEX), _openai_error(fails("response_format", TOO_MANY_EXPRESSIONS),
                                                                  "response_format")),
        ("/v1/chat/completions", _chat(HUGE_REGEX, stream=True),
         _openai_error(fails("response_format", TOO_MANY_EXPRESSIONS), "response_format")),
        # a tool's schema: its own field is blamed (Anthropic's message starts with it)
        ("/v1/chat/completions", CHAT_TOOL, _openai_error(
            f"Invalid schema for function 'f': {CANNOT_FOLLOW}{TOO_MANY_EXPRESSIONS}", "tools.0.function.parameters")),
        ("/v1/messages", MESSAGES_TOOL,
         _anthropic_error(f"tools.0.custom.input_schema: {CANNOT_FOLLOW}{TOO_MANY_EXPRESSIONS}")),
    ]
    async with _served(smollm2) as (client, engine):
        for url, body, error in cases:
            status, data = await _post(client, url, body)
            assert (status, orjson.loads(data)) == (400, error), (url, body)
        await _assert_serves_json_and_frees_blocks(client, engine)


async def test_a_grammar_failing_mid_output_fails_the_request(smollm2, monkeypatch, caplog):
    """The same schemas with the request-time walk off stand for any failure after tokens the model chose: the
    request fails (400 / an in-band error event), never a 200 with finish "stop" and truncated output; the
    llguidance message is logged once per request through our logger."""
    monkeypatch.setattr(grammar, "grammar_error", lambda *args: None)  # the engine still compiles the grammar
    chat_error = orjson.dumps(_openai_error(AT_DECODE + TOO_MANY_EXPRESSIONS, None))
    async with _served(smollm2) as (client, engine):
        with caplog.at_level(logging.WARNING, logger="actors.scheduler"):
            status, data = await _post(client, "/v1/chat/completions", _chat(SELF_REF))
            assert (status, orjson.loads(data)) == (400, _openai_error(AT_DECODE + TOO_MANY_ITEMS, None))
            assert await _post(client, "/v1/chat/completions", _chat(HUGE_REGEX)) == (400, chat_error)
            for body in (_chat(HUGE_REGEX, stream=True), {**CHAT_TOOL, "stream": True}):
                status, data = await _post(client, "/v1/chat/completions", body)
                events = data.split(b"\n\n")
                assert status == 200 and b'"role":"assistant"' in events[0], data  # the status was out already
                assert events[1:] == [b"data: " + chat_error, b"data: [DONE]", b""], data
            status, data = await _post(client, "/v1/chat/completions", CHAT_TOOL)
            assert (status, data) == (400, chat_error)
            status, data = await _post(client, "/v1/messages", MESSAGES_TOOL)
            assert (status, orjson.loads(data)) == (400, _anthropic_error(AT_DECODE + TOO_MANY_EXPRESSIONS))
            status, data = await _post(client, "/v1/messages", {**MESSAGES_TOOL, "stream": True})
            assert status == 200 and data.endswith(b"event: error\ndata: " + orjson.dumps(
                _anthropic_error(AT_DECODE + TOO_MANY_EXPRESSIONS)) + b"\n\n"), data
            # n = 2: the request fails once; the sibling sequence ends with it (its blocks freed too)
            status, data = await _post(client, "/v1/chat/completions", _chat(HUGE_REGEX, n=2, temperature=1.0))
            assert (status, data) == (400, chat_error)
        warnings = [r.getMessage() for r in caplog.records if r.name == "actors.scheduler"]
        assert len(warnings) == 8 and all("constrained decoding failed" in w for w in warnings), warnings
        assert warnings[0].endswith(TOO_MANY_ITEMS) and warnings[1].endswith(TOO_MANY_EXPRESSIONS)
        await _assert_serves_json_and_frees_blocks(client, engine)

