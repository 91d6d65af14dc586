"""Tool use in Anthropic Messages (`/v1/messages`, tool_choice auto / none) over the ScriptedEngine, which writes
Hermes markup through the real parser and streaming path: `tool_use` blocks (exact JSON), the streamed blocks with
`input_json_delta` (case A4, exact bytes), `disable_parallel_tool_use` (case A2), the `anthropic` SDK's own
accumulator reading the stream, and earlier `tool_use` / `tool_result` blocks rendered into the prompt. Bad tool
inputs are in test_messages.py's BAD_INPUTS."""

from __future__ import annotations

import functools
import json

import anthropic
import httpx2
import orjson
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from api import create_app
from tests.api.conftest import MODEL, fixed_id
from tests.api.fake_engine import ScriptedEngine
from tests.api.test_messages import URL, USER_HI, body
from tests.api.fake_engine import ChunkedEngine
from voltserve.config import EngineConfig

TOOLS = [{"name": "get_weather", "description": "The weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
FUNCTIONS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                               "parameters": TOOLS[0]["input_schema"]}}]


def call(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


WEATHER = "\n\n" + call("Paris")  # 82 bytes: 83 output tokens with EOS
EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)


def tool_body(**extra) -> dict:
    """A valid Messages request with TOOLS and room for a call, with `extra` fields merged in."""
    return body(**{"tools": TOOLS, "max_tokens": 256, **extra})


def _events(data: bytes) -> list[dict]:
    """A Messages stream's events, each checked against the SDK's types (`ping` aside, which it skips)."""
    frames = data.split(b"\n\n")
    assert frames[-1] == b""
    events = []
    for frame in frames[:-1]:
        name, payload = frame.split(b"\n", 1)
        event = orjson.loads(payload.removeprefix(b"data: "))
        assert name == b"event: " + event["type"].encode()
        if event["type"] != "ping":
            EVENT.validate_python(event)
        events.append(event)
    return events


async def _both(serve, script: str, engine_cls=ScriptedEngine, parser: str = "hermes", **extra):
    """(non-streamed message, streamed events) of one Messages request with TOOLS."""
    payload = tool_body(**extra)
    async with serve(engine_cls(scripts=[script], max_model_len=4096), tool_call_parser=parser) as (client, _):
        whole = json.loads(await (await client.post(URL, json=payload)).get_data())  # json: integers of any size
        data = await (await client.post(URL, json={**payload, "stream": True})).get_data()
    Message.model_validate(whole)
    return whole, _events(data)


def _blocks(events: list[dict]) -> list[dict]:
    """The content blocks a stream's events build (as the SDK's accumulator does), checking their indexes."""
    blocks, open_index = [], None
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks) and open_index is None
            blocks.append(dict(event["content_block"]))
            open_index = event["index"]
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
            delta, block = event["delta"], blocks[open_index]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                block["partial_json"] = block.get("partial_json", "") + delta["partial_json"]
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_index
            open_index = None
    for block in blocks:
        if "partial_json" in block:
            block["input"] = json.loads(block.pop("partial_json"))
    return blocks


def _stop_reason(events: list[dict]) -> str:
    (delta,) = [e["delta"] for e in events if e["type"] == "message_delta"]
    return delta["stop_reason"]


async def test_tool_use_exact_json(serve):
    async with serve(ScriptedEngine(scripts=[WEATHER], max_model_len=4096), tool_call_parser="hermes") as \
            (client, _):
        response = await client.post(URL, json=tool_body())
        assert response.status_code == 200
        assert await response.get_data() == (
            b'{"id":"msg_0","type":"message","role":"assistant","model":"test-model","content":['
            b'{"type":"tool_use","id":"toolu_0_0_0","name":"get_weather","input":{"city":"Paris"}}],'
            b'"stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":21,"output_tokens":83,'
            b'"cache_creation_input_tokens":0,"cache_read_input_tokens":0}}')


async def test_A4_stream_tool_use_input_json_delta(serve):
    """Case A4 with a call: message_start, ping, the text block (opened by the first text), closed when the call
    arrives; the call as a tool_use block (start with empty input, one input_json_delta, stop); message_delta
    with stop_reason "tool_use" and usage; message_stop."""
    async with serve(ScriptedEngine(scripts=["Ok" + WEATHER], max_model_len=4096), tool_call_parser="hermes") as \
            (client, _):
        response = await client.post(URL, json=tool_body(stream=True))
        data = await response.get_data()
    assert response.status_code == 200
    assert data == (
        b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_0","type":"message",'
        b'"role":"assistant","model":"test-model","content":[],"stop_reason":null,"stop_sequence":null,'
        b'"usage":{"input_tokens":21,"output_tokens":0,"cache_creation_input_tokens":0,'
        b'"cache_read_input_tokens":0}}}\n\n'
        b'event: ping\ndata: {"type":"ping"}\n\n'
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"O"}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"k"}}\n\n'
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        b'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
        b'"content_block":{"type":"tool_use","id":"toolu_0_0_0","name":"get_weather","input":{}}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        b'"delta":{"type":"input_json_delta","partial_json":"{\\"city\\": \\"Paris\\"}"}}\n\n'
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use",'
        b'"stop_sequence":null},"usage":{"input_tokens":21,"output_tokens":85,"cache_creation_input_tokens":0,'
        b'"cache_read_input_tokens":0}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


