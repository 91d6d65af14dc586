"""The reasoning parser (`voltserve.parsers.reasoning`) and its composition with the Hermes tool-call parser
(`voltserve.parsers.output`): markers split over deltas, no end marker, DeepSeek-R1's output that starts inside the
reasoning, and case T1's implicit end."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from api.reasoning import marker_ids
from voltserve.parsers.hermes import HermesToolParser, ToolCall
from voltserve.parsers.output import OutputParser, Reasoning, parse_deltas, parse_output, split
from voltserve.parsers.reasoning import ReasoningParser
from voltserve.tokenizer import Tokenizer, _byte_decoder


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


def test_in_content_once_the_reasoning_is_over_or_never_began():
    parser = ReasoningParser()
    assert [(parser.feed(d), parser.in_content) for d in ["<th", "ink>x", "</think>", "y"]] == [
        (("", ""), False), (("x", ""), False), (("", ""), True), (("", "y"), True)]
    parser = ReasoningParser()
    assert (parser.feed("<thi"), parser.in_content) == (("", ""), False)  # may still open the reasoning
    assert (parser.feed("s"), parser.in_content) == (("", "<this"), True)
    assert OutputParser(None, HermesToolParser()).in_content
    assert not OutputParser(ReasoningParser(starts_inside=True)).in_content


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


def _counted(parser, deltas: list[tuple]) -> list[int]:
    """`parser.reasoning_tokens` after each (text, tokens[, token ids]) delta, then after `finish()`."""
    counts = []
    for text, num_tokens, *ids in deltas:
        parser.feed(text, num_tokens, *ids)
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


CLOSE, CALL, EOS = 90, 91, 2  # one-token `</think>` and `<tool_call>` (as Qwen3's), EOS
ONE_TOKEN = {"</think>": CLOSE, "<tool_call>": CALL}


def test_reasoning_tokens_exact_where_the_end_marker_is_one_token():
    # the delta "m.</think>OK" (m . </think> O K): its tokens before `</think>` and `</think>` count, not "OK"
    parser = ReasoningParser(starts_inside=True, marker_ids=ONE_TOKEN)
    deltas = [("Hm", 2, [10, 11]), ("m.</think>OK", 5, [11, 12, CLOSE, 13, 14]), (" more", 3, [15, 16, 17]),
              ("", 1, [EOS])]
    assert _counted(parser, deltas) == [2, 5, 5, 5, 5]
    # `<think>`, the reasoning and `</think>` in one delta with the answer (a spelled-out `<think>`: 7 tokens)
    ids = list(range(20, 27)) + [30, 31, CLOSE, 40, EOS]
    assert _counted(ReasoningParser(marker_ids=ONE_TOKEN), [("<think>ab</think>c", 12, ids)]) == [10, 10]
    # the whole output in one delta, from tokens grouped 1, 4 and 16 a delta: the same count
    ids = [30, 31, CLOSE] + [40] * 30 + [EOS]
    texts = ["a", "b", "</think>"] + ["c"] * 30 + [""]
    for size in (1, 4, 16):
        deltas = [("".join(texts[i:i + size]), len(ids[i:i + size]), ids[i:i + size]) for i in range(0, 34, size)]
        assert _counted(ReasoningParser(True, marker_ids=ONE_TOKEN), deltas)[-1] == 3


def test_reasoning_tokens_held_back_before_the_ids_count():
    # "é" is two tokens: the first (no text) was held back, so the delta brings 4 tokens and the ids of 3
    parser = ReasoningParser(starts_inside=True, marker_ids=ONE_TOKEN)
    assert _counted(parser, [("é</think>b", 4, [0xA9, CLOSE, 50])]) == [3, 3]
    # and so do the tokens held as a possible `<think>` in earlier deltas (here: reasoning, the prompt opened it)
    parser = ReasoningParser(starts_inside=True, marker_ids=ONE_TOKEN)
    assert _counted(parser, [("<th", 2, [60, 61]), ("at</think>b", 4, [62, CLOSE, 50, EOS])]) == [0, 4, 4]


def test_reasoning_tokens_the_implicit_end_is_not_reasoning():
    parser = ReasoningParser(True, implicit_end="<tool_call>", keep_implicit_end=True, marker_ids=ONE_TOKEN)
    deltas = [("Paris.", 2, [10, 11]), ('\n<tool_call>{"na', 4, [12, CALL, 13, 14])]
    assert _counted(parser, deltas) == [2, 3, 3]


@pytest.mark.parametrize("marker_ids", [ONE_TOKEN, {}])
def test_reasoning_tokens_an_output_that_opens_with_the_implicit_end_counts_0(marker_ids):
    def parser():
        return ReasoningParser(True, implicit_end="<tool_call>", keep_implicit_end=True, marker_ids=marker_ids)

    assert _counted(parser(), [('<tool_call>\n{"name"', 9, [CALL] + list(range(8))), ("}", 1, [9])]) == [0, 0, 0]
    # spelled out over deltas (or a tokenizer without the one token): its tokens counted so far are dropped
    deltas = [("<", 1, [70]), ("tool_", 5, [71] * 5), ('call>{"', 7, [72] * 7), ("", 1, [EOS])]
    assert _counted(parser(), deltas) == [0, 6, 0, 0, 0]
    # `</think>` at once is the reasoning's markup: its token counts
    assert _counted(ReasoningParser(True, marker_ids=marker_ids), [("</think>", 1, [CLOSE])]) == [1, 1]


def test_reasoning_tokens_fall_back_to_the_whole_delta():
    # no one-token marker, no ids, or `</think>` spelled in pieces: the delta that ends the reasoning counts whole
    deltas = [("Hm", 2, [10, 11]), ("m.</think>OK", 5, [11, 12, CLOSE, 13, 14])]
    assert _counted(ReasoningParser(starts_inside=True), deltas) == [2, 7, 7]
    assert _counted(ReasoningParser(True, marker_ids=ONE_TOKEN), [("Hm", 2), ("m.</think>OK", 5)]) == [2, 7, 7]
    spelled = [("m.</think>OK", 12, [11, 12] + list(range(70, 78)) + [13, 14])]
    assert _counted(ReasoningParser(True, marker_ids=ONE_TOKEN), spelled) == [12, 12]
    # the one token seen later in the delta is the content's, not the end of the reasoning: whole too
    spelled = [("a</think>b</think>", 11, [10] + list(range(70, 78)) + [13, CLOSE])]
    assert _counted(ReasoningParser(True, marker_ids=ONE_TOKEN), spelled) == [11, 11]
    # the marker began in a delta before (held `</th`): its one token in this delta is the content's
    split_marker = [("a</th", 5, [10, 70, 71, 72, 73]), ("ink>b</think>", 7, [74, 75, 76, 77, 13, CLOSE, EOS])]
    assert _counted(ReasoningParser(True, marker_ids=ONE_TOKEN), split_marker) == [5, 12, 12]


def test_output_parser_and_parse_deltas_pass_the_ids():
    text, ids = "<think>ab</think>c", list(range(20, 27)) + [30, 31, CLOSE, 40, EOS]

    def parser():
        return OutputParser(ReasoningParser(marker_ids=ONE_TOKEN))

    # one delta, or a token each (the ids sliced from the output's by each delta's end)
    whole = parser()
    assert parse_deltas(whole, [(text, 12, 12)], ids) == [Reasoning("ab"), "c"] and whole.reasoning_tokens == 10
    texts = list("<think>ab") + ["</think>", "c", ""]
    one_each = parser()
    assert parse_deltas(one_each, [(t, 1, k + 1) for k, t in enumerate(texts)], ids) == [Reasoning("ab"), "c"]
    assert one_each.reasoning_tokens == 10
    streamed = parser()
    assert streamed.feed(text, 12, ids) == ("ab", "c", []) and streamed.reasoning_tokens == 10


def test_marker_ids_of_the_served_tokenizer():
    alphabet = sorted(_byte_decoder(), key=_byte_decoder().get)
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    plain = Tokenizer(tokenizers.Tokenizer.from_str(backend.to_str()), None, [])
    assert marker_ids(plain) == {} and marker_ids(None) == {}  # bytes only: the markers are several tokens
    # Qwen3's: `</think>` an added token that is not special, `<tool_call>` (special in some models)
    backend.add_tokens([AddedToken("</think>", special=False)])
    backend.add_special_tokens([AddedToken("<tool_call>", special=True)])
    tok = Tokenizer(backend, None, [])
    assert marker_ids(tok) == {"</think>": 256, "<tool_call>": 257}
    assert marker_ids(tok) is marker_ids(tok)  # found once
