"""The reasoning parser (`voltserve.parsers.reasoning`) and its composition with the Hermes tool-call parser
(`voltserve.parsers.output`): markers split over deltas, no end marker, DeepSeek-R1's output that starts inside the
reasoning, and case T1's implicit end."""

from __future__ import annotations

import pytest

from voltserve.parsers.hermes import HermesToolParser, ToolCall
from voltserve.parsers.output import OutputParser, Reasoning, parse_output, split
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
