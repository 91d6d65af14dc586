"""Reasoning in POST /v1/messages over the ScriptedEngine: a `thinking` block ahead of the text and tool_use
blocks (exact JSON and event bytes, events checked against the `anthropic` SDK's types), `thinking` enabled /
disabled, and case T1 (`<tool_call>` ending the reasoning under a forced call)."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message

from tests.api.fake_engine import ByteTokenizer, ChunkedEngine, ScriptedEngine, ThinkingTemplate
from tests.api.test_messages import URL, USER_HI, body
from tests.api.test_messages_tools import _events, _stop_reason, tool_body
from tests.api.test_reasoning import CALL
from tests.unit.test_grammar_rules import complete


async def _both(serve, script: str, engine_cls=ScriptedEngine, payload=None, template=True):
    """(non-streamed message, streamed events, the request's grammar) of one Messages request."""
    engine = engine_cls(scripts=[script], max_model_len=4096)
    if template:
        engine.chat_template = ThinkingTemplate()
    payload = payload or body()
    async with serve(engine, tool_call_parser="hermes") as (client, _):
        whole = json.loads(await (await client.post(URL, json=payload)).get_data())
        data = await (await client.post(URL, json={**payload, "stream": True})).get_data()
    Message.model_validate(whole)
    return whole, _events(data), engine.requests[-1][1].grammar


def _blocks(events: list[dict]) -> list[dict]:
    """The content blocks a stream's events build, thinking deltas included."""
    blocks = []
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking",
                   "input_json_delta": "partial_json"}[delta["type"]]
            block[key] = block.get(key, "") + delta[key]
    for block in blocks:
        if "partial_json" in block:
            block["input"] = json.loads(block.pop("partial_json"))
    return blocks


async def test_thinking_block_exact_json_and_stream_bytes(serve):
    whole, _, _ = await _both(serve, "Hm.</think>Hi", ChunkedEngine)
    assert whole["content"] == [{"type": "thinking", "thinking": "Hm.", "signature": ""},
                                {"type": "text", "text": "Hi"}]
    engine = ChunkedEngine(scripts=["Hm.</think>Hi"], size=5)
    engine.chat_template = ThinkingTemplate()
    async with serve(engine) as (client, _):
        data = await (await client.post(URL, json=body(stream=True))).get_data()
    start = data.index(b"event: ping\n")  # deltas "Hm.</" (its end held), "think", ">Hi" and EOS
    assert data[start:] == (
        b'event: ping\ndata: {"type":"ping"}\n\n'
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":'
        b'{"type":"thinking","thinking":"","signature":""}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":'
        b'{"type":"thinking_delta","thinking":"Hm."}}\n\n'
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        b'event: content_block_start\ndata: {"type":"content_block_start","index":1,"content_block":'
        b'{"type":"text","text":""}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,"delta":'
        b'{"type":"text_delta","text":"Hi"}}\n\n'
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
        b'"stop_sequence":null},"usage":{"input_tokens":%d,"output_tokens":14,"cache_creation_input_tokens":0,'
        b'"cache_read_input_tokens":0}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n' % len(ByteTokenizer().encode(USER_HI + "<think>\n")))


async def test_streamed_thinking_token_by_token_equals_the_whole(serve):
    whole, events, _ = await _both(serve, "a<b</think>\n\nc")
    assert whole["content"] == _blocks(events) == [{"type": "thinking", "thinking": "a<b", "signature": ""},
                                                   {"type": "text", "text": "\n\nc"}]


async def test_thinking_disabled_and_enabled(serve):
    payload = body(thinking={"type": "disabled"})
    whole, _, _ = await _both(serve, "<think>x</think>y", payload=payload)
    assert whole["content"] == [{"type": "text", "text": "<think>x</think>y"}]
    payload = body(thinking={"type": "enabled", "budget_tokens": 1024})
    whole, _, _ = await _both(serve, "x</think>y", payload=payload)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]


@pytest.mark.parametrize("engine_cls", [ScriptedEngine, ChunkedEngine])
async def test_T1_forced_tool_after_reasoning(serve, engine_cls):
    script = "Paris." + CALL
    payload = tool_body(tool_choice={"type": "tool", "name": "get_weather"})
    whole, events, grammar = await _both(serve, script, engine_cls, payload)
    assert complete(script, grammar)
    expected = [{"type": "thinking", "thinking": "Paris.", "signature": ""},
                {"type": "tool_use", "id": "toolu_0_0_0", "name": "get_weather", "input": {"city": "Paris"}}]
    assert whole["content"] == _blocks(events) == expected
    assert whole["stop_reason"] == _stop_reason(events) == "tool_use"


async def test_a_prefill_after_an_opened_think_continues_the_reasoning(serve):
    """The template opened `<think>` and the client prefills the reasoning's start: the output continues it (a
    thinking block, then the text); after a prefill that closes the reasoning the output is all text (a later
    `</think>` included: the scripted engine answers the same text to both)."""
    engine = ScriptedEngine(scripts=[" more thought.</think>\n\nAnswer.", "Answer."], max_model_len=4096)
    engine.chat_template = ThinkingTemplate()
    async with serve(engine) as (client, _):
        inside = await client.post(URL, json=body(messages=[{"role": "user", "content": "Hi"},
                                                            {"role": "assistant", "content": "Some"}]))
        closed = await client.post(URL, json=body(messages=[{"role": "user", "content": "Hi"},
                                                            {"role": "assistant", "content": "Some.</think>"}]))
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in (await inside.get_json())["content"]] == \
        [("thinking", " more thought."), ("text", "\n\nAnswer.")]
    assert [(b["type"], b.get("text")) for b in (await closed.get_json())["content"]] == \
        [("text", " more thought.</think>\n\nAnswer.")]
