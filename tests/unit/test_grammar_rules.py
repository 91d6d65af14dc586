"""The grammars of `voltserve.grammar` walked token by token on the test byte tokenizer (one byte a token):
which texts they accept, for cases T2, T4, T5 and T11 of ../shared/cases/api-behaviour.md and JSON output."""

from __future__ import annotations

import json

import pytest

from tests.api.fake_engine import EOS_ID, ByteTokenizer
from voltserve import grammar
from voltserve.errors import InvalidRequestError

TOK = ByteTokenizer()
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}}
NOW = {"name": "now"}


def walk(text: str, grammar_text: str) -> tuple[bool, grammar.GrammarState]:
    """(every token of `text` was allowed in turn, the state after it)."""
    state = grammar.GrammarState(TOK, grammar_text)
    for token in TOK.encode(text, parse_special=False):
        if not state.allowed(TOK.vocab_size)[token]:
            return False, state
        state.accept(token)
    return True, state


def complete(text: str, grammar_text: str) -> bool:
    """`text` is a whole output of the grammar: every token allowed, then EOS (or nothing more)."""
    ok, state = walk(text, grammar_text)
    return ok and (state.done or bool(state.allowed(TOK.vocab_size)[EOS_ID]))


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name":"{name}","arguments":{arguments}}}\n</tool_call>'


def test_json_schema_output_is_compact_json_of_the_schema():
    g = grammar.json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                     "required": ["a"], "additionalProperties": False})
    assert complete('{"a":12}', g)
    assert not walk('{"a":"x"', g)[0] and not walk('{"b"', g)[0] and not walk("{\n", g)[0]
    assert complete('{"k":[1,{"x":null}]}', grammar.json_schema_grammar(None))  # json_object: any object
    assert not walk("[", grammar.json_schema_grammar(None))[0]


def test_forced_calls_name_a_tool_with_its_arguments():
    g = grammar.tool_calls_grammar([WEATHER, NOW])
    assert complete(call("get_weather", '{"city":"Paris"}'), g)
    assert complete(call("now", "{}") + "\n" + call("get_weather", '{"city":"Rome"}'), g)  # parallel calls
    assert not walk(call("get_time", "{}"), g)[0]  # not a tool
    assert not walk(call("get_weather", '{"town":"Paris"}'), g)[0]  # not its schema
    assert not walk("Sure! " + call("now", "{}"), g)[0]  # calls only
    assert not complete(call("now", "{}")[:-3], g)  # a call cut short does not end the output


def test_T2_one_call_when_not_parallel():
    g = grammar.tool_calls_grammar([WEATHER, NOW], max_calls=1)
    ok, state = walk(call("now", "{}"), g)
    assert ok and (state.done or not state.allowed(TOK.vocab_size)[TOK.encode("\n")[0]])
    assert not walk(call("now", "{}") + "\n<tool_call>", g)[0]


def test_T4_a_tool_without_parameters_takes_an_empty_object():
    for tool in (NOW, {"name": "now", "parameters": {}}, {"name": "now", "parameters": {"type": "object"}}):
        g = grammar.tool_calls_grammar([tool], max_calls=1)
        assert complete(call("now", "{}"), g)
        assert not walk(call("now", '{"a"'), g)[0] and not walk(call("now", "[]"), g)[0]


def test_T5_tools_beside_a_json_format_allow_either():
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    g = grammar.tool_calls_grammar([WEATHER], json_answer=answer)
    assert complete(call("get_weather", '{"city":"Oslo"}'), g)
    assert complete('{"ok":true}', g)
    assert not walk("Hello", g)[0]


def test_T11_references_into_defs_are_honoured():
    tool = {"name": "f", "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
                                        "required": ["p"], "$defs": {"P": {"type": "integer"}}}}
    g = grammar.tool_calls_grammar([tool])
    assert complete(call("f", '{"p":3}'), g)
    assert not walk(call("f", '{"p":"3"'), g)[0]  # P is an integer, not a string


def test_T11_a_recursive_reference_stays_in_the_arguments():
    """`"$ref": "#"` is the arguments' own schema (each tool's arguments are a root of their own)."""
    tree = {"type": "object", "properties": {"v": {"type": "integer"},
                                             "kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["v"]}
    g = grammar.tool_calls_grammar([{"name": "tree", "parameters": tree}])
    assert complete(call("tree", '{"v":1,"kids":[{"v":2,"kids":[]}]}'), g)
    assert not walk(call("tree", '{"v":1,"kids":[{"name"'), g)[0]


ALIAS = {"$ref": "#/$defs/a"}


@pytest.mark.parametrize("schema, at", [
    ({"$ref": "#/$defs/a", "$defs": {"a": ALIAS}}, "#/$defs/a"),
    ({"$ref": "#"}, "#"),
    ({"allOf": [{"$ref": "#/$defs/b"}], "$defs": {"b": {"allOf": [{"type": "object"}, {"$ref": "#"}]}}}, "#"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a~1b"}, "a/b": {"description": "d", "$ref": "#/$defs/a"}}},
     "#/$defs/a"),
])
def test_a_schema_that_refers_to_itself_without_nesting_is_refused(schema, at):
    """No JSON value matches it: llguidance would compile a grammar that allows nothing (an empty output)."""
    message = f"the JSON schema at '{at}' refers to itself without nesting ($ref / allOf): no JSON value matches it"
    with pytest.raises(InvalidRequestError) as info:
        grammar.json_schema_grammar(schema)
    assert (info.value.message, info.value.param) == (message, None)
    with pytest.raises(InvalidRequestError) as info:
        grammar.tool_calls_grammar([{"name": "f", "parameters": schema}])
    assert (info.value.message, info.value.param) == (message, "tools")


def test_recursion_that_nests_or_has_a_way_out_is_kept():
    """A tree (through properties / items), an anyOf with a branch that ends, $defs shared by two properties,
    a `$ref` that is only data (in an enum), and loops the root does not enter on its own value: in an optional
    property, in an anyOf branch beside one that ends, in an unused `$defs` entry (left to llguidance, which
    treats the loop as unmatchable)."""
    loop = {"a": ALIAS}
    cases = [
        ({"type": "object", "properties": {"x": ALIAS}, "$defs": loop}, "{}"),
        ({"anyOf": [{"type": "integer"}, ALIAS], "$defs": loop}, "7"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "$defs": loop}, '{"a":"x"}'),
        ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}, '{"kids":[{}]}'),
        ({"anyOf": [{"$ref": "#"}, {"type": "integer"}]}, "7"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/s"}, "b": {"$ref": "#/$defs/s"}},
          "required": ["a", "b"], "$defs": {"s": {"type": "string"}}}, '{"a":"x","b":"y"}'),
        ({"enum": [{"$ref": "#"}]}, '{"$ref":"#"}'),
    ]
    for schema, text in cases:
        assert complete(text, grammar.json_schema_grammar(schema)), schema