async def test_text_before_a_call_streamed_as_whole(serve):
    """Text, then a call: one text block (the whitespace before the call dropped), then the tool_use block;
    the stream builds the same blocks as the non-streamed message."""
    whole, events = await _both(serve, "Let me check." + WEATHER)
    expected = [{"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_0_0_0", "name": "get_weather", "input": {"city": "Paris"}}]
    assert whole["content"] == _blocks(events) == expected
    assert whole["stop_reason"] == _stop_reason(events) == "tool_use"


@pytest.mark.parametrize("engine_cls", [ScriptedEngine, functools.partial(ChunkedEngine, size=4096)])
async def test_parallel_calls_and_text_after(serve, engine_cls):
    """Two calls go out whole, in order, with distinct ids, token by token or in one delta (case T8). The blocks
    keep the model's order, streamed or not: text after the calls is a text block after them."""
    script = "Checking." + WEATHER + "\n" + call("Rome") + " Done."
    whole, events = await _both(serve, script, engine_cls=engine_cls)
    paris, rome = ({"type": "tool_use", "id": f"toolu_0_0_{k}", "name": "get_weather", "input": {"city": city}}
                   for k, city in enumerate(("Paris", "Rome")))
    expected = [{"type": "text", "text": "Checking."}, paris, rome, {"type": "text", "text": " Done."}]
    assert whole["content"] == _blocks(events) == expected
    assert whole["stop_reason"] == _stop_reason(events) == "tool_use"


async def test_A2_disable_parallel_tool_use_keeps_one_call(serve):
    script = WEATHER + "\n" + call("Rome")
    whole, events = await _both(serve, script, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    paris = {"type": "tool_use", "id": "toolu_0_0_0", "name": "get_weather", "input": {"city": "Paris"}}
    assert whole["content"] == _blocks(events) == [paris]
    assert whole["stop_reason"] == _stop_reason(events) == "tool_use"
    whole, events = await _both(serve, script, tool_choice={"type": "auto", "disable_parallel_tool_use": False})
    assert len(whole["content"]) == len(_blocks(events)) == 2


@pytest.mark.parametrize("tool_choice, parser", [({"type": "none"}, "hermes"), ({"type": "auto"}, "none"),
                                                 ({"type": "auto"}, "auto")])
async def test_markup_is_text_without_parsing(serve, tool_choice, parser):
    """tool_choice "none", or no parser for the model (`tool_call_parser` none, or auto with a chat template that
    does not write `<tool_call>`): the markup is text, streamed in the one text block opened at the start."""
    whole, events = await _both(serve, WEATHER, parser=parser, tool_choice=tool_choice)
    assert whole["content"] == _blocks(events) == [{"type": "text", "text": WEATHER}]
    assert whole["stop_reason"] == _stop_reason(events) == "end_turn"
    assert [e["type"] for e in events[:3]] == ["message_start", "content_block_start", "ping"]


async def test_no_content_has_no_block(serve):
    """Nothing to say: `content: []`, and no block streamed (an empty text block could not be sent back)."""
    whole, events = await _both(serve, "")
    assert whole["content"] == _blocks(events) == []
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]


async def test_call_cut_by_max_tokens_is_text(serve):
    """A call that max_tokens cuts short is not a call: its markup is the text, stop_reason max_tokens."""
    whole, events = await _both(serve, WEATHER, max_tokens=40)
    assert whole["content"] == _blocks(events) == [{"type": "text", "text": WEATHER.encode()[:40].decode()}]
    assert whole["stop_reason"] == _stop_reason(events) == "max_tokens"


async def test_a_stop_sequence_after_a_call_is_tool_use(serve):
    whole, events = await _both(serve, WEATHER + "\nmore", stop_sequences=["more"])
    assert whole["stop_reason"] == _stop_reason(events) == "tool_use" and whole["stop_sequence"] is None


