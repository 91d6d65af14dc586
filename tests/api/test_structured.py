"""Forced tool choice and JSON output through the APIs (`api.structured`), over the ScriptedEngine: the grammar a
request carries accepts exactly the scripted output (walked with `voltserve.grammar.GrammarState` on the test
tokenizer), and what the APIs return for it: cases T2, T5, T13, A1, A3 of ../shared/cases/api-behaviour.md.
The engine applying the grammar is tests/e2e/test_grammar.py's; the real server's, test_structured_sdk.py's."""

from __future__ import annotations

import orjson

from tests.api.conftest import chat_body
from tests.api.fake_engine import ScriptedEngine
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


async def test_forced_chat_calls_and_T13_a_call_cut_short(serve):
    whole, chunks = await chat_both(serve, CALL, tool_choice="required")
    message = whole["choices"][0]["message"]
    assert message["content"] is None and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert _joined(chunks)[0] == "" and whole["choices"][0]["finish_reason"] == "tool_calls"
    # T13: cut by max_tokens, nothing parses: no calls, no markup as content, and finish_reason says length
    whole, chunks = await chat_both(serve, CALL, tool_choice="required", max_tokens=30)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": None}
    assert whole["choices"][0]["finish_reason"] == "length" and _joined(chunks) == ("", [], ["length"])


async def test_A1_forced_anthropic_call_stops_with_tool_use_and_A3_a_cut_call_is_left_out(serve):
    whole, events = await messages_both(serve, CALL, tool_choice={"type": "tool", "name": "get_weather"})
    assert [b["type"] for b in whole["content"]] == [b["type"] for b in _blocks(events)] == ["tool_use"]
    assert whole["stop_reason"] == _stop_reason(events) == "tool_use"
    whole, events = await messages_both(serve, CALL, tool_choice={"type": "any"}, max_tokens=30)
    assert whole["content"] == _blocks(events) == []  # no empty text block: Anthropic would refuse it back
    assert whole["stop_reason"] == _stop_reason(events) == "max_tokens"
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]


async def test_forced_responses_call_is_a_function_call_item(serve):
    whole, _, final = await responses_both(serve, CALL, tool_choice="required")
    assert [item["type"] for item in whole["output"]] == ["function_call"]
    assert whole["output"][0]["arguments"] == '{"city": "Paris"}' and whole == final and whole["status"] == "completed"


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
                                     "message": f"invalid output_config.format: {why}"}}),
    ]
    async with serve(ScriptedEngine(scripts=["{}"])) as (client, engine):
        for url, payload, error in cases:
            response = await client.post(url, json=payload)
            assert (response.status_code, orjson.loads(await response.get_data())) == (400, error), url
        assert engine.requests == []
