"""Grammars behind reasoning (case T1 of ../shared/cases/api-behaviour.md): free reasoning text ended by `</think>`
or by `<tool_call>` (which then opens the first call), then the constrained answer; walked on the test byte
tokenizer and on the default model's tokenizer."""

from __future__ import annotations

import pytest

from tests.unit.test_grammar_rules import NOW, WEATHER, call, complete, walk
from voltserve import grammar

ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
PARIS = call("get_weather", '{"city":"Paris"}')


def test_T1_calls_after_reasoning_ended_by_think_or_by_tool_call():
    g = grammar.tool_calls_grammar([WEATHER, NOW], reasoning="inside")
    assert complete("Let me see: a < b.</think>\n\n" + PARIS, g)
    assert complete("<think>Paris, then.\n" + PARIS, g)  # T1: the call's own `<tool_call>` ends the reasoning
    assert complete("hm" + PARIS + "\n" + call("now", "{}"), g)
    assert not walk("hm</think>\n\nSure!", g)[0]  # after the reasoning: calls only
    assert not walk("a</think>b</think>", g)[0]  # the first `</think>` ends it
    assert not complete("thinking forever", g)


def test_T1_one_call_behind_reasoning():
    g = grammar.tool_calls_grammar([WEATHER], max_calls=1, reasoning="inside")
    assert complete("ok" + PARIS, g) and complete("ok</think>" + PARIS, g)
    assert not walk("ok" + PARIS + "\n<", g)[0]


def test_T1_json_after_reasoning_ended_by_think_or_by_tool_call():
    g = grammar.json_schema_grammar(ANSWER, reasoning="inside")
    assert complete('Fine.</think>\n\n{"ok":true}', g)
    assert complete('Fine.<tool_call>{"ok":false}', g)  # the marker only ends the reasoning
    assert not walk('Fine.</think>{"ok":1', g)[0]


def test_open_reasoning_is_optional_and_opens_with_think():
    g = grammar.json_schema_grammar(ANSWER, reasoning="open")
    assert complete('{"ok":true}', g) and complete('<think>hm</think>\n{"ok":true}', g)
    assert not walk('hm</think>', g)[0]  # reasoning must open with `<think>` here
    g = grammar.tool_calls_grammar([NOW], json_answer=ANSWER, reasoning="open")  # T5's union behind reasoning
    assert complete('<think>x</think>{"ok":true}', g) and complete("<think>x" + call("now", "{}"), g)
    assert not walk('<think>x<tool_call>{"ok"', g)[0]  # `<tool_call>` that ends reasoning opens a call


def _complete_on(tokenizer, text: str, grammar_text: str) -> bool:
    """`text`, tokenized by `tokenizer` as the model would write it, is a whole output of the grammar."""
    state = grammar.GrammarState(tokenizer, grammar_text)
    vocab = tokenizer.vocab_size
    for token in tokenizer.encode(text, add_special_tokens=False, parse_special=False):
        if not state.allowed(vocab)[token]:
            return False
        state.accept(token)
    return state.done or any(bool(state.allowed(vocab)[e]) for e in tokenizer.eos_token_ids)


@pytest.mark.parametrize("text, ok", [
    ("The user wants Paris.</think>\n\n" + PARIS, True),
    ("The user wants Paris.\n" + PARIS, True),  # T1
    ("The user wants Paris.</think>\n\nSure, " + PARIS, False),
])
def test_T1_grammar_on_the_default_models_tokenizer(smollm2_tokenizer, text, ok):
    g = grammar.tool_calls_grammar([WEATHER], reasoning="inside")
    grammar.check(smollm2_tokenizer, g, "tool_choice")
    assert _complete_on(smollm2_tokenizer, text, g) is ok


def test_T1_json_grammar_on_the_default_models_tokenizer(smollm2_tokenizer):
    g = grammar.json_schema_grammar(ANSWER, reasoning="inside")
    assert _complete_on(smollm2_tokenizer, 'Easy.</think>\n\n{"ok":true}', g)
    assert _complete_on(smollm2_tokenizer, 'Easy.<tool_call>{"ok":true}', g)
    assert not _complete_on(smollm2_tokenizer, 'Easy.</think>\n\nYes', g)
