"""Forced tool choice and JSON output through the APIs (`api.structured`), over the ScriptedEngine: the grammar a
request carries accepts exactly the scripted output (walked with `voltserve.grammar.GrammarState` on the test
tokenizer), and what the APIs return for it: cases T2, T5, T13, A1, A3 of ../shared/cases/api-behaviour.md.
The engine applying the grammar is tests/e2e/test_grammar.py's; the real server's, test_structured_sdk.py's."""

from __future__ import annotations

import orjson
import pytest

from tests.api.conftest import chat_body
from tests.api.fake_engine import ScriptedEngine, ThinkingTemplate
from tests.api.test_messages_tools import TOOLS as ANTHROPIC_TOOLS, _both as messages_both, _blocks, _stop_reason
from tests.api.test_responses_tools import WEATHER as RESPONSES_TOOL, both as responses_both
from tests.api.test_tool_calls import TOOLS, _both as chat_both, _joined
from tests.unit.test_grammar_rules import complete

CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


async def _grammar_of(serve, url: str, payload: dict) -> str | None:
    engine = ScriptedEngine(scripts=["x"], max_model_len=4096)
    async with serve(engine, tool_call_parser="hermes") as (client, _):
        response = await client.post(url, json=payload)
    assert response.status_code == 200, await response.get_data()
    return engine.requests[-1][1].grammar


async def test_each_api_asks_for_the_grammar_its_fields_mean(serve):
    fn = TOOLS[0]["function"]["name"]
    cases = [  # (url, request, an output its grammar takes, one it does not)
        ("/v1/chat/completions", chat_body(tools=TOOLS, tool_choice="required"), CALL, '{"ok":true}'),
        ("/v1/chat/completions", chat_body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), CALL,
         CALL + "\n" + CALL),  # T2
        ("/v1/chat/completions", chat_body(tools=TOOLS, tool_choice="required"), CALL + "\n" + CALL, "Hi"),
        # a named tool: exactly one call (as OpenAI's), parallel or not
        ("/v1/chat/completions", chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": fn}}),
         CALL, CALL + "\n" + CALL),
        ("/v1/chat/completions", chat_body(response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": ANSWER}}), '{"ok":true}', '{"ok":1}'),
        ("/v1/chat/completions", chat_body(response_format={"type": "json_object"}), '{"x":[]}', "[]"),
        # T5: tools the model may call beside a JSON format: either
        ("/v1/chat/completions", chat_body(tools=TOOLS, response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": ANSWER}}), CALL, "Hello"),
        ("/v1/chat/completions", chat_body(tools=TOOLS, response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": ANSWER}}), '{"ok":false}', '{"no":1}'),
        ("/v1/responses", {"model": "test-model", "input": "Hi", "tools": [RESPONSES_TOOL], "tool_choice": "required"},
         CALL, "Hi"),
        ("/v1/responses", {"model": "test-model", "input": "Hi", "text": {"format": {
            "type": "json_schema", "name": "a", "schema": ANSWER}}}, '{"ok":true}', "Hi"),
        ("/v1/messages", {"model": "test-model", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}],
                          "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}}, CALL, "Hi"),
        ("/v1/messages", {"model": "test-model", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}],
                          "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}}, CALL,
         CALL + "\n" + CALL),
        ("/v1/messages", {"model": "test-model", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}],
                          "output_config": {"format": {"type": "json_schema", "schema": ANSWER}}}, '{"ok":true}',
         "{}"),
    ]
    for url, payload, good, bad in cases:
        g = await _grammar_of(serve, url, payload)
        assert g is not None and complete(good, g) and not complete(bad, g), (url, payload)
    for url, payload in (("/v1/chat/completions", chat_body(tools=TOOLS)),
                         ("/v1/chat/completions", chat_body(tools=TOOLS, tool_choice="none")),
                         ("/v1/messages", {"model": "test-model", "max_tokens": 8, "tools": ANTHROPIC_TOOLS,
                                           "messages": [{"role": "user", "content": "Hi"}]})):
        assert await _grammar_of(serve, url, payload) is None  # a free choice: no grammar


async def test_T13_forced_chat_call_cut_short_and_forced_chat_calls(serve):
    whole, chunks = await chat_both(serve, CALL, tool_choice="required")
    message = whole["choices"][0]["message"]
    assert message["content"] is None and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert _joined(chunks)[0] == "" and whole["choices"][0]["finish_reason"] == "tool_calls"
    # T13: cut by max_tokens, nothing parses: no calls, no markup as content, and finish_reason says length
    whole, chunks = await chat_both(serve, CALL, tool_choice="required", max_tokens=30)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": None}
    assert whole["choices"][0]["finish_reason"] == "length" and _joined(chunks) == ("", [], ["length"])


async def test_A1_A3_forced_anthropic_call_stops_with_tool_use_and_a_cut_call_is_left_out(serve):
    whole, events = await messages_both(serve, CALL, tool_choice={"type": "tool", "name": "get_weather"})
    assert [b["type"] for b in whole["content"]] == [b["type"] for b in _blocks(events)] == ["tool_use"]
    assert whole["stop_reason"] == _stop_reason(events) == "tool_use"
    whole, events = await messages_both(serve, CALL, tool_choice={"type": "any"}, max_tokens=30)
    assert whole["content"] == _blocks(events) == []  # no empty text block: Anthropic would refuse it back
    assert whole["stop_reason"] == _stop_reason(events) == "max_tokens"
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]


@pytest.mark.parametrize("max_tokens", [30, 60])
async def test_A3_named_call_cut_short_by_max_tokens_is_left_out(serve, max_tokens):
    """Case A3 as stated: a named tool (not only `any`) whose call `max_tokens` cuts inside the name (30) or the
    arguments (60): no block, stop_reason max_tokens, streamed the same, no 500. (A cut after the arguments'
    closing brace keeps the call, with stop_reason max_tokens, as Chat and Responses do.)"""
    named = {"type": "tool", "name": "get_weather"}
    whole, events = await messages_both(serve, CALL, tool_choice=named, max_tokens=max_tokens)
    assert whole["content"] == _blocks(events) == []
    assert whole["stop_reason"] == _stop_reason(events) == "max_tokens"
    assert whole["usage"]["output_tokens"] == max_tokens
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]


