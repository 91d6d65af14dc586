"""Reasoning (`<think>` ... `</think>`) in Chat Completions over the ScriptedEngine: `message.reasoning_content`
and `delta.reasoning_content` (vLLM's field), the parser choice (`reasoning_parser`, `enable_thinking`), and case
T1 of ../shared/cases/api-behaviour.md (a `<tool_call>` that ends the reasoning under a JSON grammar), whole and
streamed; each scripted output is one its request's grammar accepts."""

from __future__ import annotations

from functools import partial

import orjson
import pytest

from tests.api.conftest import chat_body
from tests.api.fake_engine import (
    ByteTokenizer, ChunkedEngine, MarkerTokenizer, ScriptedEngine, StreamedEngine, ThinkingTemplate,
)
from tests.api.test_tool_calls import TOOLS
from tests.unit.test_grammar_rules import complete

URL = "/v1/chat/completions"
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


async def _both(serve, script: str | list[str], engine_cls=ScriptedEngine, template=True, config=None, **extra):
    """(non-streamed response, streamed chunks, the request's grammar) of one chat request (`script`: the output,
    or a list of them for n > 1)."""
    engine = engine_cls(scripts=[script] if isinstance(script, str) else script, max_model_len=4096)
    if template:
        engine.chat_template = ThinkingTemplate()
    body = chat_body(**extra)
    streamed = {**body, "stream": True}
    body.pop("stream_options", None)  # allowed only when streaming
    async with serve(engine, **(config or {})) as (client, _):
        whole = orjson.loads(await (await client.post(URL, json=body)).get_data())
        data = await (await client.post(URL, json=streamed)).get_data()
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


USAGE = {"stream_options": {"include_usage": True}}  # the streamed request's usage chunk (`_both` sends it there only)
CHATML_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def _usage(completion: int, reasoning: int | None, opened: bool = True) -> dict:
    """The usage of one request (the prompt as `chat_body` renders it; `opened`: ThinkingTemplate's `<think>\n`
    after it), with `completion_tokens_details` when `reasoning` is not None."""
    prompt = len(ByteTokenizer().encode(CHATML_PROMPT + ("<think>\n" if opened else "")))
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": 0}}
    return usage if reasoning is None else {**usage, "completion_tokens_details": {"reasoning_tokens": reasoning}}


async def _usages(serve, script, engine_cls=ScriptedEngine, template=True, config=None, **extra) -> tuple[dict, dict]:
    """(non-streamed usage, streamed usage chunk's usage) of one chat request."""
    whole, chunks, _ = await _both(serve, script, engine_cls, template, config, **USAGE, **extra)
    assert chunks[-1]["choices"] == []
    return whole["usage"], chunks[-1]["usage"]


async def test_reasoning_tokens_then_content_one_token_a_delta(serve):
    # the prompt opened the reasoning: "I should greet.\n" (16 tokens) and "</think>" (8, its last token ends it)
    whole, streamed = await _usages(serve, "I should greet.\n</think>\n\nHello!")
    assert whole == streamed == _usage(16 + 8 + len("\n\nHello!") + 1, 16 + 8)


@pytest.mark.parametrize(("engine_cls", "reasoning"), [
    (ScriptedEngine, 7 + 2 + 8),  # `<think>`, "Hm", `</think>`
    # deltas "<think" (held: is it `<think>`?), ">Hm</t" (it is: both count), "hink>H" (ends it: all of it counts),
    # "i" + EOS
    (partial(ChunkedEngine, size=6), 18)])
async def test_reasoning_tokens_think_split_and_a_delta_that_ends_the_reasoning(serve, engine_cls, reasoning):
    whole, streamed = await _usages(serve, "<think>Hm</think>Hi", engine_cls, template=False,
                                    config={"reasoning_parser": "qwen3"})
    assert whole == streamed == _usage(len("<think>Hm</think>Hi") + 1, reasoning, opened=False)


