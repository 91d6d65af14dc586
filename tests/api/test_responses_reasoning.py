"""Reasoning in POST /v1/responses over the ScriptedEngine: a `reasoning` output item ahead of the message or
calls (exact JSON), its streamed events (checked against the `openai` SDK's types by `sdk_checked`), and case T1
(`<tool_call>` ending the reasoning under a forced call or a JSON format)."""

from __future__ import annotations

from functools import partial

import orjson
import pytest

from tests.api.fake_engine import ByteTokenizer, ChunkedEngine, MarkerTokenizer, ScriptedEngine, ThinkingTemplate
from tests.api.test_reasoning import ANSWER, CALL, GROUPINGS
from tests.api.test_responses import URL, body, message, response_object, sdk_checked, usage
from tests.api.test_responses_tools import WEATHER, function_call, names
from tests.unit.test_grammar_rules import complete


def reasoning(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": "rs_0", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


async def _both(serve, script: str, engine_cls=ScriptedEngine, **extra):
    """(non-streamed response, streamed events, the request's grammar) of one request; the stream ends with the
    non-streamed response."""
    engine = engine_cls(scripts=[script], max_model_len=4096)
    engine.chat_template = ThinkingTemplate()
    async with serve(engine, tool_call_parser="hermes") as (client, _):
        whole = orjson.loads(await (await client.post(URL, json=body(**extra))).get_data())
        data = await (await client.post(URL, json=body(stream=True, **extra))).get_data()
    events, _ = sdk_checked(data)
    assert events[-1][1]["response"] == whole
    return whole, events, engine.requests[-1][1].grammar


async def test_reasoning_item_before_the_message_exact_json(serve):
    script = "Greet.</think>\n\nHello!"
    whole, events, _ = await _both(serve, script, ChunkedEngine)
    prompt_tokens = len(ByteTokenizer().encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"))
    # one delta holds the whole output and ends the reasoning: all its tokens (EOS too) count as reasoning
    tokens = len(script.encode()) + 1
    assert whole == response_object("completed", [reasoning("Greet."), message("\n\nHello!", "completed")],
                                     usage(prompt_tokens, tokens, reasoning=tokens))
    assert names(events) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[2][1] == {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
                            "item": {"type": "reasoning", "id": "rs_0", "summary": [], "content": [],
                                     "status": "in_progress"}}
    assert events[3][1] == {"type": "response.reasoning_text.delta", "sequence_number": 3, "item_id": "rs_0",
                            "output_index": 0, "content_index": 0, "delta": "Greet."}
    assert events[6][1]["output_index"] == 1  # the message is the second item


async def test_reasoning_streamed_token_by_token_joins_to_the_item(serve):
    whole, events, _ = await _both(serve, "a<b</think>c")
    deltas = [e["delta"] for name, e in events if name == "response.reasoning_text.delta"]
    assert deltas == ["a", "<b"] and whole["output"][0] == reasoning("a<b")
    # one token a delta: "a<b" and `</think>` (its last token ends the reasoning); `_both`: streamed the same
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 3 + 8}
    assert whole["usage"]["output_tokens"] == 3 + 8 + 1 + 1


@pytest.mark.parametrize(("script", "reasoning_tokens"), [
    ("Hello!", 0),  # no `<think>`: no reasoning
    ("<think>Hm</think>Hi", 7 + 2 + 8),  # `<think>` held over 6 deltas, then counted
    ("<think>é?", 7 + 2 + 1 + 1),  # no end: all reasoning, the EOS and the first byte of "é" (no text) included
])
async def test_reasoning_tokens_when_the_output_may_open_the_reasoning(serve, script, reasoning_tokens):
    engine = ScriptedEngine(scripts=[script], max_model_len=4096)  # ChatML: the prompt does not open it
    async with serve(engine, reasoning_parser="qwen3") as (client, _):
        whole = orjson.loads(await (await client.post(URL, json=body())).get_data())
        data = await (await client.post(URL, json=body(stream=True))).get_data()
    events, _ = sdk_checked(data)
    assert events[-1][1]["response"]["usage"] == whole["usage"]
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    assert whole["usage"]["output_tokens"] == len(script.encode()) + 1


@pytest.mark.parametrize("tokenizer", [ByteTokenizer, MarkerTokenizer])
@pytest.mark.parametrize("engine_cls", [ScriptedEngine, ChunkedEngine])
async def test_T1_required_call_after_reasoning(serve, engine_cls, tokenizer):
    script = "Paris." + CALL
    whole, events, grammar = await _both(serve, script, partial(engine_cls, tokenizer=tokenizer()), tools=[WEATHER],
                                         tool_choice="required")
    assert complete(script, grammar)
    assert whole["output"] == [reasoning("Paris."), function_call(0, '{"city": "Paris"}')]
    assert whole["status"] == "completed"
    if tokenizer is MarkerTokenizer:  # `<tool_call>` is one token: it ends the reasoning and is the call's
        expected = len("Paris.")
    else:  # its 11 tokens were reasoning text until complete; ChunkedEngine's one delta (EOS too) counts whole
        expected = len(script.encode()) + 1 if engine_cls is ChunkedEngine else len("Paris.<tool_call>")
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": expected}


@pytest.mark.parametrize("engine_cls", GROUPINGS)
async def test_reasoning_tokens_do_not_depend_on_how_tokens_are_grouped(serve, engine_cls):
    # `</think>` is one token: "ab" and it count; `_both`: the streamed response is the same
    whole, _, _ = await _both(serve, "ab</think>" + "c" * 30, partial(engine_cls, tokenizer=MarkerTokenizer()))
    assert whole["output"][0] == reasoning("ab")
    assert (whole["usage"]["output_tokens"], whole["usage"]["output_tokens_details"]) == (2 + 1 + 30 + 1,
                                                                                           {"reasoning_tokens": 3})


@pytest.mark.parametrize("tokenizer", [ByteTokenizer, MarkerTokenizer])
@pytest.mark.parametrize("size", [1, 4096])
async def test_reasoning_tokens_a_call_before_any_reasoning_counts_0(serve, tokenizer, size):
    whole, _, _ = await _both(serve, CALL, partial(ChunkedEngine, size=size, tokenizer=tokenizer()), tools=[WEATHER],
                              tool_choice="required")
    assert whole["output"] == [function_call(0, '{"city": "Paris"}')]
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


async def test_T1_json_format_after_reasoning(serve):
    script = 'Sure.<tool_call>{"ok":true}'
    text_format = {"format": {"type": "json_schema", "name": "a", "schema": ANSWER}}
    whole, _, grammar = await _both(serve, script, text=text_format)
    assert complete(script, grammar)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert orjson.loads(whole["output"][1]["content"][0]["text"]) == {"ok": True}


async def test_an_earlier_outputs_reasoning_item_comes_back_as_input(serve):
    """The usual second turn sends the first response's output back (its reasoning item too) with the call's
    output: the reasoning item is dropped from the prompt, the rest is rendered."""
    engine = ScriptedEngine(scripts=["Need weather.\n</think>\n\n" + CALL], max_model_len=4096)
    engine.chat_template = ThinkingTemplate()
    async with serve(engine, tool_call_parser="hermes") as (client, _):
        first = orjson.loads(await (await client.post(URL, json=body(input="Weather in Paris?",
                                                                     tools=[WEATHER]))).get_data())
        assert [o["type"] for o in first["output"]] == ["reasoning", "function_call"]
        call = first["output"][1]
        turn2 = [{"role": "user", "content": "Weather in Paris?"}, *first["output"],
                 {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
        second = await client.post(URL, json=body(input=turn2, tools=[WEATHER]))
        assert second.status_code == 200
        out = orjson.loads(await second.get_data())["output"]
    assert [o["type"] for o in out] == ["reasoning", "function_call"]  # the script again
    prompt = engine.tokenizer.decode(engine.requests[-1][0])
    assert "Need weather" not in prompt and "sunny" in prompt, prompt
