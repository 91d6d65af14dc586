"""Function calling in POST /v1/responses (tool_choice auto / none; Hermes markup read by the server's parser)
over the ScriptedEngine: exact JSON and event bytes, cases T6, T7, T8 and T12 of ../shared/cases/api-behaviour.md,
parallel_tool_calls false, and function_call / function_call_output input items reaching the chat template.
Each stream also passes `sdk_checked` (every event against the `openai` SDK's types)."""

from __future__ import annotations

import json

import orjson
from tests.api.fake_engine import ScriptedEngine
from tests.api.test_responses import (
    URL, body, event, message, message_events, opening_events, response_object, sdk_checked, usage,
)
from tests.api.fake_engine import ChunkedEngine, RecordingTemplate, hermes_call as call

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
ECHOED = [{**WEATHER, "strict": None}]  # the request's tools as the response object echoes them
PARIS = call("get_weather", '{"city": "Paris"}')
PARIS_ARGS = '{"city": "Paris"}'


def function_call(k: int, arguments: str, status: str = "completed", name: str = "get_weather") -> dict:
    """The k-th function_call output item as the server renders it for response "resp_0"."""
    return {"type": "function_call", "id": f"fc_0_0_{k}", "call_id": f"call_0_0_{k}", "name": name,
            "arguments": arguments, "status": status}


def with_tools(response: dict) -> dict:
    return {**response, "tools": ECHOED}


async def both(serve, script: str, engine_cls=ScriptedEngine, parser: str = "hermes", **extra):
    """(non-streamed response, streamed events, final streamed response) of one request with `WEATHER`; the
    stream passes `sdk_checked` and ends with the non-streamed response."""
    json_body = body(tools=[WEATHER], **extra)
    async with serve(engine_cls(scripts=[script], max_model_len=4096), tool_call_parser=parser) as (client, _):
        whole = orjson.loads(await (await client.post(URL, json=json_body)).get_data())
        data = await (await client.post(URL, json={**json_body, "stream": True})).get_data()
    events, _ = sdk_checked(data)
    final = events[-1][1]["response"]
    assert final == whole
    return whole, events, final


def names(events) -> list[str]:
    return [name for name, _ in events]


CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


async def test_function_call_exact_json(serve):
    """The line breaks before the call are dropped (case T7), so there is no message item."""
    async with serve(ScriptedEngine(scripts=["\n\n" + PARIS]), tool_call_parser="hermes") as (client, engine):
        data = await (await client.post(URL, json=body(tools=[WEATHER]))).get_data()
    output_tokens = len(("\n\n" + PARIS).encode()) + 1
    assert data == orjson.dumps(with_tools(response_object(
        "completed", [function_call(0, PARIS_ARGS)], usage(21, output_tokens))))


async def test_text_then_call_stream_exact_bytes(serve):
    async with serve(ScriptedEngine(scripts=["Ok\n" + PARIS]), tool_call_parser="hermes") as (client, _):
        data = await (await client.post(URL, json=body(tools=[WEATHER], stream=True))).get_data()
    fc = {"item_id": "fc_0_0_0", "output_index": 1}
    done = [message("Ok", "completed"), function_call(0, PARIS_ARGS)]
    expected = b"".join([
        *opening_events(with_tools(response_object("in_progress", [], None))),
        # the line break before the call is held, then dropped
        *message_events(["O", "k"], 2),
        event("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 9,
                                             "output_index": 1, "item": function_call(0, "", "in_progress")}),
        event("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                         "sequence_number": 10, **fc, "delta": PARIS_ARGS}),
        event("response.function_call_arguments.done", {"type": "response.function_call_arguments.done",
                                                        "sequence_number": 11, **fc, "name": "get_weather",
                                                        "arguments": PARIS_ARGS}),
        event("response.output_item.done", {"type": "response.output_item.done", "sequence_number": 12,
                                            "output_index": 1, "item": done[1]}),
        event("response.completed", {"type": "response.completed", "sequence_number": 13, "response": with_tools(
            response_object("completed", done, usage(21, len(("Ok\n" + PARIS).encode()) + 1)))}),
    ])
    assert data == expected
    sdk_checked(data)


