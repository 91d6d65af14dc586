"""The reasoning parser (`voltserve.parsers.reasoning`) and its composition with the Hermes tool-call parser
(`voltserve.parsers.output`): markers split over deltas, no end marker, DeepSeek-R1's output that starts inside the
reasoning, and case T1's implicit end."""

from __future__ import annotations

import pytest

from voltserve.parsers.hermes import HermesToolParser, ToolCall
from voltserve.parsers.output import OutputParser, Reasoning, parse_deltas, parse_output, split
from voltserve.parsers.reasoning import ReasoningParser


def _streamed(parser: ReasoningParser, deltas: list[str]) -> list[tuple[str, str]]:
    return [parser.feed(d) for d in deltas] + [parser.finish()]


def _joined(pairs) -> tuple[str, str]:
    return "".join(r for r, _ in pairs), "".join(c for _, c in pairs)


def test_whole_output_splits_at_the_markers():
    parser = ReasoningParser()
    assert _streamed(parser, ["<think>\nWhy?\n</think>\n\nBecause."]) == [("\nWhy?\n", "\n\nBecause."), ("", "")]
    assert parser.ended_by == "</think>"


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_markers_split_over_deltas(size):
    text = "<think>a <b> </thin c</think>Done </think"
    deltas = [text[i:i + size] for i in range(0, len(text), size)]
    pairs = _streamed(ReasoningParser(), deltas)
    assert _joined(pairs) == ("a <b> </thin c", "Done </think")


def test_held_text_goes_out_once_it_cannot_become_a_marker():
    parser = ReasoningParser()
    assert [parser.feed(d) for d in ["<th", "ink>x <", "/t", "hat"]] == [("", ""), ("x ", ""), ("", ""),
                                                                       ("</that", "")]


def test_no_end_marker_is_all_reasoning():
    assert _joined(_streamed(ReasoningParser(), ["<think>still ", "going </thi"])) == ("still going </thi", "")


def test_without_think_the_output_is_content_unless_the_prompt_opened_it():
    assert _joined(_streamed(ReasoningParser(), ["<th", "at is", " all"])) == ("", "<that is all")
    assert _joined(_streamed(ReasoningParser(), ["<thi"])) == ("", "<thi")
    # deepseek_r1: the template wrote `<think>`, the output starts inside the reasoning
    assert _joined(_streamed(ReasoningParser(starts_inside=True), ["Hm", "m.</th", "ink>OK"])) == ("Hmm.", "OK")
    assert _joined(_streamed(ReasoningParser(starts_inside=True), ["<think>Hm</think>OK"])) == ("Hm", "OK")


def test_T1_tool_call_ends_the_reasoning_only_when_asked():
    text = 'Paris.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert _joined(_streamed(ReasoningParser(True), [text])) == (text, "")  # free output: it is reasoning
    dropped = ReasoningParser(True, implicit_end="<tool_call>")
    assert _joined(_streamed(dropped, list(text))) == ("Paris.", text[len("Paris.<tool_call>"):])
    assert dropped.ended_by == "<tool_call>"
    kept = ReasoningParser(True, implicit_end="<tool_call>", keep_implicit_end=True)
    assert _joined(_streamed(kept, list(text))) == ("Paris.", text[len("Paris."):])


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_T1_reasoning_then_calls_through_the_hermes_parser(size):
    text = '<think>Paris.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    parser = OutputParser(ReasoningParser(implicit_end="<tool_call>", keep_implicit_end=True), HermesToolParser())
    pieces = [p for i in range(0, len(text), size) for p in parser.pieces(text[i:i + size])] + \
        parser.finish_pieces()
    assert split(pieces) == ("Paris.\n", "", [ToolCall("f", '{"a": 1}')])
    assert parser.calls == [ToolCall("f", '{"a": 1}')]


def test_enable_thinking_false_means_no_reasoning_parser():
    # the APIs give no ReasoningParser then (api.reasoning): `<think>` text is content as written
    assert parse_output(OutputParser(), "<think>x</think>y") == ["<think>x</think>y"]
    assert parse_output(OutputParser(ReasoningParser()), "<think>x</think>y") == [Reasoning("x"), "y"]


