"""Tool calls in Chat Completions (tool_choice auto / none; Hermes markup read by `voltserve.parsers.hermes`) over
the ScriptedEngine, which writes the markup through the real streaming path: cases T6, T7, T8, T9, T10 and T12 of
../shared/cases/api-behaviour.md, the parser choice (`tool_call_parser`), and the chunks against the `openai`
SDK's own types."""

from __future__ import annotations

import json

import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.api.conftest import chat_body
from tests.api.fake_engine import ChunkedEngine, RecordingTemplate, ScriptedEngine, hermes_call as call

URL = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


PARIS = call("get_weather", '{"city": "Paris"}')


async def _both(serve, script: str, engine_cls=ScriptedEngine, parser: str = "hermes", **extra):
    """(non-streamed response, streamed chunks) of one chat request with TOOLS."""
    body = chat_body(tools=TOOLS, **extra)
    async with serve(engine_cls(scripts=[script], max_model_len=4096), tool_call_parser=parser) as (client, _):
        whole = orjson.loads(await (await client.post(URL, json=body)).get_data())
        data = await (await client.post(URL, json={**body, "stream": True})).get_data()
    events = data.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    ChatCompletion.model_validate(whole)
    return whole, chunks


def _joined(chunks) -> tuple[str, list[dict], list[str]]:
    """(joined content, tool-call deltas, finish reasons) of streamed chunks."""
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    return content, calls, finishes


async def test_tool_call_whole_and_streamed(serve):
    whole, chunks = await _both(serve, "\n\n" + PARIS)
    expected = {"id": "call_0_0_0", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert whole["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": None,
                                                           "tool_calls": [expected]},
                                   "logprobs": None, "finish_reason": "tool_calls"}
    content, calls, finishes = _joined(chunks)
    assert (content, calls, finishes) == ("", [{"index": 0, **expected}], ["tool_calls"])
    assert len(chunks) == 3  # role, the call, the finish: the held line breaks and markup sent nothing


async def test_T6_tool_choice_none_returns_the_markup_as_content(serve):
    for extra in ({"tool_choice": "none"}, {}):
        parser = "hermes" if extra else "none"  # with tools, "none" as a choice or as the server's parser
        whole, chunks = await _both(serve, "Hi <" + PARIS, parser=parser, **extra)
        content, calls, finishes = _joined(chunks)
        assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hi <" + PARIS}
        assert (content, calls, finishes) == ("Hi <" + PARIS, [], ["stop"])


async def test_T6_a_trailing_angle_bracket_is_not_held_longer_than_needed(serve):
    _, chunks = await _both(serve, "a <b")
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["a", " <b"]


async def test_T7_whitespace_before_a_call_or_before_text(serve):
    whole, chunks = await _both(serve, "\n\nThe weather:" + PARIS)
    content, calls, _ = _joined(chunks)
    assert content == whole["choices"][0]["message"]["content"] == "\n\nThe weather:"
    assert chunks[1]["choices"][0]["delta"] == {"content": "\n\nT"}  # the line breaks came with the first text
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


async def test_T8_whole_call_in_one_chunk(serve):
    script = "\n\n" + PARIS + "\n" + call("now", "{}")
    whole, chunks = await _both(serve, script, engine_cls=ChunkedEngine)
    content, calls, finishes = _joined(chunks)
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [(0, "get_weather", '{"city": "Paris"}'), (1, "now", "{}")]
    assert content == "" and finishes == ["tool_calls"]
    assert [tc["function"] for tc in whole["choices"][0]["message"]["tool_calls"]] == \
        [c["function"] for c in calls]


async def test_T9_non_finite_numbers_keep_their_text(serve):
    script = call("f", '{"x": inf, "y": 1e999, "z": NaN}') + call("g", '{"n": 2}')
    whole, chunks = await _both(serve, script)
    args = [json.loads(tc["function"]["arguments"]) for tc in whole["choices"][0]["message"]["tool_calls"]]
    assert args == [{"x": "inf", "y": "1e999", "z": "NaN"}, {"n": 2}]
    assert [tc["function"]["arguments"] for tc in _joined(chunks)[1]] == \
        [tc["function"]["arguments"] for tc in whole["choices"][0]["message"]["tool_calls"]]


async def test_T10_closing_tag_inside_a_string_argument(serve):
    script = call("write", '{"text": "ends with </tool_call> and </function>"}')
    whole, chunks = await _both(serve, script)
    expected = '{"text": "ends with </tool_call> and </function>"}'
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == expected
    assert _joined(chunks)[1][0]["function"]["arguments"] == expected