def test_arguments_are_always_an_object():
    untyped = {"properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = grammar.tool_calls_grammar([{"name": "f", "parameters": untyped}])
    assert complete(call("f", '{"a":5}'), g) and not walk(call("f", "5"), g)[0]
    with pytest.raises(InvalidRequestError, match="""Invalid schema for function 'f': .* got 'type: "string"'"""):
        grammar.tool_calls_grammar([{"name": "f", "parameters": {"type": "string"}}])


def test_odd_tool_names_are_quoted_in_the_grammar():
    name = 'we"ird\\ {name} é %json'
    g = grammar.tool_calls_grammar([{"name": name}])
    grammar.check(TOK, g, "tools")
    quoted = json.dumps(name, ensure_ascii=False)
    assert complete('<tool_call>\n{"name":' + quoted + ',"arguments":{}}\n</tool_call>', g)


def test_check_refuses_what_does_not_compile():
    g = grammar.tool_calls_grammar([{"name": "f", "parameters": {"$ref": "#/$defs/Missing"}}])
    with pytest.raises(InvalidRequestError) as info:
        grammar.check(TOK, g, "tool_choice")
    assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError):
        grammar.tool_calls_grammar([])


HUGE_REGEX = {"type": "string", "pattern": "^a{1000000}$"}  # compiles; llguidance's lexer limit fails on it


def test_check_refuses_a_grammar_llguidance_fails_on_at_its_forced_start():
    """The forced `"` of a string schema runs the regex: a 400 at request time, not a truncated output."""
    with pytest.raises(InvalidRequestError) as info:
        grammar.check(TOK, grammar.json_schema_grammar(HUGE_REGEX), "response_format")
    assert (info.value.message, info.value.param) == (
        "invalid response_format: constrained decoding cannot follow the grammar it asks for: "
        "lexer error: too many expressions constructed", "response_format")


def test_a_failure_after_tokens_the_model_chose_is_an_error_not_done():
    """An optional property: nothing forces the output into it, so `check` passes, and decoding fails there."""
    g = grammar.json_schema_grammar({"type": "object", "properties": {"p": HUGE_REGEX}})
    grammar.check(TOK, g, "response_format")
    ok, state = walk('{"p":"', g)
    assert not ok and state.error == "lexer error: too many expressions constructed" and not state.done
    assert state.allowed(TOK.vocab_size).nonzero().flatten().tolist() == [EOS_ID]  # it can only end now
    state.accept(EOS_ID)
    assert state.error is not None and not state.done


def test_schema_error_says_why_one_schema_cannot_constrain_an_output():
    """What `api.structured` tells a failing grammar's schemas apart with: each schema alone, llguidance's reason
    (a tool's parameters held as its arguments: an object, `{"p":"` forced by the required key)."""
    cannot_follow = "constrained decoding cannot follow the grammar it asks for: "
    assert grammar.schema_error(TOK, {"type": "object"}) is None
    assert grammar.schema_error(TOK, None, function="f") is None
    assert grammar.schema_error(TOK, {"$ref": "#/$defs/Missing"}) == \
        "the JSON schema does not compile: Pointer '/$defs/Missing' does not exist"
    assert grammar.schema_error(TOK, {"$ref": "#"}) == \
        "the JSON schema at '#' refers to itself without nesting ($ref / allOf): no JSON value matches it"
    assert grammar.schema_error(TOK, HUGE_REGEX) == cannot_follow + "lexer error: too many expressions constructed"
    assert grammar.schema_error(TOK, {"properties": {"p": HUGE_REGEX}, "required": ["p"]}, function="f") == \
        cannot_follow + "lexer error: too many expressions constructed"


def test_grammar_error_keeps_the_first_line_of_a_lark_compile_error():
    """A Lark grammar's compile error goes on with the grammar's text, which a client's message must not carry."""
    g = grammar.tool_calls_grammar([{"name": "f", "parameters": {"$ref": "#/$defs/Missing"}}])
    assert grammar.grammar_error(TOK, g) == \
        "the grammar does not compile: at 2(9): failed to compile JSON schema: Pointer '/$defs/Missing' does not exist"
    assert grammar.grammar_error(TOK, grammar.tool_calls_grammar([{"name": "f"}])) is None