async def test_forced_responses_call_is_a_function_call_item(serve):
    whole, _, final = await responses_both(serve, CALL, tool_choice="required")
    assert [item["type"] for item in whole["output"]] == ["function_call"]
    assert whole["output"][0]["arguments"] == '{"city": "Paris"}' and whole == final and whole["status"] == "completed"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
async def test_forced_responses_call_cut_short_leaves_no_empty_message(serve, tool_choice):
    """A forced call cut by max_output_tokens: no output item at all (Chat's content is null, Messages' []), not an
    empty message; status incomplete; streamed, no message or text events."""
    whole, events, final = await responses_both(serve, CALL, tool_choice=tool_choice, max_output_tokens=30)
    assert (whole["status"], whole["incomplete_details"], whole["output"]) == \
        ("incomplete", {"reason": "max_output_tokens"}, [])
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "response.incomplete"]
    assert final == whole


async def test_json_output_is_the_content(serve):
    async with serve(ScriptedEngine(scripts=['{"ok":true}'])) as (client, _):
        got = orjson.loads(await (await client.post("/v1/chat/completions", json=chat_body(
            response_format={"type": "json_object"}))).get_data())
    assert orjson.loads(got["choices"][0]["message"]["content"]) == {"ok": True}


async def test_a_schema_no_value_matches_is_a_400_naming_the_format(serve):
    """A `$ref` to itself (no JSON value matches it) used to answer 200 with empty content."""
    loop = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    why = "the JSON schema at '#/$defs/a' refers to itself without nesting ($ref / allOf): no JSON value matches it"
    cases = [  # (url, request, the error body)
        ("/v1/chat/completions", chat_body(response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": loop}}), {"error": {"message": f"invalid response_format: {why}",
                                                       "type": "invalid_request_error", "param": "response_format",
                                                       "code": None}}),
        ("/v1/responses", {"model": "test-model", "input": "Hi", "text": {"format": {
            "type": "json_schema", "name": "a", "schema": loop}}},
         {"error": {"message": f"invalid text.format: {why}", "type": "invalid_request_error",
                    "param": "text.format", "code": None}}),
        ("/v1/messages", {"model": "test-model", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                          "output_config": {"format": {"type": "json_schema", "schema": loop}}},
         {"type": "error", "error": {"type": "invalid_request_error",
                                     "message": f"output_config.format: {why}"}}),  # Anthropic: the field first
    ]
    async with serve(ScriptedEngine(scripts=["{}"])) as (client, engine):
        for url, payload, error in cases:
            response = await client.post(url, json=payload)
            assert (response.status_code, orjson.loads(await response.get_data())) == (400, error), url
        assert engine.requests == []