async def test_T12_five_parallel_calls_in_large_deltas(serve):
    script = "".join(call("get_weather", f'{{"city": "c{i}"}}') for i in range(5))
    whole, chunks = await _both(serve, script, engine_cls=ChunkedEngine)
    _, calls, finishes = _joined(chunks)
    assert [(c["index"], c["id"], json.loads(c["function"]["arguments"])["city"]) for c in calls] == \
        [(i, f"call_0_0_{i}", f"c{i}") for i in range(5)]
    assert [tc["id"] for tc in whole["choices"][0]["message"]["tool_calls"]] == [c["id"] for c in calls]
    assert finishes == ["tool_calls"]


async def test_a_call_cut_by_max_tokens_is_content_and_length(serve):
    whole, chunks = await _both(serve, PARIS, max_tokens=20)
    message = whole["choices"][0]["message"]
    assert message == {"role": "assistant", "content": PARIS.encode()[:20].decode()}
    assert _joined(chunks) == (message["content"], [], ["length"])


async def test_no_tools_means_no_parsing(serve):
    async with serve(ScriptedEngine(scripts=[PARIS]), tool_call_parser="hermes") as (client, _):
        got = orjson.loads(await (await client.post(URL, json=chat_body())).get_data())
    assert got["choices"][0]["message"] == {"role": "assistant", "content": PARIS}


@pytest.mark.parametrize("template_writes_marker", [True, False])
async def test_auto_parser_follows_the_chat_template(serve, template_writes_marker):
    engine = ScriptedEngine(scripts=[PARIS])
    engine.chat_template.source = "{{ '<tool_call>' }}" if template_writes_marker else "{{ messages }}"
    async with serve(engine) as (client, _):  # tool_call_parser defaults to auto
        got = orjson.loads(await (await client.post(URL, json=chat_body(tools=TOOLS))).get_data())
    assert ("tool_calls" in got["choices"][0]["message"]) is template_writes_marker


async def test_n2_each_choice_has_its_own_calls(serve):
    whole, chunks = await _both(serve, PARIS, n=2)
    assert [c["message"]["tool_calls"][0]["id"] for c in whole["choices"]] == ["call_0_0_0", "call_0_1_0"]
    streamed = [tc["id"] for c in chunks for tc in (c["choices"][0]["delta"].get("tool_calls") or [])]
    assert sorted(streamed) == ["call_0_0_0", "call_0_1_0"]


async def test_earlier_calls_reach_the_template_with_object_arguments(serve):
    """Templates render `function.arguments` with tojson (Llama 3.1, Hermes): JSON text from the API becomes an
    object; text that is not a JSON object, nests too deeply or holds a lone surrogate stays as it is (no 500)."""
    engine = ScriptedEngine(scripts=["ok"])
    engine.chat_template = RecordingTemplate()
    deep = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
             {"id": "c3", "type": "function", "function": {"name": "h", "arguments": deep}},
             {"id": "c4", "type": "function", "function": {"name": "i", "arguments": '{"s": "\\ud800"}'}}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    async with serve(engine) as (client, _):
        response = await client.post(URL, json=chat_body(messages=messages, tools=TOOLS))
    assert response.status_code == 200
    (rendered, tools), = engine.chat_template.calls
    assert tools == TOOLS
    assert [c["function"]["arguments"] for c in rendered[1]["tool_calls"]] == \
        [{"a": [1, 2]}, "not json", deep, '{"s": "\\ud800"}']
    assert rendered[2] == {"role": "tool", "content": "3", "tool_call_id": "c1"}


async def test_parallel_tool_calls_false_keeps_the_first_call(serve):
    script = PARIS + call("now", "{}")
    for engine_cls in (ScriptedEngine, ChunkedEngine):
        whole, chunks = await _both(serve, script, engine_cls=engine_cls, parallel_tool_calls=False)
        assert [tc["function"]["name"] for tc in whole["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
        assert [tc["function"]["name"] for tc in _joined(chunks)[1]] == ["get_weather"]




@pytest.mark.parametrize("extra", [{"parallel_tool_calls": None}, {}, {"parallel_tool_calls": True}])
async def test_T3_null_parallel_tool_calls_keeps_every_call(serve, extra):
    """Case T3 on Chat Completions: `parallel_tool_calls: null` is the default (parallel allowed): both calls stay,
    whole and streamed, as when the field is left out."""
    script = PARIS + call("now", "{}")
    for engine_cls in (ScriptedEngine, ChunkedEngine):
        whole, chunks = await _both(serve, script, engine_cls=engine_cls, **extra)
        names = [tc["function"]["name"] for tc in whole["choices"][0]["message"]["tool_calls"]]
        assert names == [tc["function"]["name"] for tc in _joined(chunks)[1]] == ["get_weather", "now"]
        assert whole["choices"][0]["finish_reason"] == _joined(chunks)[2][0] == "tool_calls"