async def test_only_a_call_has_no_message_item(serve):
    whole, events, _ = await both(serve, "\n\n" + PARIS)
    assert names(events) == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"]
    assert [e["output_index"] for _, e in events[2:-1]] == [0] * 4
    assert whole["output"] == [function_call(0, PARIS_ARGS)]


async def test_text_after_a_call_is_a_new_message_item(serve):
    whole, events, _ = await both(serve, "Let me see." + PARIS + "\n\nDone.")
    assert [(item["type"], item["id"]) for item in whole["output"]] == \
        [("message", "msg_0"), ("function_call", "fc_0_0_0"), ("message", "msg_0_1")]
    assert [item["content"][0]["text"] for item in whole["output"] if item["type"] == "message"] == \
        ["Let me see.", "\n\nDone."]
    added = [(e["output_index"], e["item"]["type"]) for name, e in events if name == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call"), (2, "message")]


async def test_tools_without_a_call_stream_as_without_tools(serve):
    """No call: the same events as a request without tools (the message item, even when empty). (Whitespace would
    come with the next text: the parser holds it until it knows no call follows, case T7.)"""
    for script in ("Hello", ""):
        async with serve(ScriptedEngine(scripts=[script]), tool_call_parser="hermes") as (client, _):
            plain = await (await client.post(URL, json=body(stream=True))).get_data()
            tools = await (await client.post(URL, json=body(stream=True, tools=[WEATHER]))).get_data()
            whole = orjson.loads(await (await client.post(URL, json=body(tools=[WEATHER]))).get_data())
        echo = orjson.dumps(ECHOED)
        assert tools.count(echo) == 3  # created, in_progress, completed
        assert tools.replace(b'"tools":' + echo, b'"tools":[]') == plain
        assert whole["output"] == [message(script, "completed")]


async def test_T6_tool_choice_none_gives_the_markup_as_text(serve):
    for extra, parser in (({"tool_choice": "none"}, "hermes"), ({}, "none"), ({}, "auto")):
        # "none" as the choice, as the server's parser, or as "auto" picks it for a template without the marker
        whole, events, final = await both(serve, "Hi <" + PARIS, parser=parser, **extra)
        assert whole["output"] == [message("Hi <" + PARIS, "completed")]
        assert "response.function_call_arguments.delta" not in names(events)
        assert final["tool_choice"] == extra.get("tool_choice", "auto")


async def test_T7_whitespace_before_text_comes_with_the_first_text(serve):
    whole, events, _ = await both(serve, "\n\nThe weather:" + PARIS)
    deltas = [e["delta"] for name, e in events if name == "response.output_text.delta"]
    assert deltas[0] == "\n\nT" and "".join(deltas) == "\n\nThe weather:"
    assert [item["type"] for item in whole["output"]] == ["message", "function_call"]


async def test_T8_whole_calls_in_one_delta(serve):
    script = "\n\n" + PARIS + "\n" + call("now", "{}")
    whole, events, _ = await both(serve, script, engine_cls=ChunkedEngine)
    assert whole["output"] == [function_call(0, PARIS_ARGS), function_call(1, "{}", name="now")]
    assert [e["delta"] for name, e in events if name == "response.function_call_arguments.delta"] == \
        [PARIS_ARGS, "{}"]


async def test_T12_responses_five_parallel_calls(serve):
    script = "".join(call("get_weather", f'{{"city": "c{i}"}}') for i in range(5))
    whole, events, _ = await both(serve, script, engine_cls=ChunkedEngine)
    assert whole["output"] == [function_call(i, f'{{"city": "c{i}"}}') for i in range(5)]
    assert len({item["id"] for item in whole["output"]}) == len({item["call_id"] for item in whole["output"]}) == 5
    assert names(events) == ["response.created", "response.in_progress", *CALL_EVENTS * 5, "response.completed"]
    assert [e["output_index"] for _, e in events[2:-1]] == [i for i in range(5) for _ in range(4)]
    assert [json.loads(e["arguments"]) for name, e in events if name == "response.function_call_arguments.done"] \
        == [{"city": f"c{i}"} for i in range(5)]


async def test_parallel_tool_calls_false_keeps_the_first_call(serve):
    script = PARIS + call("now", "{}") + call("get_weather", '{"city": "Rome"}')
    for engine_cls in (ScriptedEngine, ChunkedEngine):
        whole, events, _ = await both(serve, script, engine_cls=engine_cls, parallel_tool_calls=False)
        assert whole["output"] == [function_call(0, PARIS_ARGS)] and whole["parallel_tool_calls"] is False
        assert names(events) == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"]


async def test_a_call_cut_by_max_output_tokens_is_text(serve):
    whole, _, _ = await both(serve, PARIS, max_output_tokens=20)
    assert (whole["status"], whole["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert whole["output"] == [message(PARIS[:20], "incomplete")]


async def test_text_cut_after_a_call(serve):
    script = PARIS + "More text"
    whole, _, _ = await both(serve, script, max_output_tokens=len(PARIS) + 2)
    assert whole["status"] == "incomplete"
    assert whole["output"] == [function_call(0, PARIS_ARGS), message("Mo", "incomplete")]


CALL_INPUT = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
    {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}',
     "id": "fc_a", "status": "completed"},
    {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    {"type": "function_call_output", "call_id": "call_a", "output": "18C"},
    {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "20C"},
                                                                      {"type": "input_text", "text": "sunny"}]},
    {"type": "function_call", "call_id": "call_c", "name": "now", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_c", "output": "noon"},
]


async def test_function_call_items_reach_the_chat_template(serve):
    """function_call items are the tool calls of the assistant message before them (or of a new one);
    function_call_output items are tool messages; the tools are Chat Completions' function list."""
    engine = ScriptedEngine(scripts=["ok"])
    engine.chat_template = RecordingTemplate()
    async with serve(engine) as (client, _):
        response = await client.post(URL, json=body(input=CALL_INPUT, tools=[WEATHER, {"type": "function",
                                                                                        "name": "now"}]))
    assert response.status_code == 200

    def tool_call(call_id: str, name: str, arguments: dict) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

    (messages, tools), = engine.chat_template.calls
    assert messages == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            tool_call("call_a", "get_weather", {"city": "Paris"}),
            tool_call("call_b", "get_weather", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "20C\nsunny"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("call_c", "now", {})]},
        {"role": "tool", "tool_call_id": "call_c", "content": "noon"},
    ]
    assert tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER["parameters"]}},
        {"type": "function", "function": {"name": "now"}}]


async def test_an_earlier_output_comes_back_as_input(serve):
    """A response's output items, sent back with the call's output, render as ChatML renders role and content
    (the fake template shows no tool calls)."""
    async with serve(ScriptedEngine(scripts=["Let me see." + PARIS]), tool_call_parser="hermes") as (client, engine):
        first = orjson.loads(await (await client.post(URL, json=body(tools=[WEATHER]))).get_data())
        turn = [{"role": "user", "content": "Hi"}, *first["output"],
                {"type": "function_call_output", "call_id": first["output"][1]["call_id"], "output": "18C"}]
        second = await client.post(URL, json=body(input=turn, tools=[WEATHER]))
    assert second.status_code == 200
    assert engine.requests[1][0] == engine.tokenizer.encode(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nLet me see.<|im_end|>\n"
        "<|im_start|>tool\n18C<|im_end|>\n<|im_start|>assistant\n")