# Schemas a grammar cannot serve, each failing at another stage: llguidance does not compile it; it refers to itself
# without nesting (refused before compiling); it compiles, but llguidance's lexer limit fails on its forced start
MISSING = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Missing"}}}
LOOP = {"$ref": "#"}
HUGE = {"type": "object", "properties": {"p": {"type": "string", "pattern": "^a{1000000}$"}}, "required": ["p"]}
WHY_MISSING = "the JSON schema does not compile: Pointer '/$defs/Missing' does not exist"
WHY_LOOP = "the JSON schema at '#' refers to itself without nesting ($ref / allOf): no JSON value matches it"
WHY_HUGE = "constrained decoding cannot follow the grammar it asks for: lexer error: too many expressions constructed"
GOOD = {"type": "object", "properties": {"city": {"type": "string"}}}
USER = [{"role": "user", "content": "Hi"}]


def _chat_tools(bad: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "g", "parameters": GOOD}},
            {"type": "function", "function": {"name": "f", "parameters": bad}}]


def _responses_tools(bad: dict) -> list[dict]:
    return [{"type": "function", "name": "g", "parameters": GOOD}, {"type": "function", "name": "f", "parameters": bad}]


def _messages(**extra) -> dict:
    return {"model": "test-model", "max_tokens": 8, "messages": USER, **extra}


def _anthropic_tools(bad: dict) -> list[dict]:
    return [{"name": "g", "input_schema": GOOD}, {"name": "f", "input_schema": bad}]