async def test_no_reasoning_counts_0_and_no_reasoning_parser_keeps_usage_as_it_was(serve):
    # a reasoning parser that finds no `<think>`: 0
    whole, streamed = await _usages(serve, "Hello!", template=False, config={"reasoning_parser": "qwen3"})
    assert whole == streamed == _usage(7, 0, opened=False)
    # no reasoning parser (the default template, auto; a tool-call parser alone; enable_thinking false): the
    # usage has no completion_tokens_details
    for config, extra in [(None, {}), ({"tool_call_parser": "hermes"}, {"tools": TOOLS})]:
        whole, streamed = await _usages(serve, "<think>x</think>y", template=False, config=config, **extra)
        assert whole == streamed == _usage(len("<think>x</think>y") + 1, None, opened=False)
    whole, streamed = await _usages(serve, "x", chat_template_kwargs={"enable_thinking": False})
    prompt = len(ByteTokenizer().encode(CHATML_PROMPT + "<think>\n\n</think>\n\n"))
    assert whole == streamed == {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2,
                                 "prompt_tokens_details": {"cached_tokens": 0}}


async def test_reasoning_tokens_deepseek_r1_starts_inside(serve):
    whole, streamed = await _usages(serve, "abc</think>d", template=False, config={"reasoning_parser": "deepseek_r1"})
    assert whole == streamed == _usage(13, 3 + 8, opened=False)


async def test_reasoning_tokens_of_a_split_character_count_streamed_too(serve):
    # "é" is two tokens, the first with no text: the stream holds that delta back, its token still counts
    whole, streamed = await _usages(serve, "é?</think>ok")
    assert whole == streamed == _usage(2 + 1 + 8 + 2 + 1, 2 + 1 + 8)


async def test_reasoning_tokens_summed_over_choices(serve):
    # choice 0: "ab" and `</think>`; choice 1 never ends its reasoning: all its tokens, EOS included
    whole, streamed = await _usages(serve, ["ab</think>c", "xyz"], n=2)
    assert whole == streamed == _usage(12 + 4, (2 + 8) + (3 + 1))


# tokens grouped as the engine may hand them over: a real RequestStream's interval, or deltas of `size` tokens
GROUPINGS = [*(partial(StreamedEngine, interval=k) for k in (1, 4, 16)), *(partial(ChunkedEngine, size=k)
                                                                          for k in (1, 4, 16))]


@pytest.mark.parametrize("engine_cls", GROUPINGS)
async def test_reasoning_tokens_do_not_depend_on_how_tokens_are_grouped(serve, engine_cls):
    # `</think>` is one token: "ab" and it count, whichever delta holds it with the answer's tokens
    whole, streamed = await _usages(serve, "ab</think>" + "c" * 30, partial(engine_cls, tokenizer=MarkerTokenizer()))
    assert whole == streamed == _usage(2 + 1 + 30 + 1, 2 + 1)


@pytest.mark.parametrize(("size", "reasoning"), [(1, 2 + 8), (4, 12), (16, 16)])
async def test_reasoning_tokens_a_marker_of_several_tokens_counts_its_delta_whole(serve, size, reasoning):
    # the byte tokenizer spells `</think>` in 8 tokens: the delta that ends the reasoning counts whole ("k>cc" of
    # "ab</", "thin", "k>cc"; the first 16 tokens)
    whole, streamed = await _usages(serve, "ab</think>" + "c" * 30, partial(ChunkedEngine, size=size))
    assert whole == streamed == _usage(2 + 8 + 30 + 1, reasoning)


@pytest.mark.parametrize("tokenizer", [MarkerTokenizer, ByteTokenizer])
@pytest.mark.parametrize("size", [1, 4, 4096])
@pytest.mark.parametrize("config", [None, {"reasoning_parser": "deepseek_r1"}])
async def test_reasoning_tokens_a_call_before_any_reasoning_counts_0(serve, tokenizer, size, config):
    # the output starts inside the reasoning (the prompt opened it, or deepseek_r1) and opens a call at once: the
    # `<tool_call>` that ends the reasoning is the call's, so nothing is reasoning
    whole, chunks, grammar = await _both(serve, CALL, partial(ChunkedEngine, size=size, tokenizer=tokenizer()),
                                         config is None, config, tools=TOOLS, tool_choice="required", **USAGE)
    assert complete(CALL, grammar)
    message = whole["choices"][0]["message"]
    assert "reasoning_content" not in message and len(message["tool_calls"]) == 1  # none: the field is left out
    completion = len(tokenizer().encode(CALL)) + 1
    assert whole["usage"] == chunks[-1]["usage"] == _usage(completion, 0, opened=config is None)
