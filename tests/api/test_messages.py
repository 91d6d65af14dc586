"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`) over the ScriptedEngine: exact JSON and SSE
bytes, stop reasons, prefill, usage with the prefix cache, Anthropic-shaped errors, keep-alive (case S1), the text
part of case A4 (the event sequence), disconnects and engine death mid-stream. Tools: test_messages_tools.py."""

from __future__ import annotations


import orjson
import pytest

from api import sse
from tests.api.conftest import MODEL, leave_mid_stream, stream_until_engine_dies, wait_for_abort
from tests.api.fake_engine import ScriptedEngine

URL = "/v1/messages"
USER_HI = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def body(**extra) -> dict:
    """A valid Messages request, with `extra` fields merged in."""
    return {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], **extra}


async def _post(serve, payload: dict, engine: ScriptedEngine | None = None, path: str = URL, **config):
    async with serve(engine, **config) as (client, engine):
        response = await client.post(path, json=payload)
        return response.status_code, await response.get_data(), engine


def _prompt(engine: ScriptedEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1][0], skip_special_tokens=False)


async def test_message_exact_json(serve):
    status, data, engine = await _post(serve, body(), ScriptedEngine(scripts=["Hi there!"]))
    assert status == 200
    assert data == (b'{"id":"msg_0","type":"message","role":"assistant","model":"test-model",'
                    b'"content":[{"type":"text","text":"Hi there!"}],"stop_reason":"end_turn","stop_sequence":null,'
                    b'"usage":{"input_tokens":21,"output_tokens":10,"cache_creation_input_tokens":0,'
                    b'"cache_read_input_tokens":0}}')
    assert _prompt(engine) == USER_HI
    prompt_ids, params, _ = engine.requests[-1]
    assert len(prompt_ids) == 21
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.stop) == (64, 1.0, 1.0, 0, [])


@pytest.mark.parametrize("extra, stop_reason, stop_sequence, text", [
    ({"max_tokens": 3}, "max_tokens", None, "Hi "),
    ({"stop_sequences": ["!"]}, "stop_sequence", "!", "Hi there"),
    ({"stop_sequences": ["zz"]}, "end_turn", None, "Hi there!"),
])
async def test_stop_reasons(serve, extra, stop_reason, stop_sequence, text):
    status, data, _ = await _post(serve, body(**extra), ScriptedEngine(scripts=["Hi there!"]))
    got = orjson.loads(data)
    assert status == 200
    assert (got["stop_reason"], got["stop_sequence"], got["content"]) == \
        (stop_reason, stop_sequence, [{"type": "text", "text": text}])


async def test_sampling_fields_reach_the_engine(serve):
    payload = body(temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["a", "b"], max_tokens=7)
    _, _, engine = await _post(serve, payload)
    params = engine.requests[-1][1]
    assert (params.temperature, params.top_p, params.top_k, params.stop, params.max_tokens, params.n) == \
        (0.5, 0.9, 40, ["a", "b"], 7, 1)


async def test_system_string_and_blocks_and_billing_header(serve):
    """A system prompt as a string or as text blocks (joined with a newline); as in chat (case S2), a first
    line starting with x-anthropic-billing-header is dropped before templating."""
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.2; cch=9"},
              {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    for system in ("Be brief.", blocks):
        _, _, engine = await _post(serve, body(system=system))
        assert _prompt(engine) == "<|im_start|>system\nBe brief.<|im_end|>\n" + USER_HI


@pytest.mark.parametrize("kind", ["adaptive", "between_tools"])
async def test_model_default_thinking_types_are_served_without_a_reasoning_parser(serve, kind):
    """thinking "adaptive" (the model decides; newer Claude clients send it) and "between_tools" take the model's
    default: served, and counted by count_tokens, on a server that reads no reasoning, with the prompt a request
    without `thinking` gets ("enabled" is refused there, BAD_INPUTS)."""
    async with serve() as (client, engine):
        plain = await client.post(URL, json=body())
        answered = await client.post(URL, json=body(thinking={"type": kind}))
        counted = await client.post(URL + "/count_tokens", json=body(thinking={"type": kind}))
    assert (plain.status_code, answered.status_code, counted.status_code) == (200, 200, 200)
    assert engine.requests[0][0] == engine.requests[1][0]
    assert orjson.loads(await counted.get_data()) == {"input_tokens": len(engine.requests[1][0])}


async def test_content_blocks_and_earlier_thinking(serve):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                  {"type": "text", "text": "c"}]},
                {"role": "user", "content": "d"}]
    _, _, engine = await _post(serve, body(messages=messages))
    assert _prompt(engine) == ("<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\nc<|im_end|>\n"
                               "<|im_start|>user\nd<|im_end|>\n<|im_start|>assistant\n")


async def test_consecutive_turns_of_one_role_are_one_turn(serve):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}, {"role": "assistant", "content": "d"}]
    _, _, engine = await _post(serve, body(messages=messages))
    assert _prompt(engine) == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\nc\nd"


async def test_null_optional_fields_mean_defaults(serve):
    nulls = dict.fromkeys(("stream", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
                           "tool_choice", "thinking", "output_config"))
    status, data, engine = await _post(serve, body(**nulls), ScriptedEngine(scripts=["ok"]))
    assert status == 200 and orjson.loads(data)["content"] == [{"type": "text", "text": "ok"}]
    params = engine.requests[-1][1]
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (1.0, 1.0, 0, [])


async def test_unlisted_http_errors_take_the_client_or_server_type():
    """A werkzeug error without a row of its own (e.g. 408 from a slow body, 415) is the client's fault below 500."""
    from werkzeug.exceptions import BadGateway, RequestTimeout, UnsupportedMediaType

    from api.errors import error_response

    got = {}
    for exc in (RequestTimeout(), UnsupportedMediaType(), BadGateway()):
        anthropic, openai = error_response(exc, anthropic=True), error_response(exc)
        got[exc.code] = (anthropic.status_code, orjson.loads(await anthropic.get_data())["error"]["type"],
                         orjson.loads(await openai.get_data())["error"]["type"])
    assert got == {408: (408, BAD, BAD), 415: (415, BAD, BAD), 502: (502, "api_error", "server_error")}