async def test_sdk_accumulates_the_streamed_tool_use():
    """The `anthropic` SDK's stream helper reads the stream (in process, through httpx's ASGI transport): its
    final message holds the text and the tool_use block with the parsed input."""
    engine = ScriptedEngine(scripts=["Let me check." + WEATHER], max_model_len=4096)
    engine.config = EngineConfig(model=MODEL, tool_call_parser="hermes").validate()
    app = create_app(engine, new_id=fixed_id, clock=lambda: 1700000000)
    async with app.test_app():
        transport = httpx2.ASGITransport(app=app)  # the SDK's fork of httpx
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            client = anthropic.AsyncAnthropic(base_url="http://test", api_key="x", http_client=http, max_retries=0)
            async with client.messages.stream(model=MODEL, max_tokens=256, tools=TOOLS,
                                              messages=[{"role": "user", "content": "Hi"}]) as stream:
                json_snapshots = [event.snapshot async for event in stream if event.type == "input_json"]
                final = await stream.get_final_message()
    assert json_snapshots == [{"city": "Paris"}]
    assert [block.type for block in final.content] == ["text", "tool_use"]
    text, tool_use = final.content
    assert text.text == "Let me check."
    assert (tool_use.id, tool_use.name, tool_use.input) == ("toolu_0_0_0", "get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0


class JsonTemplate:
    """A chat template double that renders what it is given as JSON, so the prompt shows the chat messages."""

    source = ""

    def render(self, messages, add_generation_prompt=True, tools=None, **kwargs) -> str:
        return orjson.dumps({"messages": messages, "tools": tools}).decode()


HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
         "content": [{"type": "text", "text": "unknown"}, {"type": "text", "text": "city"}]},
        {"type": "text", "text": "Thanks"}]},
]


async def test_history_tool_use_and_tool_result_reach_the_template(serve):
    """Earlier tool_use blocks are the assistant turn's tool_calls (arguments as objects for the template, as in
    chat); tool_result blocks are tool messages before the user's own text; the tools are OpenAI-style
    functions. count_tokens renders the same prompt."""
    engine = ScriptedEngine(scripts=["ok"], max_model_len=4096)
    engine.chat_template = JsonTemplate()
    async with serve(engine, tool_call_parser="hermes") as (client, _):
        response = await client.post(URL, json=tool_body(messages=HISTORY))
        counted = await client.post(URL + "/count_tokens", json=tool_body(messages=HISTORY))
    assert response.status_code == 200
    prompt_ids = engine.requests[-1][0]
    assert orjson.loads(await counted.get_data()) == {"input_tokens": len(prompt_ids)}
    assert orjson.loads(engine.tokenizer.decode(prompt_ids)) == {"tools": FUNCTIONS, "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "unknown\ncity"},
        {"role": "user", "content": "Thanks"},
    ]}


async def test_history_in_chatml_and_turn_merging(serve):
    """Through the ChatML template (role and content only): a user message of tool results only is tool turns
    alone; consecutive assistant messages are one turn (their calls joined), and tool turns are never merged."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "and"},
                                          {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2"}]},
        {"role": "user", "content": "so?"},
    ]
    async with serve(ScriptedEngine(scripts=["ok"], max_model_len=4096), tool_call_parser="hermes") as \
            (client, engine):
        response = await client.post(URL, json=tool_body(messages=messages))
    assert response.status_code == 200
    assert engine.tokenizer.decode(engine.requests[-1][0], skip_special_tokens=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nand<|im_end|>\n"
        "<|im_start|>tool\na<|im_end|>\n<|im_start|>tool\n<|im_end|>\n" + USER_HI.replace("Hi", "so?"))
    engine = ScriptedEngine(scripts=["ok"], max_model_len=4096)
    engine.chat_template = JsonTemplate()
    async with serve(engine, tool_call_parser="hermes") as (client, _):
        assert (await client.post(URL, json=tool_body(messages=messages))).status_code == 200
    assistant = orjson.loads(engine.tokenizer.decode(engine.requests[-1][0]))["messages"][1]
    assert (assistant["content"], [c["id"] for c in assistant["tool_calls"]]) == ("and", ["t1", "t2"])


async def test_a_dropped_call_does_not_split_the_text_around_it(serve):
    """With disable_parallel_tool_use the second call is dropped; the text on both sides of it is one block,
    streamed or not."""
    script = "a" + WEATHER + "b" + call("Rome") + "c"
    whole, events = await _both(serve, script, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    paris = {"type": "tool_use", "id": "toolu_0_0_0", "name": "get_weather", "input": {"city": "Paris"}}
    assert whole["content"] == _blocks(events) == [{"type": "text", "text": "a"}, paris,
                                                   {"type": "text", "text": "bc"}]


async def test_tool_input_keeps_large_integers(serve):
    script = '<tool_call>{"name": "get_weather", "arguments": {"id": 123456789012345678901234567890}}</tool_call>'
    whole, events = await _both(serve, script)
    assert whole["content"][0]["input"] == _blocks(events)[0]["input"] == {"id": 123456789012345678901234567890}