def _openai_error(message: str, param: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def _anthropic_error(message: str) -> dict:
    return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


SCHEMA_ERRORS = [  # (id, url, request, the error body): the field that carries the bad schema is blamed
    ("chat_format", "/v1/chat/completions", chat_body(response_format=_format(MISSING)),
     _openai_error(f"invalid response_format: {WHY_MISSING}", "response_format")),
    ("chat_format_huge", "/v1/chat/completions", chat_body(response_format=_format(HUGE)),
     _openai_error(f"invalid response_format: {WHY_HUGE}", "response_format")),
    ("chat_tool_required", "/v1/chat/completions", chat_body(tools=_chat_tools(MISSING), tool_choice="required"),
     _openai_error(f"Invalid schema for function 'f': {WHY_MISSING}", "tools.1.function.parameters")),
    ("chat_tool_named", "/v1/chat/completions", chat_body(tools=_chat_tools(HUGE), tool_choice={
        "type": "function", "function": {"name": "f"}}),
     _openai_error(f"Invalid schema for function 'f': {WHY_HUGE}", "tools.1.function.parameters")),
    ("chat_tool_loop", "/v1/chat/completions", chat_body(tools=_chat_tools(LOOP), tool_choice="required"),
     _openai_error(f"Invalid schema for function 'f': {WHY_LOOP}", "tools.1.function.parameters")),
    # T5: tools the model may call beside a JSON format, one grammar: the tool or the format, whichever is bad
    ("chat_T5_tool", "/v1/chat/completions", chat_body(tools=_chat_tools(MISSING), response_format=_format(GOOD)),
     _openai_error(f"Invalid schema for function 'f': {WHY_MISSING}", "tools.1.function.parameters")),
    ("chat_T5_format", "/v1/chat/completions", chat_body(tools=_chat_tools(GOOD), response_format=_format(LOOP)),
     _openai_error(f"invalid response_format: {WHY_LOOP}", "response_format")),
    ("responses_format", "/v1/responses", {"model": "test-model", "input": "Hi", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": MISSING}}},
     _openai_error(f"invalid text.format: {WHY_MISSING}", "text.format")),
    ("responses_tool", "/v1/responses", {"model": "test-model", "input": "Hi", "tools": _responses_tools(MISSING),
                                         "tool_choice": "required"},
     _openai_error(f"Invalid schema for function 'f': {WHY_MISSING}", "tools.1.parameters")),
    ("responses_tool_named", "/v1/responses", {"model": "test-model", "input": "Hi", "tools": _responses_tools(LOOP),
                                               "tool_choice": {"type": "function", "name": "f"}},
     _openai_error(f"Invalid schema for function 'f': {WHY_LOOP}", "tools.1.parameters")),
    # Anthropic's shape has no param: the message starts with the field, as Anthropic's own errors do
    ("messages_tool_any", "/v1/messages", _messages(tools=_anthropic_tools(MISSING), tool_choice={"type": "any"}),
     _anthropic_error(f"tools.1.custom.input_schema: {WHY_MISSING}")),
    ("messages_tool_named", "/v1/messages", _messages(tools=_anthropic_tools(HUGE), tool_choice={
        "type": "tool", "name": "f"}), _anthropic_error(f"tools.1.custom.input_schema: {WHY_HUGE}")),
    ("messages_output_format", "/v1/messages", _messages(output_format={"type": "json_schema", "schema": MISSING}),
     _anthropic_error(f"output_format: {WHY_MISSING}")),
    ("messages_output_config", "/v1/messages", _messages(output_config={"format": {
        "type": "json_schema", "schema": LOOP}}), _anthropic_error(f"output_config.format: {WHY_LOOP}")),
]


# Behind reasoning the output starts free: no forced start to fail on, so HUGE fails at decode time instead
SCHEMA_CASES = [pytest.param(case, False, id=f"plain-{case[0]}") for case in SCHEMA_ERRORS] + [
    pytest.param(case, True, id=f"reasoning-{case[0]}") for case in SCHEMA_ERRORS if WHY_HUGE not in str(case[3])]


@pytest.mark.parametrize("case, thinking", SCHEMA_CASES)
async def test_a_schema_the_grammar_cannot_serve_names_its_field(serve, case, thinking):
    """A grammar that does not compile, or fails on its forced start, is a 400 that names the request field that
    carries the bad schema: the format (`response_format`, `text.format`, `output_format`), or the tool's own
    schema (`tools.N.function.parameters`, `tools.N.parameters`, `tools.N.input_schema`), never `tool_choice`;
    the message holds llguidance's reason, not the grammar's text. The same behind reasoning (a template that
    opens `<think>`: the grammar lets the reasoning run first, and is written in Lark)."""
    _, url, payload, error = case
    engine = ScriptedEngine(scripts=["{}"], max_model_len=4096)
    if thinking:
        engine.chat_template = ThinkingTemplate()
    async with serve(engine, tool_call_parser="hermes", reasoning_parser="qwen3" if thinking else "none") as \
            (client, _):
        response = await client.post(url, json=payload)
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, error)
        assert engine.requests == []


async def test_tool_choice_errors_still_name_tool_choice(serve):
    """What is wrong with the choice itself (no tools to force, a name no tool has) blames `tool_choice`."""
    async with serve(ScriptedEngine()) as (client, _):
        unknown = await client.post("/v1/chat/completions", json=chat_body(
            tools=_chat_tools(GOOD), tool_choice={"type": "function", "function": {"name": "h"}}))
        none = await client.post("/v1/responses", json={"model": "test-model", "input": "Hi",
                                                         "tool_choice": "required"})
    assert orjson.loads(await unknown.get_data()) == _openai_error(
        "tool_choice names 'h', which is not one of the tools", "tool_choice")
    assert orjson.loads(await none.get_data()) == _openai_error(
        "tool_choice forces a call but the request gives no tools", "tool_choice")
