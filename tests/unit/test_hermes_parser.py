"""The Hermes tool-call parser (`voltserve.parsers.hermes`) and its lenient JSON (`voltserve.parsers.tool_json`):
streamed in any chunking equals whole (cases T7, T8), `</tool_call>` inside a string (T10), non-finite numbers (T9),
held markup released as soon as it cannot become a call (T6's trailing `<`), malformed markup kept as content."""

from __future__ import annotations

import json
import random

import pytest

from voltserve.parsers.hermes import HermesToolParser, ToolCall, parse_pieces, parse_tool_calls
from voltserve.parsers.tool_json import MAX_DEPTH, ObjectScanner, decode_object_prefix, quote_non_finite

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    "\n\n" + WEATHER,
    "Let me check.\n\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Rome") + "\n",
    'Sure <b>bold</b> and a < sign <tool_call',
    '<tool_call>{"name": "f", "arguments": {"s": "a </tool_call> b", "q": "\\"}"}}</tool_call> done',
    '<tool_call>not json</tool_call> ok <tool_call>{"name": "g"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": ',  # cut short
    "plain text with trailing space \n",
    '<tool_call>{"name": "f", "arguments": {"x": inf, "y": 1e999}}</tool_call>',
]


def _stream(text: str, sizes) -> tuple[str, list[ToolCall], list[str]]:
    parser, content, calls, pieces, i = HermesToolParser(), "", [], [], 0
    for size in sizes:
        piece, new = parser.feed(text[i:i + size])
        content, calls, i = content + piece, calls + new, i + size
        pieces.append(piece)
        if i >= len(text):
            break
    last, _ = parser.finish()
    pieces.append(last)
    return content + last, calls, pieces


@pytest.mark.parametrize("text", TEXTS)
def test_any_chunking_gives_the_whole_text_result(text):
    whole = parse_tool_calls(text)
    gen = random.Random(len(text))
    for sizes in ([1] * len(text), [len(text)], [gen.randint(1, 9) for _ in range(len(text))]):
        content, calls, _ = _stream(text, sizes)
        assert (content, calls) == whole


def test_calls_and_content():
    assert parse_tool_calls(TEXTS[1]) == ("Let me check.", [ToolCall("get_weather", '{"city": "Paris"}'),
                                                             ToolCall("get_weather", '{"city": "Rome"}')])
    # T10: the closing tag inside a string argument does not end the call
    assert parse_tool_calls(TEXTS[3]) == (" done", [ToolCall("f", '{"s": "a </tool_call> b", "q": "\\"}"}')])
    # markup that is not a call stays content as written; a later call still parses; no arguments = {}
    assert parse_tool_calls(TEXTS[4]) == ("<tool_call>not json</tool_call> ok", [ToolCall("g", "{}")])
    # a call cut short is content; so is a trailing marker prefix
    assert parse_tool_calls(TEXTS[5]) == (TEXTS[5], [])
    assert parse_tool_calls(TEXTS[2]) == (TEXTS[2], [])
    # arguments given as a JSON string are read as the object they spell
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == \
        ("", [ToolCall("f", '{"a": 1}')])


def test_T7_whitespace_is_held_until_text_or_dropped_before_a_call():
    _, calls, pieces = _stream("\n\n" + WEATHER, [1] * 200)
    assert set(pieces) == {""} and len(calls) == 1  # the line breaks never went out
    content, calls, pieces = _stream("\n\nHello \n", [1] * 20)
    assert [p for p in pieces if p] == ["\n\nH", "e", "l", "l", "o", " \n"] and calls == []
    assert content == "\n\nHello \n"  # no call: the held whitespace goes out at the end


def test_T8_a_whole_call_in_one_delta_comes_out_whole():
    parser = HermesToolParser()
    content, calls = parser.feed(WEATHER + WEATHER.replace("get_weather", "now").replace(
        '"arguments": {"city": "Paris"}', '"arguments": {}'))
    assert content == "" and calls == [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("now", "{}")]