def _counted(parser, deltas: list[tuple[str, int]]) -> list[int]:
    """`parser.reasoning_tokens` after each (text, tokens) delta, then after `finish()`."""
    counts = []
    for text, num_tokens in deltas:
        parser.feed(text, num_tokens)
        counts.append(parser.reasoning_tokens)
    parser.finish()
    return counts + [parser.reasoning_tokens]


def test_reasoning_tokens_one_token_a_delta():
    text = "<think>ab</think>cd"
    counts = _counted(ReasoningParser(), [(ch, 1) for ch in text])
    # `<think>` is held until its `>` shows it is one (then its 7 tokens count), `ab` 2, `</think>` 8 (the `>`
    # that ends it included), the content none
    assert counts == [0] * 6 + [7, 8, 9] + list(range(10, 18)) + [17, 17] + [17]


def test_reasoning_tokens_a_delta_that_ends_the_reasoning_counts_whole():
    parser = ReasoningParser(starts_inside=True)
    assert _counted(parser, [("Hm", 2), ("m.</think>OK", 5), (" more", 3), ("", 1)]) == [2, 7, 7, 7, 7]
    assert parser.ended_by == "</think>"


def test_reasoning_tokens_of_think_split_over_deltas_count_once_decided():
    assert _counted(ReasoningParser(), [("<th", 2), ("ink>x", 2), ("</think>", 1), ("y", 1)]) == [0, 4, 5, 5, 5]
    # `<th` that becomes content: never reasoning
    assert _counted(ReasoningParser(), [("<th", 2), ("at", 1)]) == [0, 0, 0]
    # the output stops on a possible `<think>`: content, unless the prompt opened the reasoning
    assert _counted(ReasoningParser(), [("<thi", 3)]) == [0, 0]
    assert _counted(ReasoningParser(starts_inside=True), [("<thi", 3)]) == [0, 3]


def test_reasoning_tokens_no_reasoning_and_no_end_marker():
    assert _counted(ReasoningParser(), [("Hello", 3), (" there", 2), ("", 1)]) == [0, 0, 0, 0]
    # no end marker: everything is reasoning, the EOS delta (no text) included
    assert _counted(ReasoningParser(), [("<think>still ", 4), ("going", 1), ("", 1)]) == [4, 5, 6, 6]


def test_reasoning_tokens_deepseek_r1_starts_inside():
    deltas = [("Hm", 1), ("m", 1), ("</think>", 1), ("OK", 1), ("", 1)]
    assert _counted(ReasoningParser(starts_inside=True), deltas) == [1, 2, 3, 3, 3, 3]


def test_reasoning_tokens_T1_implicit_end():
    deltas = [("Paris.", 2), ("<tool_", 1), ("call>", 1), ('{"name"', 3)]
    parser = ReasoningParser(True, implicit_end="<tool_call>", keep_implicit_end=True)
    assert _counted(parser, deltas) == [2, 3, 4, 4, 4]


def test_output_parser_reasoning_tokens_whole_equals_streamed():
    text = "<think>Paris.\n<tool_call>\n" + '{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    deltas = [(text[i:i + 3], 1) for i in range(0, len(text), 3)]

    def parser():
        return OutputParser(ReasoningParser(implicit_end="<tool_call>", keep_implicit_end=True), HermesToolParser())

    streamed = parser()
    pieces = [p for delta, n in deltas for p in streamed.pieces(delta, n)] + streamed.finish_pieces()
    whole = parser()
    assert split(parse_deltas(whole, deltas)) == split(pieces) == ("Paris.\n", "", [ToolCall("f", '{"a": 1}')])
    # `<think>Paris.\n<tool_call>` is 25 characters: 9 deltas of 3, the last one ending the reasoning
    assert whole.reasoning_tokens == streamed.reasoning_tokens == 9
    # without a reasoning parser, or without token counts (`parse_output`: the whole text, no counts)
    assert OutputParser(tools=HermesToolParser()).reasoning_tokens == 0
    counted = OutputParser(ReasoningParser())
    assert parse_output(counted, "<think>x</think>y") == [Reasoning("x"), "y"] and counted.reasoning_tokens == 0