async def test_prefill_continues_the_last_assistant_message(serve):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure: <|im_end|>"}]
    status, data, engine = await _post(serve, body(messages=messages), ScriptedEngine(scripts=["ok"]))
    assert status == 200
    assert orjson.loads(data)["content"] == [{"type": "text", "text": "ok"}]  # the continuation only
    assert _prompt(engine) == USER_HI + "Sure: <|im_end|>"
    # the prefill is plain text (case S6): its special-token spelling is not the special token
    assert engine.requests[-1][0][-len("<|im_end|>"):] == engine.tokenizer.encode("<|im_end|>", parse_special=False)


async def test_usage_reports_cached_prompt_tokens_apart(serve):
    status, data, _ = await _post(serve, body(), ScriptedEngine(scripts=["ab"], cached_tokens=16))
    assert orjson.loads(data)["usage"] == {"input_tokens": 5, "output_tokens": 3, "cache_creation_input_tokens": 0,
                                           "cache_read_input_tokens": 16}


async def test_count_tokens_matches_the_prompt(serve):
    payload = body(system="Be brief.", messages=[{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Well"}])
    async with serve() as (client, engine):
        counted = await client.post(URL + "/count_tokens", json=payload)
        assert counted.status_code == 200
        await client.post(URL, json=payload)
    assert orjson.loads(await counted.get_data()) == {"input_tokens": len(engine.requests[-1][0])}


async def test_count_tokens_refuses_an_empty_text_block(serve):
    """count_tokens reads the request as /v1/messages does: an empty text block is Anthropic's 400 there too."""
    async with serve() as (client, _):
        response = await client.post(URL + "/count_tokens", json=body(system=[{"type": "text", "text": ""}]))
        assert (response.status_code, orjson.loads(await response.get_data())) == \
            (400, _error(BAD, "system: text content blocks must be non-empty"))


async def test_A4_stream_event_sequence_text(serve):
    """Case A4 for text: message_start, one text block (start, deltas, stop), message_delta with the stop reason
    and usage, message_stop; named events, no `[DONE]`. message_start and message_delta split the prompt alike:
    uncached input_tokens, cache_read_input_tokens (message_start waits for the engine's first output)."""
    status, data, _ = await _post(serve, body(stream=True, stop_sequences=["c"]),
                                  ScriptedEngine(scripts=["abc"], cached_tokens=4))
    assert status == 200
    assert data == (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_0","type":"message",'
        b'"role":"assistant","model":"test-model","content":[],"stop_reason":null,"stop_sequence":null,'
        b'"usage":{"input_tokens":17,"output_tokens":0,"cache_creation_input_tokens":0,'
        b'"cache_read_input_tokens":4}}}\n\n'
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n'
        b'event: ping\ndata: {"type":"ping"}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"a"}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"b"}}\n\n'
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"stop_sequence",'
        b'"stop_sequence":"c"},"usage":{"input_tokens":17,"output_tokens":3,"cache_creation_input_tokens":0,'
        b'"cache_read_input_tokens":4}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


async def test_empty_output_has_no_content_block(serve):
    """Nothing generated: `content: []` and no block streamed, as Anthropic answers (an empty text block could
    not be sent back to it)."""
    status, data, _ = await _post(serve, body(), ScriptedEngine(scripts=[""], cached_tokens=16))
    assert (status, orjson.loads(data)["content"]) == (200, [])
    status, data, _ = await _post(serve, body(stream=True), ScriptedEngine(scripts=[""], cached_tokens=16))
    assert status == 200
    assert data == (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_0","type":"message",'
        b'"role":"assistant","model":"test-model","content":[],"stop_reason":null,"stop_sequence":null,'
        b'"usage":{"input_tokens":5,"output_tokens":0,"cache_creation_input_tokens":0,'
        b'"cache_read_input_tokens":16}}}\n\n'
        b'event: ping\ndata: {"type":"ping"}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
        b'"stop_sequence":null},"usage":{"input_tokens":5,"output_tokens":1,"cache_creation_input_tokens":0,'
        b'"cache_read_input_tokens":16}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


async def test_stream_joins_to_the_whole_message(serve):
    """Multi-byte characters span tokens (byte tokenizer): no delta carries a broken character (case S3)."""
    script = "héllo 🌍 ok"
    _, whole, _ = await _post(serve, body(), ScriptedEngine(scripts=[script]))
    _, streamed, _ = await _post(serve, body(stream=True), ScriptedEngine(scripts=[script]))
    deltas = [orjson.loads(e.split(b"data: ", 1)[1]) for e in streamed.split(b"\n\n")
              if e.startswith(b"event: content_block_delta")]
    assert all("\ufffd" not in d["delta"]["text"] for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == orjson.loads(whole)["content"][0]["text"] == script


async def test_S1_keep_alive_messages(serve):
    _, slow, _ = await _post(serve, body(stream=True), ScriptedEngine(scripts=["ab"], first_delay_s=0.5),
                             sse_keep_alive_interval=0.2)
    _, plain, _ = await _post(serve, body(stream=True), ScriptedEngine(scripts=["ab"]))
    assert slow.count(sse.KEEP_ALIVE) >= 1
    assert slow.replace(sse.KEEP_ALIVE, b"") == plain


async def test_client_disconnect_aborts_the_message(serve):
    engine = ScriptedEngine(scripts=["x" * 200], delay_s=0.02)
    async with serve(engine) as (client, _):
        first = await leave_mid_stream(client, body(stream=True, max_tokens=200), path=URL)
        assert first.startswith(b"event: message_start")
        (_, _, request_id), = engine.requests
        await wait_for_abort(engine)
        assert engine.aborted and set(engine.aborted) == {request_id}
        response = await client.post(URL, json=body(max_tokens=2))
        assert response.status_code == 200


async def test_engine_death_mid_stream_is_an_error_event(serve):
    engine = ScriptedEngine(scripts=["abcdef"], delay_s=0.05)
    async with serve(engine) as (client, _):
        data = await stream_until_engine_dies(client, engine, URL, body(stream=True))
    assert data.endswith(b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                         b'"message":"scripted engine died"}}\n\n')
    assert b"message_stop" not in data and b"[DONE]" not in data


def _error(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


BAD = "invalid_request_error"
BAD_INPUTS = [
    ({k: v for k, v in body().items() if k != "max_tokens"}, 400, BAD, "missing required field 'max_tokens'"),
    (body(max_tokens=0), 400, BAD, "max_tokens must be >= 1"),
    (body(max_tokens="5"), 400, BAD, "invalid value for 'max_tokens': Input should be a valid integer"),
    (body(messages=[]), 400, BAD, "'messages' must contain at least one message"),
    (body(messages=[{"role": "system", "content": "x"}]), 400, BAD,
     "invalid value for 'messages.0.role': Input should be 'user' or 'assistant'"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400, BAD,
     "content block type 'image' is not supported: the served model accepts text only"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "3"}]}]), 400, BAD,
     "a tool_result block needs 'tool_use_id'"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), 400,
     BAD, "a tool_use block belongs in an assistant message"),
    (body(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}]), 400, BAD, "a tool_result block belongs in a user message"),
    (body(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f"}]}, {"role": "user", "content": "x"}]), 400, BAD,
     "a tool_use block needs 'input'"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]), 400, BAD,
     "content block type 'image' is not supported: the served model accepts text only"),
    (body(messages=[{"role": "user", "content": [{"type": "web_search_tool_result", "tool_use_id": "t",
                                                  "content": {"type": "web_search_tool_result_error"}}]}]), 400, BAD,
     "content block type 'web_search_tool_result' is not supported yet"),
    (body(system=[{"type": "tool_use", "id": "t", "name": "f", "input": {}}]), 400, BAD,
     "content block type 'tool_use' is not supported here"),
    (body(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), 400, BAD,
     "a final assistant message (a prefill) cannot hold tool_use blocks: its tool_result must follow in a user "
     "message"),
    (body(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, BAD, "a text block needs 'text'"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]), 400, BAD,
     "messages: text content blocks must be non-empty"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": ""}]}]),
     400, BAD, "messages: text content blocks must be non-empty"),
    (body(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": ""}, {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "3"}]}]), 400, BAD,
     "messages: text content blocks must be non-empty"),
    (body(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": ""}]}]), 400, BAD, "messages: text content blocks must be non-empty"),  # a prefill
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": ""}]}]}]), 400, BAD, "messages: text content blocks must be non-empty"),
    (body(system=[{"type": "text", "text": ""}]), 400, BAD, "system: text content blocks must be non-empty"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": " \n"}]}]), 400, BAD,
     "messages: text content blocks must contain non-whitespace text"),
    (body(system=[{"type": "text", "text": "\t"}]), 400, BAD,
     "system: text content blocks must contain non-whitespace text"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]), 400, BAD,
     "tool type 'web_search_20250305' is not supported: only client tools (name, description, input_schema) are"),
    (body(tools=[{"name": "f"}]), 400, BAD, "missing required field 'tools.0.input_schema'"),
    (body(tools=[{"input_schema": {"type": "object"}}]), 400, BAD, "missing required field 'tools.0.name'"),
    (body(tools=[{"name": "f", "input_schema": {"type": "object"}}, {"name": "g", "input_schema": {"type": "string"}}]),
     400, BAD, "tools.1.custom.input_schema.type: Input should be 'object'"),
    (body(tool_choice={"type": "any"}), 400, BAD, "tool_choice forces a call but the request gives no tools"),
    (body(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool", "name": "g"}), 400,
     BAD, "tool_choice names 'g', which is not one of the tools"),
    (body(tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool"}), 400,
     BAD, "a tool_choice of type 'tool' needs 'name'"),
    (body(tool_choice={"type": "sometimes"}), 400, BAD,
     "invalid value for 'tool_choice.type': Input should be 'auto', 'any', 'tool' or 'none'"),
    (body(thinking={"type": "enabled", "budget_tokens": 1024}), 400, BAD,
     "extended thinking is not supported by the served model"),
    (body(thinking={"type": "bogus"}), 400, BAD,
     "thinking.type must be one of 'enabled', 'disabled', 'adaptive', 'between_tools', not 'bogus'"),
    (body(output_config={"format": {"type": "yaml"}}), 400, BAD,
     "an output format must be {'type': 'json_schema', 'schema': {...}}"),
    (body(output_format={"type": "json_schema", "schema": {"$ref": "#/$defs/Missing"}}), 400, BAD, None),
    (body(messages=[{"role": "user", "content": [{"text": "x"}]}]), 400, BAD,
     "missing required field 'messages.0.content.0.type'"),
    (body(top_k=2**32 + 5), 400, BAD, "top_k must be <= 2147483647"),
    (body(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "So "}]), 400, BAD,
     "final assistant content cannot end with trailing whitespace"),
    (body(temperature=-1), 400, BAD, "temperature must be >= 0"),
    (body(temperature=3), 400, BAD, "temperature must be <= 1"),  # Anthropic's range: 0..1
    (body(messages=[{"role": "user", "content": []}]), 400, BAD,
     "messages.0: all messages must have non-empty content except for the optional final assistant message"),
    (body(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                    {"role": "user", "content": "x"}]), 400, BAD,
     "messages.1: all messages must have non-empty content except for the optional final assistant message"),
    (body(top_p=2), 400, BAD, "top_p must be in (0, 1]"),
    (body(stop_sequences=[""]), 400, BAD, "stop strings must be non-empty strings"),
    (body(max_tokens=10_000), 400, BAD, "This model's maximum context length is 256 tokens. However, you requested "
     "10021 tokens (21 in the prompt, 10000 for the completion). Reduce the prompt or max_tokens."),
    (body(model="other"), 404, "not_found_error", None),
]


