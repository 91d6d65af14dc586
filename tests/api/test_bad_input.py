"""One table of bad requests: exact status, error.type, error.param (and code), then a good request still works."""

from __future__ import annotations

import orjson
import pytest
from tests.api.conftest import MODEL, chat_body
from tests.api.fake_engine import ScriptedEngine

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
INVALID = "invalid_request_error"


def completion_body(**extra) -> dict:
    return {"model": MODEL, "prompt": "Hi", **extra}


def without(key: str) -> dict:
    body = chat_body()
    del body[key]
    return body


# (id, method, path, body (dict -> JSON, bytes -> raw), status, type, param, code)
CASES = [
    ("malformed_json", "POST", CHAT, b'{"model": "test-model", "messages": [', 400, INVALID, None, None),
    ("body_not_object", "POST", CHAT, b"[1, 2]", 400, INVALID, None, None),
    ("empty_body", "POST", CHAT, b"", 400, INVALID, None, None),
    ("missing_messages", "POST", CHAT, without("messages"), 400, INVALID, "messages", None),
    ("empty_messages", "POST", CHAT, chat_body(messages=[]), 400, INVALID, "messages", None),
    ("messages_not_list", "POST", CHAT, chat_body(messages="Hi"), 400, INVALID, "messages", None),
    ("unknown_role", "POST", CHAT, chat_body(messages=[{"role": "robot", "content": "x"}]), 400, INVALID,
     "messages.0.role", None),
    ("content_wrong_type", "POST", CHAT, chat_body(messages=[{"role": "user", "content": 5}]), 400, INVALID,
     "messages.0.content", None),
    ("user_without_content", "POST", CHAT, chat_body(messages=[{"role": "user"}]), 400, INVALID,
     "messages.0.content", None),
    ("S7_image_part", "POST", CHAT, chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400, INVALID,
     "messages.0.content.0.type", None),
    ("S7_mm_kwargs", "POST", CHAT, chat_body(mm_processor_kwargs={"fps": 1}), 400, INVALID,
     "mm_processor_kwargs", None),
    ("S7_mm_kwargs_completions", "POST", COMPLETIONS, completion_body(media_io_kwargs={"a": 1}), 400, INVALID,
     "media_io_kwargs", None),
    ("S7_mm_kwargs_responses", "POST", "/v1/responses", {"model": MODEL, "input": "Hi",
                                                         "mm_processor_kwargs": {"fps": 1}}, 400, INVALID,
     "mm_processor_kwargs", None),
    ("missing_model", "POST", CHAT, without("model"), 400, INVALID, "model", None),
    ("unknown_model", "POST", CHAT, chat_body(model="gpt-9"), 404, INVALID, "model", "model_not_found"),
    ("max_tokens_zero", "POST", CHAT, chat_body(max_tokens=0), 400, INVALID, "max_tokens", None),
    ("max_tokens_negative", "POST", COMPLETIONS, completion_body(max_tokens=-1), 400, INVALID, "max_tokens", None),
    ("max_completion_tokens_zero", "POST", CHAT, chat_body(max_completion_tokens=0), 400, INVALID,
     "max_completion_tokens", None),
    ("max_tokens_above_context", "POST", CHAT, chat_body(max_tokens=1000), 400, INVALID, "max_tokens",
     "context_length_exceeded"),
    ("prompt_above_context", "POST", COMPLETIONS, completion_body(prompt=[5] * 300), 400, INVALID, "prompt",
     "context_length_exceeded"),
    ("chat_prompt_above_context", "POST", CHAT, chat_body(messages=[{"role": "user", "content": "x" * 300}]),
     400, INVALID, "messages", "context_length_exceeded"),
    ("temperature_negative", "POST", CHAT, chat_body(temperature=-0.5), 400, INVALID, "temperature", None),
    ("temperature_string", "POST", CHAT, chat_body(temperature="hot"), 400, INVALID, "temperature", None),
    ("top_p_zero", "POST", CHAT, chat_body(top_p=0), 400, INVALID, "top_p", None),
    ("top_p_above_one", "POST", COMPLETIONS, completion_body(top_p=1.5), 400, INVALID, "top_p", None),
    ("n_zero", "POST", CHAT, chat_body(n=0), 400, INVALID, "n", None),
    ("n_float", "POST", CHAT, chat_body(n=1.5), 400, INVALID, "n", None),
    ("top_logprobs_21", "POST", CHAT, chat_body(logprobs=True, top_logprobs=21), 400, INVALID, "top_logprobs",
     None),
    ("top_logprobs_without_logprobs", "POST", CHAT, chat_body(top_logprobs=2), 400, INVALID, "top_logprobs",
     None),
    ("completion_logprobs_21", "POST", COMPLETIONS, completion_body(logprobs=21), 400, INVALID, "logprobs", None),
    ("presence_penalty_range", "POST", CHAT, chat_body(presence_penalty=3), 400, INVALID, "presence_penalty",
     None),
    ("min_tokens_above_max", "POST", CHAT, chat_body(min_tokens=5, max_tokens=2), 400, INVALID, "min_tokens",
     None),
    ("stop_wrong_type", "POST", CHAT, chat_body(stop=5), 400, INVALID, "stop", None),
    ("stream_wrong_type", "POST", CHAT, chat_body(stream="yes"), 400, INVALID, "stream", None),
    ("include_usage_wrong_type", "POST", CHAT, chat_body(stream=True, stream_options={"include_usage": 1}), 400,
     INVALID, "stream_options.include_usage", None),
    ("include_obfuscation_wrong_type", "POST", COMPLETIONS, completion_body(
        stream=True, stream_options={"include_obfuscation": "no"}), 400, INVALID, "stream_options.include_obfuscation",
     None),
    ("responses_include_obfuscation_wrong_type", "POST", "/v1/responses", {
        "model": MODEL, "input": "Hi", "stream": True, "stream_options": {"include_obfuscation": 0}}, 400, INVALID,
     "stream_options.include_obfuscation", None),
    ("empty_prompt", "POST", COMPLETIONS, completion_body(prompt=""), 400, INVALID, "prompt", None),
    ("prompt_id_outside_vocab", "POST", COMPLETIONS, completion_body(prompt=[1, 10**6]), 400, INVALID, "prompt",
     None),
    ("temperature_infinite", "POST", CHAT, b'{"model": "test-model", "messages": [{"role": "user", "content": '
     b'"Hi"}], "temperature": 1e400}', 400, INVALID, "temperature", None),
    ("repetition_penalty_tiny", "POST", CHAT, chat_body(repetition_penalty=1e-300), 400, INVALID,
     "repetition_penalty", None),
    ("stop_token_id_outside_vocab", "POST", CHAT, chat_body(stop_token_ids=[10**9], min_tokens=2, max_tokens=4),
     400, INVALID, "stop_token_ids", None),
    ("logit_bias", "POST", CHAT, chat_body(logit_bias={"5": 10}), 400, INVALID, "logit_bias", None),
    ("tool_choice_required_without_tools", "POST", CHAT, chat_body(tool_choice="required"), 400, INVALID,
     "tool_choice", None),
    ("tool_choice_names_no_tool", "POST", CHAT, chat_body(tool_choice={"type": "function", "function": {
        "name": "g"}}, tools=[{"type": "function", "function": {"name": "f"}}]), 400, INVALID, "tool_choice", None),
    ("tool_schema_bad_ref", "POST", CHAT, chat_body(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}}}}]), 400,
     INVALID, "tools.0.function.parameters", None),
    ("tool_choice_function_not_object", "POST", CHAT, chat_body(tool_choice={"type": "function", "function": "f"},
     tools=[{"type": "function", "function": {"name": "f"}}]), 400, INVALID, "tool_choice", None),
    ("tool_parameters_not_object", "POST", CHAT, chat_body(tool_choice="required", tools=[{"type": "function",
     "function": {"name": "f", "parameters": {"type": "string"}}}]), 400, INVALID, "tools.0.function.parameters",
     None),
    ("tool_not_object", "POST", CHAT, chat_body(tools=["f"]), 400, INVALID, "tools.0", None),
    ("tool_name_with_space", "POST", CHAT, chat_body(tools=[{"type": "function", "function": {"name": "a b"}}]),
     400, INVALID, "tools.0.function.name", None),
    ("response_format_unknown", "POST", CHAT, chat_body(response_format={"type": "yaml"}), 400, INVALID,
     "response_format.type", None),
    ("unknown_route", "POST", "/v1/nope", chat_body(), 404, INVALID, None, "unknown_url"),
    ("wrong_method", "GET", CHAT, None, 405, INVALID, None, "method_not_allowed"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_bad_input(serve, case):
    _, method, path, body, status, error_type, param, code = case
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
        response = await client.open(path, method=method, headers={"content-type": "application/json"}, **kwargs)
        error = orjson.loads(await response.get_data())["error"]
        assert (response.status_code, error["type"], error["param"], error["code"]) == (status, error_type, param,
                                                                                          code)
        assert isinstance(error["message"], str) and error["message"]
        good = await client.post(CHAT, json=chat_body())
        assert good.status_code == 200
        assert orjson.loads(await good.get_data())["choices"][0]["message"]["content"] == "ok"


async def test_wrong_method_names_the_allowed_ones(serve):
    """A 405 carries the Allow header (RFC 9110 section 15.5.6) listing the route's methods."""
    async with serve(ScriptedEngine()) as (client, _):
        response = await client.get(CHAT)
    assert response.status_code == 405
    assert "POST" in [m.strip() for m in response.headers["Allow"].split(",")]
    assert "GET" not in response.headers["Allow"]


async def test_context_error_names_both_lengths(serve):
    async with serve(ScriptedEngine()) as (client, _):
        response = await client.post(COMPLETIONS, json=completion_body(prompt=[5] * 300))
    message = orjson.loads(await response.get_data())["error"]["message"]
    assert "256" in message and "300" in message


async def test_min_tokens_above_the_rest_of_the_context(serve):
    """Without max_tokens the budget is the context's rest (256 - 21 prompt tokens here): a min_tokens past it is a
    400 (vLLM's answer), not a request that masks EOS until the window is full and then ends short of it."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        response = await client.post(CHAT, json=chat_body(min_tokens=1000))
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, {"error": {
            "message": "min_tokens (1000) must be <= max_tokens; without max_tokens that is the rest of the context "
                       "window: 235 tokens (256 less 21 in the prompt)",
            "type": INVALID, "param": "min_tokens", "code": None}})
        assert engine.requests == []
        ok = await client.post(CHAT, json=chat_body(min_tokens=235))  # exactly the budget still runs
        assert ok.status_code == 200


async def test_unexpected_error_is_500_without_details(serve):
    engine = ScriptedEngine()

    def explode(*args, **kwargs):
        raise RuntimeError("secret internals /etc/passwd")

    engine.add_request = explode
    async with serve(engine) as (client, _):
        response = await client.post(CHAT, json=chat_body())
        assert response.status_code == 500
        assert orjson.loads(await response.get_data()) == {"error": {
            "message": "internal server error", "type": "server_error", "param": None, "code": None}}
        assert (await client.get("/health")).status_code == 200


async def test_S7_mm_kwargs_only_when_trusted(serve):
    """Omitted, null and {} multimodal kwargs always pass; non-empty ones only with --trust-request-mm-kwargs
    (no effect on a text-only model); an image part is a 400 either way."""
    async with serve(ScriptedEngine(scripts=["ok"] * 4)) as (client, _):
        for kwargs in ({}, {"mm_processor_kwargs": None, "media_io_kwargs": {}}):
            assert (await client.post(CHAT, json=chat_body(**kwargs))).status_code == 200
    async with serve(ScriptedEngine(scripts=["ok"] * 4), trust_request_mm_kwargs=True) as (client, _):
        ok = await client.post(CHAT, json=chat_body(mm_processor_kwargs={"fps": 1}, media_io_kwargs={"a": 1}))
        assert ok.status_code == 200
        assert orjson.loads(await ok.get_data())["choices"][0]["message"]["content"] == "ok"
        image = await client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]))
        error = orjson.loads(await image.get_data())["error"]
        assert (image.status_code, error["param"]) == (400, "messages.0.content.0.type")


NOT_OBJECTS = ["x", [1, 2], 5, True]
TOOL_CHOICES = [None, "auto", "required", {"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize("parameters", NOT_OBJECTS)
@pytest.mark.parametrize("tool_choice", TOOL_CHOICES)
async def test_tool_parameters_must_be_an_object(serve, parameters, tool_choice):
    """Whatever the tool_choice: a 400 naming the field, as the Responses and Messages APIs answer."""
    payload = chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}],
                        **({"tool_choice": tool_choice} if tool_choice is not None else {}))
    async with serve(ScriptedEngine(scripts=["ok"]), tool_call_parser="hermes") as (client, engine):
        response = await client.post(CHAT, json=payload)
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, {"error": {
            "message": "invalid value for 'tools.0.function.parameters': Input should be an object",
            "type": INVALID, "param": "tools.0.function.parameters", "code": None}})
        assert engine.requests == []


BAD_NAME = "invalid value for '{}': String should match pattern '^[a-zA-Z0-9_-]{{1,{}}}$'"


async def _tool_name_answers(client, name: str) -> list:
    """(status, body) of Chat, Responses and Messages for one tool named `name`."""
    chat = await client.post(CHAT, json=chat_body(tools=[{"type": "function", "function": {"name": name}}]))
    responses = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "tools": [
        {"type": "function", "name": name}]})
    messages = await client.post("/v1/messages", json={
        "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": name, "input_schema": {"type": "object"}}]})
    return [(r.status_code, orjson.loads(await r.get_data())) for r in (chat, responses, messages)]


def _openai_name_errors() -> list:
    return [(400, {"error": {"message": BAD_NAME.format("tools.0.function.name", 64), "type": INVALID,
                             "param": "tools.0.function.name", "code": None}}),
            (400, {"error": {"message": BAD_NAME.format("tools.0.name", 64), "type": INVALID,
                             "param": "tools.0.name", "code": None}})]


@pytest.mark.parametrize("name", ["", "a b", "get.weather", "f(x)", "é", "x" * 129])
async def test_bad_tool_names_are_refused_in_every_api(serve, name):
    """OpenAI's function-name rule (1-64 of [a-zA-Z0-9_-]) in Chat and Responses, Anthropic's (1-128) in
    Messages."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        got = await _tool_name_answers(client, name)
        good = await client.post(CHAT, json=chat_body(tools=[{"type": "function", "function": {
            "name": "get_weather-2", "parameters": {"type": "object"}}}]))
    assert got == _openai_name_errors() + [
        (400, {"type": "error", "error": {"type": INVALID, "message": BAD_NAME.format("tools.0.name", 128)}})]
    assert good.status_code == 200


@pytest.mark.parametrize("name", ["x" * 65, "mcp__" + "s" * 60 + "__" + "t" * 61])
async def test_anthropic_tool_names_may_be_128_characters(serve, name):
    """Names of 65-128 characters (MCP's `mcp__server__tool`): refused by OpenAI's rule, taken by Messages."""
    assert len(name) <= 128
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        got = await _tool_name_answers(client, name)
    assert got[:2] == _openai_name_errors()
    assert got[2][0] == 200 and got[2][1]["content"] == [{"type": "text", "text": "ok"}]


@pytest.mark.parametrize("key, value", [("add_generation_prompt", "x"), ("add_generation_prompt", False),
                                        ("messages", []), ("tools", None)])
async def test_chat_template_kwargs_cannot_set_what_the_server_sets(serve, key, value):
    """A clear 400 naming the key (not the template's TypeError); other keys still reach the template."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        response = await client.post(CHAT, json=chat_body(chat_template_kwargs={key: value}))
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, {"error": {
            "message": f"chat_template_kwargs cannot set '{key}': the server sets messages, tools and "
                       "add_generation_prompt itself",
            "type": INVALID, "param": f"chat_template_kwargs.{key}", "code": None}})
        assert engine.requests == []
        good = await client.post(CHAT, json=chat_body(chat_template_kwargs={"enable_thinking": False}))
        assert good.status_code == 200


async def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized(serve, smollm2_tokenizer,
                                                                               monkeypatch):
    """A prompt whose characters alone prove it cannot fit (`Tokenizer.min_num_tokens`: SmolLM2's longest token
    spells 81 bytes) is a 400 without its encoding (a 30 MB one took ~28 s): Chat, Completions, Responses."""
    def refuse(*args, **kwargs):
        raise AssertionError("the prompt was tokenized")

    text = "hello world " * 60_000  # 720,000 characters: >= 8,889 tokens
    assert smollm2_tokenizer.min_num_tokens(len(text)) == 8_889
    monkeypatch.setattr(smollm2_tokenizer, "encode", refuse)
    engine = ScriptedEngine(scripts=["ok"], max_model_len=8_192, tokenizer=smollm2_tokenizer)
    async with serve(engine) as (client, _):
        completion = await client.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4})
        chat = await client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": text}]))
        responses = await client.post("/v1/responses", json={"model": MODEL, "input": text})
        got = [(r.status_code, orjson.loads(await r.get_data())["error"]) for r in (completion, chat, responses)]
    assert got[0] == (400, {"message": "This model's maximum context length is 8192 tokens, but the prompt has at "
                                       "least 8889 tokens (no room for any output).", "type": INVALID,
                            "param": "prompt", "code": "context_length_exceeded"})
    for (status, error), param in zip(got[1:], ("messages", "input")):
        assert (status, error["param"], error["code"]) == (400, param, "context_length_exceeded")
        assert error["message"].startswith("This model's maximum context length is 8192 tokens, but the prompt "
                                           "has at least ")
    assert engine.requests == []


async def test_messages_refuse_a_prompt_past_the_context_but_count_tokens_counts_it(serve, smollm2_tokenizer):
    """Messages (a prefill too) take the same early 400; count_tokens answers the count whatever its size."""
    text = "hello world " * 60_000
    engine = ScriptedEngine(scripts=["ok"], max_model_len=8_192, tokenizer=smollm2_tokenizer)
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    prefilled = {**body, "messages": [{"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": text.rstrip()}]}
    async with serve(engine) as (client, _):
        got = [await client.post("/v1/messages", json=payload) for payload in (body, prefilled)]
        counted = await client.post("/v1/messages/count_tokens", json={"model": MODEL,
                                                                       "messages": body["messages"]})
        errors = [(r.status_code, orjson.loads(await r.get_data())) for r in got]
        count = orjson.loads(await counted.get_data())
    for status, error in errors:
        assert status == 400 and error["error"]["message"].startswith(
            "This model's maximum context length is 8192 tokens, but the prompt has at least ")
    assert counted.status_code == 200 and count["input_tokens"] > 60_000
    assert engine.requests == []


def _tools(schema: dict | None) -> list[dict]:
    function = {"name": "f"} if schema is None else {"name": "f", "parameters": schema}
    return [{"type": "function", "function": {"name": "g"}}, {"type": "function", "function": function}]


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required"])
@pytest.mark.parametrize("schema, got", [({"type": "string"}, '"string"'), ({"type": ["object", "null"]},
                                         '["object", "null"]'), ({"type": 5, "properties": {}}, "5")])
async def test_tool_parameters_not_an_object_schema(serve, tool_choice, schema, got):
    """A function's parameters of a type other than "object" are OpenAI's 400 whatever the tool_choice (it was
    refused only where a grammar was built: required or named)."""
    choice = {} if tool_choice is None else {"tool_choice": tool_choice}
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        response = await client.post(CHAT, json=chat_body(tools=_tools(schema), **choice))
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, {"error": {
            "message": "Invalid schema for function 'f': schema must be a JSON Schema of 'type: \"object\"', "
                       f"got 'type: {got}'.",
            "type": INVALID, "param": "tools.1.function.parameters", "code": None}})
        assert engine.requests == []


@pytest.mark.parametrize("schema", [None, {}, {"type": "object"}, {"properties": {"a": {"type": "integer"}}}])
async def test_tool_parameters_absent_or_an_object_schema_pass(serve, schema):
    """Absent, {} and a schema without `type` (taken as an object's) stay valid, as before."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        response = await client.post(CHAT, json=chat_body(tools=_tools(schema), tool_choice="auto"))
        assert response.status_code == 200
        assert orjson.loads(await response.get_data())["choices"][0]["message"]["content"] == "ok"


SURROGATE_RULE = "surrogate escapes come in pairs: one of \\ud800-\\udbff, then one of \\udc00-\\udfff"


def _surrogate_message(where: str | None, escape: str | None) -> str:
    if where is None:
        return f"the request body holds an invalid Unicode escape: a lone surrogate ({SURROGATE_RULE})"
    return (f"the request body holds an invalid Unicode escape at '{where}': {escape} is a lone surrogate "
            f"({SURROGATE_RULE})")


# (id, path, raw body, param, the escape as the message quotes it); every body but the paired one is refused
LONE_SURROGATES = [
    ("chat_high_at_end", CHAT, b'{"model": "test-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content", "\\ud800"),
    ("chat_low", CHAT, b'{"model": "test-model", "messages": [{"role": "user", "content": "a\\uDC00b"}]}',
     "messages.0.content", "\\udc00"),
    ("chat_high_then_text", CHAT, b'{"model": "test-model", "messages": [{"role": "user", "content": [{"type": '
     b'"text", "text": "ok \\ud83dx"}]}]}', "messages.0.content.0.text", "\\ud83d"),
    ("chat_pair_reversed", CHAT, b'{"model": "test-model", "stop": ["x", "\\ude00\\ud83d"], "messages": [{"role": '
     b'"user", "content": "Hi"}]}', "stop.1", "\\ude00"),
    ("chat_in_a_key", CHAT, b'{"model": "test-model", "metadata": {"\\ud800": 1}, "messages": [{"role": "user", '
     b'"content": "Hi"}]}', "metadata.\\ud800", "\\ud800"),
    ("completions_prompt", COMPLETIONS, b'{"model": "test-model", "prompt": "\\udfff"}', "prompt", "\\udfff"),
    ("responses_input", "/v1/responses", b'{"model": "test-model", "input": [{"role": "user", "content": '
     b'"\\ud800\\ud800"}]}', "input.0.content", "\\ud800"),
    ("not_locatable", CHAT, b'{"model": "test-model", "messages": [{"role": "user", "content": "\\ud800"}], x}',
     None, None),  # a later syntax error: the lone surrogate is named, not where it is
]


@pytest.mark.parametrize("case", LONE_SURROGATES, ids=[c[0] for c in LONE_SURROGATES])
async def test_a_lone_surrogate_escape_is_named_with_where_it_is(serve, case):
    """`"\\ud800"` is valid JSON syntax but no Unicode text: the 400 says so and names the field that holds it
    (it used to say "unexpected end of hex escape at line 1 column 73")."""
    _, path, raw, param, escape = case
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        response = await client.post(path, data=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert orjson.loads(await response.get_data()) == {"error": {
        "message": _surrogate_message(param, escape), "type": INVALID, "param": param, "code": None}}
    assert engine.requests == []


async def test_a_surrogate_pair_escape_is_one_character(serve):
    """The escapes of a character outside the BMP, a high surrogate then a low one, are that character."""
    raw = b'{"model": "test-model", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        response = await client.post(CHAT, data=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert "\U0001f600" in engine.tokenizer.decode(engine.requests[-1][0])


@pytest.mark.parametrize("path, raw, where, escape", [
    ("/v1/messages", b'{"model": "test-model", "max_tokens": 8, "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "a\\udc00"}]}]}', "messages.0.content.0.text", "\\udc00"),
    ("/v1/messages", b'{"model": "test-model", "max_tokens": 8, "system": "\\ud800", "messages": [{"role": "user", '
     b'"content": "Hi"}]}', "system", "\\ud800"),
    ("/v1/messages/count_tokens", b'{"model": "test-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content", "\\ud800"),
])
async def test_a_lone_surrogate_escape_in_anthropic_shape(serve, path, raw, where, escape):
    """The Messages routes: the same 400 in Anthropic's shape, whose message names the field (it has no param)."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        response = await client.post(path, data=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert orjson.loads(await response.get_data()) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": _surrogate_message(where, escape)}}


def _wide_deep_body(num_strings: int, depth: int, user: bytes) -> bytes:
    """A chat body whose `metadata` nests `depth` objects around a list of `num_strings` short strings, then
    `user`: a body that makes a search building each string's path as a tuple quadratic in time and memory."""
    inner = b"[" + b",".join([b'"a"'] * num_strings) + b"]"
    return (b'{"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "metadata": '
            + b'{"k": ' * depth + inner + b"}" * depth + b', "user": "' + user + b'"}')


def test_the_lone_surrogate_search_is_linear():
    """The field search runs on the event loop: each of 200k strings 100 objects deep once took a 101-item path
    tuple (~160 MB, ~1 s); the search keeps one path, so it costs about what json.loads does."""
    import tracemalloc

    from api.openai.protocol import SURROGATE_SEARCH_MAX_BYTES, ChatCompletionRequest, parse_request
    from voltserve.errors import InvalidRequestError

    body = _wide_deep_body(200_000, 100, b"\\ud800")
    assert len(body) <= SURROGATE_SEARCH_MAX_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequestError) as caught:
            parse_request(ChatCompletionRequest, body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.param == "user"
    assert peak < 48 << 20  # json.loads' 200k strings: ~15 MB


def test_a_lone_surrogate_in_a_body_over_the_search_limit_is_not_located():
    """A larger body is refused as clearly, without the search (its cost grows with the body: up to 32 MB)."""
    from api.openai.protocol import SURROGATE_SEARCH_MAX_BYTES, ChatCompletionRequest, parse_request
    from voltserve.errors import InvalidRequestError

    body = _wide_deep_body(SURROGATE_SEARCH_MAX_BYTES // 4, 1, b"\\ud800")
    assert len(body) > SURROGATE_SEARCH_MAX_BYTES
    with pytest.raises(InvalidRequestError) as caught:
        parse_request(ChatCompletionRequest, body)
    assert (caught.value.param, str(caught.value)) == (None, _surrogate_message(None, None))
    with pytest.raises(InvalidRequestError) as caught:  # within the limit: located
        parse_request(ChatCompletionRequest, _wide_deep_body(1000, 1, b"ok \\udfff"))
    assert (caught.value.param, str(caught.value)) == ("user", _surrogate_message("user", "\\udfff"))


RESPONSES = "/v1/responses"
ROUTE_BODIES = {CHAT: chat_body, COMPLETIONS: completion_body,
                RESPONSES: lambda **extra: {"model": MODEL, "input": "Hi", **extra}}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, RESPONSES])
@pytest.mark.parametrize("field, value, message", [
    ("temperature", 2.5, "temperature must be <= 2"),  # OpenAI's range is [0, 2] (the engine's is wider)
    ("temperature", 3, "temperature must be <= 2"),
    ("temperature", -0.5, "temperature must be >= 0"),
    ("top_p", 0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
])
async def test_openai_sampling_ranges(serve, path, field, value, message):
    """Out of OpenAI's ranges on every OpenAI route: a 400 naming the field (exact JSON); the bounds themselves
    pass."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        response = await client.post(path, json=ROUTE_BODIES[path](**{field: value}))
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, {"error": {
            "message": message, "type": INVALID, "param": field, "code": None}})
        assert engine.requests == []
        for bound in ({"temperature": 2, "top_p": 1}, {"temperature": 0, "top_p": 1e-9}):
            assert (await client.post(path, json=ROUTE_BODIES[path](**bound))).status_code == 200


# each route's `stream_options`: Chat's and Completions' (`include_usage`, `include_obfuscation`), Responses' own
# (`include_obfuscation` only)
STREAM_OPTIONS = {CHAT: [{"include_usage": True}, {"include_usage": False, "include_obfuscation": True}, {}],
                  RESPONSES: [{"include_obfuscation": True}, {"include_obfuscation": False}, {}]}
STREAM_OPTIONS[COMPLETIONS] = STREAM_OPTIONS[CHAT]
# how each route's stream's last frame begins (Responses: no [DONE], its last event is response.completed)
LAST_FRAME = {CHAT: b"data: [DONE]", COMPLETIONS: b"data: [DONE]", RESPONSES: b"event: response.completed\n"}


@pytest.mark.parametrize("path, options", [(path, options) for path, each in STREAM_OPTIONS.items()
                                           for options in each])
@pytest.mark.parametrize("stream", [False, None, "absent"])
async def test_stream_options_only_with_stream(serve, path, stream, options):
    """OpenAI's rule, on every OpenAI route (`common.check_stream_options`): `stream_options` without
    `stream: true` is a 400 naming it; null is fine either way."""
    extra = {} if stream == "absent" else {"stream": stream}
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        response = await client.post(path, json=ROUTE_BODIES[path](stream_options=options, **extra))
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, {"error": {
            "message": "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "type": INVALID,
            "param": "stream_options", "code": None}})
        assert engine.requests == []
        assert (await client.post(path, json=ROUTE_BODIES[path](stream_options=None, **extra))).status_code == 200
        streamed = await client.post(path, json=ROUTE_BODIES[path](stream_options=options, stream=True))
        data = await streamed.get_data()
        assert streamed.status_code == 200 and data.endswith(b"\n\n")
        assert data[:-2].rsplit(b"\n\n", 1)[-1].startswith(LAST_FRAME[path])
