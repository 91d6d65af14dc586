"""Reasoning (`<think>` ... `</think>`) in Chat Completions over the ScriptedEngine: `message.reasoning_content`
and `delta.reasoning_content` (vLLM's field), the parser choice (`reasoning_parser`, `enable_thinking`), and case
T1 of ../shared/cases/api-behaviour.md (a `<tool_call>` that ends the reasoning under a JSON grammar), whole and
streamed; each scripted output is one its request's grammar accepts."""

from __future__ import annotations

import orjson
import pytest

from tests.api.conftest import chat_body
from tests.api.fake_engine import ChunkedEngine, ScriptedEngine, ThinkingTemplate
from tests.api.test_tool_calls import TOOLS
from tests.unit.test_grammar_rules import complete

URL = "/v1/chat/completions"
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


async def _both(serve, script: str, engine_cls=ScriptedEngine, template=True, config=None, **extra):
    """(non-streamed response, streamed chunks, the request's grammar) of one chat request."""
    engine = engine_cls(scripts=[script], max_model_len=4096)
    if template:
        engine.chat_template = ThinkingTemplate()
    body = chat_body(**extra)
    async with serve(engine, **(config or {})) as (client, _):
        whole = orjson.loads(await (await client.post(URL, json=body)).get_data())
        data = await (await client.post(URL, json={**body, "stream": True})).get_data()
    events = data.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    return whole, [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]], engine.requests[-1][1].grammar


def _joined(chunks) -> tuple[str, str, list[dict], list[str]]:
    """(joined reasoning, joined content, tool-call deltas, finish reasons) of streamed chunks."""
    deltas = [c["choices"][0]["delta"] for c in chunks]
    return ("".join(d.get("reasoning_content") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas),
            [tc for d in deltas for tc in d.get("tool_calls") or []],
            [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]])


async def test_reasoning_content_whole_and_streamed(serve):
    whole, chunks, _ = await _both(serve, "I should greet.\n</think>\n\nHello!", engine_cls=ChunkedEngine)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "\n\nHello!",
                                              "reasoning_content": "I should greet.\n"}
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "\n\nHello!", "reasoning_content": "I should greet.\n"}]  # one delta held the whole output
    whole, chunks, _ = await _both(serve, "I should greet.\n</think>\n\nHello!")
    assert _joined(chunks) == ("I should greet.\n", "\n\nHello!", [], ["stop"])
    assert chunks[1]["choices"][0]["delta"] == {"reasoning_content": "I"}


async def test_exact_stream_bytes_with_reasoning(serve):
    engine = ChunkedEngine(scripts=["<think>Hm</think>Hi"], size=6)
    async with serve(engine, reasoning_parser="qwen3") as (client, _):
        data = await (await client.post(URL, json=chat_body(stream=True))).get_data()
    head = b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":1700000000,"model":"test-model",'
    assert data == (
        head + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
               b'"finish_reason":null}]}\n\n'
        # deltas "<think" (held), ">Hm</t" (the end of it held), "hink>H", "i" and EOS
        + head + b'"choices":[{"index":0,"delta":{"reasoning_content":"Hm"},"logprobs":null,'
                 b'"finish_reason":null}]}\n\n'
        + head + b'"choices":[{"index":0,"delta":{"content":"H"},"logprobs":null,"finish_reason":null}]}\n\n'
        + head + b'"choices":[{"index":0,"delta":{"content":"i"},"logprobs":null,"finish_reason":"stop"}]}\n\n'
        + b"data: [DONE]\n\n")


async def test_the_parser_choice_and_enable_thinking_false(serve):
    script = "<think>x</think>y"
    # the default: a template without `<think>` (SmolLM2's), auto: no reasoning is read
    whole, _, _ = await _both(serve, script, template=False)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": script}
    whole, _, _ = await _both(serve, script, template=False, config={"reasoning_parser": "qwen3"})
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "y", "reasoning_content": "x"}
    whole, chunks, _ = await _both(serve, script, chat_template_kwargs={"enable_thinking": False})
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": script}
    assert _joined(chunks)[:2] == ("", script)
    whole, _, _ = await _both(serve, "abc</think>d", template=False, config={"reasoning_parser": "deepseek_r1"})
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "d", "reasoning_content": "abc"}
    whole, _, _ = await _both(serve, "abc", config={"reasoning_parser": "none"})
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "abc"}


@pytest.mark.parametrize("engine_cls", [ScriptedEngine, ChunkedEngine])
async def test_T1_required_returns_the_calls(serve, engine_cls):
    script = "Paris, then.\n" + CALL
    whole, chunks, grammar = await _both(serve, script, engine_cls, tools=TOOLS, tool_choice="required")
    assert complete(script, grammar)
    expected = {"id": "call_0_0_0", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert whole["choices"][0] == {"index": 0, "message": {
        "role": "assistant", "content": None, "reasoning_content": "Paris, then.\n", "tool_calls": [expected]},
        "logprobs": None, "finish_reason": "tool_calls"}
    assert _joined(chunks) == ("Paris, then.\n", "", [{"index": 0, **expected}], ["tool_calls"])


@pytest.mark.parametrize("engine_cls", [ScriptedEngine, ChunkedEngine])
async def test_T1_named_call_arguments_do_not_begin_with_the_marker(serve, engine_cls):
    script = "The tool it is." + CALL
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole, chunks, grammar = await _both(serve, script, engine_cls, tools=TOOLS, tool_choice=choice)
    assert complete(script, grammar)
    message = whole["choices"][0]["message"]
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}']
    assert message["reasoning_content"] == "The tool it is." and message["content"] is None
    _, content, calls, finishes = _joined(chunks)
    assert (content, [c["function"]["arguments"] for c in calls], finishes) == ("", ['{"city": "Paris"}'],
                                                                                 ["tool_calls"])


@pytest.mark.parametrize("engine_cls", [ScriptedEngine, ChunkedEngine])
@pytest.mark.parametrize("end", ["<tool_call>", "</think>\n\n"])
async def test_T1_json_response_format_content_parses(serve, engine_cls, end):
    script = "Sure." + end + '{"ok":true}'
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    whole, chunks, grammar = await _both(serve, script, engine_cls, response_format=response_format)
    assert complete(script, grammar)
    content = end.removeprefix("<tool_call>").removeprefix("</think>") + '{"ok":true}'
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": content, "reasoning_content": "Sure."}
    assert orjson.loads(content) == {"ok": True}
    assert _joined(chunks) == ("Sure.", content, [], ["stop"])