@pytest.mark.parametrize("payload, status, kind, message", BAD_INPUTS)
async def test_bad_input_gets_an_anthropic_error(serve, payload, status, kind, message):
    async with serve() as (client, engine):
        response = await client.post(URL, json=payload)
        got = orjson.loads(await response.get_data())
        assert (response.status_code, set(got), got["type"], got["error"]["type"]) == \
            (status, {"type", "error"}, "error", kind)
        if message is not None:
            assert got["error"]["message"] == message
        assert engine.requests == []
        assert (await client.post(URL, json=body(max_tokens=2))).status_code == 200  # still serving


async def test_edges_anthropic_accepts(serve):
    """temperature 1 (the top of Anthropic's range) and an empty final assistant message (no prefill)."""
    for payload in (body(temperature=1), body(messages=[{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": []}])):
        status, data, engine = await _post(serve, payload, ScriptedEngine(scripts=["ok"]))
        assert (status, orjson.loads(data)["content"]) == (200, [{"type": "text", "text": "ok"}])
        assert _prompt(engine) == USER_HI


async def test_malformed_json_api_key_and_unknown_route_in_anthropic_shape(serve):
    async with serve(api_key="sk-test") as (client, _):
        denied = await client.post(URL, json=body())
        malformed = await client.post(URL, data=b"{", headers={"x-api-key": "sk-test",
                                                                 "content-type": "application/json"})
        unknown = await client.post(URL + "/batches", json={}, headers={"x-api-key": "sk-test"})
        chat = await client.post("/v1/chat/completions", json={}, headers={"authorization": "Bearer nope"})
        allowed = await client.post(URL, json=body(), headers={"x-api-key": "sk-test"})
    assert denied.status_code == 401
    assert orjson.loads(await denied.get_data())["error"]["type"] == "authentication_error"
    assert malformed.status_code == 400 and orjson.loads(await malformed.get_data())["error"]["type"] == BAD
    assert unknown.status_code == 404
    assert orjson.loads(await unknown.get_data()) == \
        _error("not_found_error", "Invalid URL (POST /v1/messages/batches)")
    assert "code" in orjson.loads(await chat.get_data())["error"]  # OpenAI's shape stays on OpenAI routes
    assert allowed.status_code == 200