def test_a_trailing_angle_bracket_is_held_only_while_it_may_open_a_call():
    parser = HermesToolParser()
    assert parser.feed("a <") == ("a", [])
    assert parser.feed("b") == (" <b", [])  # released once the next text shows it is not `<tool_call>`
    assert parser.feed(" <tool_") == ("", [])  # all of it may still become the tag (the space: whitespace): held
    assert parser.feed("x") == (" <tool_x", [])


def test_T9_non_finite_numbers_are_kept_as_their_text():
    text = ('<tool_call>{"name": "f", "arguments": {"a": inf, "b": -Infinity, "c": NaN, "d": 1e999, '
            '"e": [nan, 2.5], "info": 1, "s": "inf"}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {"n": 3.5}}</tool_call>')
    _, calls = parse_tool_calls(text)
    assert [json.loads(c.arguments) for c in calls] == [
        {"a": "inf", "b": "-Infinity", "c": "NaN", "d": "1e999", "e": ["nan", 2.5], "info": 1, "s": "inf"},
        {"n": 3.5}]
    for call in calls:  # strict JSON: no NaN / Infinity tokens
        json.loads(call.arguments, parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))


def test_quote_non_finite_leaves_strings_and_words_alone():
    assert quote_non_finite('{"nan": "inf \\" nan", "x": nanny, "y": -inf, "z": 1.5e3}') == \
        '{"nan": "inf \\" nan", "x": nanny, "y": "-inf", "z": 1.5e3}'


def test_decode_object_prefix_waits_for_the_close_and_refuses_non_objects():
    assert decode_object_prefix('  {"a": "}"') is None
    assert decode_object_prefix('  {"a": "}"} rest') == ({"a": "}"}, 12)
    with pytest.raises(ValueError):
        decode_object_prefix('["a"]')
    with pytest.raises(ValueError):
        decode_object_prefix('{"a": }')


def test_pieces_keep_the_model_order():
    text = "Checking." + WEATHER + " then " + WEATHER.replace("Paris", "Rome") + "\n"
    paris, rome = ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_weather", '{"city": "Rome"}')
    assert parse_pieces(text) == ["Checking.", paris, " then", rome]
    parser = HermesToolParser()  # one delta holding text on both sides of a call keeps them apart
    assert parser.pieces("a" + WEATHER + "b") == ["a", paris, "b"]
    assert parser.finish_pieces() == []


def test_bodies_a_client_cannot_be_sent_are_content():
    """A lone surrogate escape (UTF-8 cannot carry it) or nesting deeper than MAX_DEPTH: not a call."""
    for body in ('{"name": "f", "arguments": {"s": "\\ud800"}}', '{"name": "\\udfff"}',
                 '{"name": "f", "arguments": {"a": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}}"):
        text = f"<tool_call>{body}</tool_call> ok"
        assert parse_tool_calls(text) == (text, [])
    nested = "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)  # within the limit: a call
    assert parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {{"a": {nested}}}}}</tool_call>')[1]


def test_a_closed_body_at_the_end_of_the_output_is_a_call():
    """The output may end (EOS) after the body, before `</tool_call>` or in the middle of it."""
    for end in ("", "\n", "\n</tool_"):
        assert parse_tool_calls('<tool_call>{"name": "f"}' + end) == ("", [ToolCall("f", "{}")])


def test_object_scanner_keeps_its_place_across_pieces():
    text = '{"s": "a \\" } \\\\", "n": [1, {"x": "]"}]} tail'
    scanner = ObjectScanner()
    ends = [scanner.scan(ch) for ch in text]
    assert ends.index(1) == text.index("} tail") and ends[:ends.index(1)] == [None] * text.index("} tail")
    assert ObjectScanner().scan(text) == text.index(" tail")
    with pytest.raises(ValueError):
        ObjectScanner().scan("  [1]")
