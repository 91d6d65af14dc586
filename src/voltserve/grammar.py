"""Grammar-constrained decoding with llguidance (https://github.com/guidance-ai/llguidance): the grammars the APIs
ask for (a JSON schema, forced tool calls in the Hermes format) and the per-sequence matcher that masks the
tokens a grammar does not allow.

A request carries its grammar as text (`SamplingParams.grammar`, what `llguidance.LLMatcher.grammar_from_*` and
`grammar_from` return), so it crosses to the engine process as a plain string; the engine builds one
`GrammarState` per sequence. Sequences with a grammar are sampled on the host (`voltserve.sampling.sample` with
the row's mask): their next mask needs the token just sampled.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

import torch

from voltserve.errors import InvalidRequestError


def _llguidance():
    import llguidance  # a dependency; imported on first use (startup time)

    return llguidance


def ll_tokenizer(tokenizer) -> Any:
    """The tokenizer's `llguidance.LLTokenizer`, built once and cached on it (~0.2 s for a 49k vocabulary).

    Args:
        tokenizer: a `voltserve.tokenizer.Tokenizer`, or any object with an `ll_tokenizer()` method (test doubles).
    """
    own = getattr(tokenizer, "ll_tokenizer", None)
    if own is not None:
        return own()
    cached = getattr(tokenizer, "_ll_tokenizer", None)
    if cached is None:
        cached = _llguidance().LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                            eos_token=list(tokenizer.eos_token_ids))
        tokenizer._ll_tokenizer = cached
    return cached


def _matcher(tokenizer, grammar: str):
    """A new `llguidance.LLMatcher` of `grammar` for an `ll_tokenizer`: silent (its errors reach our logs through
    the callers, not as bare "Warning:" lines on stderr) and with short errors (no parser-state dump, which would
    reach the client's error message)."""
    llguidance = _llguidance()
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                limits=llguidance.LLParserLimits(verbose_errors=False))


def _error_text(matcher) -> str:
    return matcher.get_error().replace("\n<non-verbose/>", "").strip()


def _problem(tokenizer, grammar: str) -> tuple[str, str] | None:
    """Why `grammar` cannot be served for an `ll_tokenizer`: ("compile", llguidance's error) when it does not
    compile, ("start", its error) when decoding fails on the tokens every output starts with; None when it can."""
    matcher = _matcher(tokenizer, grammar)
    if matcher.is_error():
        return "compile", _error_text(matcher)
    # the tokens the grammar forces (a schema's `{"a":` of a required key, a named tool's call head) and the mask
    # after them: where llguidance's limits fail for the schemas that compile but cannot be decoded; failures
    # further in, after tokens the model chose, end the request at decode time (`GrammarState.error`)
    matcher.consume_tokens(matcher.compute_ff_tokens())
    matcher.compute_bitmask()
    if matcher.is_error():
        return "start", _error_text(matcher)
    return None


_CANNOT_FOLLOW = "constrained decoding cannot follow the grammar it asks for"


def grammar_error(tokenizer, grammar: str, param: str | None = None) -> str | None:
    """Why `grammar` cannot be served for `tokenizer`, for a message ("the grammar does not compile: ...",
    "constrained decoding cannot follow the grammar it asks for: ..."; llguidance's error, its first line only:
    a Lark grammar's compile error goes on with the grammar's text); None when it can. Compiles the grammar and
    walks its forced start (~0.3 ms for a small schema, ~60 ms for 300 tools, ~150 ms for a regex `a{1000000}`):
    call it off the event loop.

    Raises:
        InvalidRequestError: (param `param`) the tokenizer takes no grammar.
    """
    try:
        tokenizer = ll_tokenizer(tokenizer)
    except Exception as exc:  # llguidance cannot read this tokenizer: no grammar can be served for it
        raise InvalidRequestError(f"grammars are not available for this model's tokenizer: {exc}",
                                  param=param) from exc
    problem = _problem(tokenizer, grammar)
    if problem is None:
        return None
    stage, error = problem
    error = error.split("\n", 1)[0]
    return f"the grammar does not compile: {error}" if stage == "compile" else f"{_CANNOT_FOLLOW}: {error}"


def check(tokenizer, grammar: str, param: str) -> None:
    """Refuse `grammar` when it does not compile for `tokenizer`, or when llguidance fails on the tokens every
    output starts with (`grammar_error`): a 400 before the request is queued, rather than a sequence that cannot
    start or one cut short mid-output. Call it off the event loop.

    Args:
        tokenizer: the served tokenizer (`ll_tokenizer`).
        grammar: the request's grammar text.
        param: the request field the errors name.

    Raises:
        InvalidRequestError: (param `param`) the tokenizer takes no grammar, the grammar does not compile, or
            decoding it fails on its forced start (a resource limit of llguidance: e.g. a required property that
            refers to its own schema, `{"a": {"a": ...}}` forever; a regex such as `a{1000000}`).
    """
    error = grammar_error(tokenizer, grammar, param)
    if error is not None:
        raise InvalidRequestError(f"invalid {param}: {error}", param=param)


def schema_error(tokenizer, schema: dict | None, function: str | None = None) -> str | None:
    """Why the JSON schema `schema` cannot constrain an output on its own, for a message ("the JSON schema does
    not compile: ...", "constrained decoding cannot follow the grammar it asks for: ...", or why it is refused
    before compiling, e.g. a schema that refers to itself without nesting); None when it can. What tells which of
    the schemas of a grammar that fails is at fault (`api.structured`); call it off the event loop.

    Args:
        tokenizer: the served tokenizer (it takes grammars: `grammar_error` or `check` passed it).
        schema: a JSON schema (None or {} = any JSON object), e.g. a JSON response_format's.
        function: `schema` is the parameters of the tool of that name: held as its calls' arguments are (an
            object's schema; `{}` without properties, case T4).
    """
    try:
        if function is not None:
            schema = _arguments_schema(function, schema)
        else:
            schema = _with_options(schema or {"type": "object"})
        text = _llguidance().LLMatcher.grammar_from_json_schema(schema)
    except InvalidRequestError as exc:
        return exc.message
    except (ValueError, TypeError) as exc:
        return f"the JSON schema is not supported: {exc}"
    problem = _problem(ll_tokenizer(tokenizer), text)
    if problem is None:
        return None
    stage, error = problem
    return f"the JSON schema does not compile: {error}" if stage == "compile" else f"{_CANNOT_FOLLOW}: {error}"


# JSON without free whitespace (`{"a":1}`): a small model otherwise spends its tokens on line breaks and indents;
# lenient: keywords llguidance does not implement (uniqueItems, not, if / then, ...) go unenforced rather than
# refused (llguidance's JSON compile options; a schema's own "x-guidance" overrides them)
_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": True}


def _with_options(schema: dict, param: str | None = None) -> dict:
    """`schema` with the JSON options, once `_check_recursion` passed it (its errors blame `param`)."""
    _check_recursion(schema, param)
    return {**schema, "x-guidance": {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}}


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are JSON data, not schemas


def _resolve(root: dict, ref: str) -> dict | None:
    """The subschema a local `$ref` ("#" or a JSON pointer "#/...") names; None for any other or a dangling one
    (llguidance reports those itself)."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: Any = root
    for token in ref[2:].split("/") if ref != "#" else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node if isinstance(node, dict) else None


def _check_recursion(schema: dict, param: str | None) -> None:
    """Refuse a schema whose root refers to itself without nesting: a cycle of `$ref` / `allOf` that the root
    enters while staying on its own JSON value. No value matches it (llguidance compiles it to a grammar that
    allows nothing, so the output would be empty); JSON Schema leaves such schemas undefined (2020-12 core,
    section 9.4.1). Recursion through properties or items (a tree) nests and is fine; a cycle the root reaches
    only through a property, an item or an `anyOf` branch is left to llguidance, which treats that branch as
    unmatchable (other branches, optional properties, unused `$defs` keep the schema satisfiable).

    Raises:
        InvalidRequestError: such a cycle (param `param`).
    """
    nodes, stack = [], [("#", schema)]  # every subschema with its JSON pointer, in document order
    while stack:
        pointer, node = stack.pop()
        if isinstance(node, dict):
            nodes.append((pointer, node))
            stack += reversed([(f"{pointer}/{k.replace('~', '~0').replace('/', '~1')}", v)
                               for k, v in node.items() if k not in _DATA_KEYWORDS])
        elif isinstance(node, list):
            stack += reversed([(f"{pointer}/{i}", v) for i, v in enumerate(node)])

    pointers = {id(node): pointer for pointer, node in nodes}

    def same_value(node: dict) -> list[dict]:  # the subschemas `node` applies to its own value, all of them
        ref = node.get("$ref")
        target = _resolve(schema, ref) if isinstance(ref, str) else None
        parts = node.get("allOf") if isinstance(node.get("allOf"), list) else []
        return [n for n in ([target] + parts) if id(n) in pointers]  # a `$ref` into data names no schema

    # depth-first search from the root over the same-value edges; `path` holds the open nodes
    done: set[int] = set()
    path, walk = {id(schema)}, [(schema, iter(same_value(schema)))]
    while walk:
        node, children = walk[-1]
        child = next(children, None)
        if child is None:
            walk.pop()
            path.discard(id(node))
            done.add(id(node))
        elif id(child) in path:
            raise InvalidRequestError(f"the JSON schema at '{pointers[id(child)]}' refers to itself without "
                                      "nesting ($ref / allOf): no JSON value matches it", param=param)
        elif id(child) not in done:
            path.add(id(child))
            walk.append((child, iter(same_value(child))))


_EMPTY_OBJECT = {"type": "object", "properties": {}, "additionalProperties": False}


def check_parameters(name: str, parameters: dict | None, param: str) -> None:
    """Refuse a tool's `parameters` schema of a type other than "object", as OpenAI does whatever the tool_choice
    (a call's arguments are always a JSON object). Absent, {} and a schema without `type` pass: the grammar makes
    the last an object's.

    Args:
        name: the tool's name, for the message.
        parameters: its JSON schema, or None when absent.
        param: the request field the error names (e.g. "tools.0.function.parameters").

    Raises:
        InvalidRequestError: `parameters` has a `type` other than "object" (a string, a list of types, ...).
    """
    kind = (parameters or {}).get("type", "object")
    if kind != "object":
        got = f'"{kind}"' if isinstance(kind, str) else json.dumps(kind, ensure_ascii=False)
        raise InvalidRequestError(f"Invalid schema for function '{name}': schema must be a JSON Schema of "
                                  f"'type: \"object\"', got 'type: {got}'.", param=param)


def _arguments_schema(name: str, parameters: dict | None) -> dict:
    """The schema a call's arguments are held to, as a root of its own (so its `$ref`s resolve in it, case T11).
    A tool without parameters (absent, {}, or an object schema with no properties, required or
    additionalProperties) takes exactly `{}` (case T4); any other schema without a type is made an object's.

    Raises:
        InvalidRequestError: parameters whose type is not "object" (`check_parameters`; the APIs check first,
            naming the tool's field).
    """
    check_parameters(name, parameters, param="tools")
    if not parameters or (set(parameters) <= {"type", "properties"} and not parameters.get("properties")):
        return _with_options(_EMPTY_OBJECT)
    return _with_options({**parameters, "type": "object"}, param="tools")


_CALL_OPEN, _CALL_END = "<tool_call>", "}\n</tool_call>"


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a quoted string with JSON's escapes, which Lark reads alike


def _json_rule(schema: dict | None) -> str:
    return "%json " + json.dumps(_with_options(schema or {"type": "object"}), ensure_ascii=False)


# Reasoning ahead of a constrained answer (case T1): free text up to the first `</think>`, or up to the first
# `<tool_call>` (an implicit end: the model opens a call without closing its reasoning). Lazy lexemes end at their
# first match; the negation keeps the other marker out, so whichever comes first ends the reasoning.
_NOT_CLOSE, _NOT_CALL = r"~/(?s:.*)<\/think>(?s:.*)/", r"~/(?s:.*)<tool_call>(?s:.*)/"
REASONING_MODES = ("inside", "open")


def _reasoning_rules(reasoning: str, has_calls: bool) -> tuple[str, list[str]]:
    """(the start alternatives, the rules) of reasoning ahead of `body` (a rule the caller defines).

    Args:
        reasoning: "inside" (the prompt opened `<think>`: the output starts in the reasoning, an explicit
            `<think>` allowed) or "open" (the output may open `<think>` first, or answer at once).
        has_calls: `body` may be tool calls: reasoning ended by `<tool_call>` goes on with that call's rest
            (`first_rest`, a rule the caller defines); else it goes on with `body`.
    """
    lead = "<think>" if reasoning == "open" else ""
    rules = [f"think_end[lazy]: /{lead}(?s:.*)<\\/think>/ & {_NOT_CALL}",
             f"think_call[lazy]: /{lead}(?s:.*)<tool_call>/ & {_NOT_CLOSE}",
             r"WS: /[ \t\r\n]*/"]
    start = "think_end WS body | think_call " + ("first_rest" if has_calls else "WS body")
    return (start + " | body" if reasoning == "open" else start), rules


def _grammar(body: str, rules: list[str], reasoning: str | None, has_calls: bool = False) -> str:
    """The llguidance grammar of a Lark `body` expression with its `rules`, behind reasoning when asked."""
    if reasoning is None:
        return _llguidance().grammar_from("lark", "\n".join([f"start: {body}", *rules]))
    start, think = _reasoning_rules(reasoning, has_calls)
    return _llguidance().grammar_from("lark", "\n".join([f"start: {start}", f"body: {body}", *rules, *think]))


def json_schema_grammar(schema: dict | None, reasoning: str | None = None) -> str:
    """A grammar for one JSON value of `schema` (None or {} = any JSON object), e.g. a JSON response_format.

    Args:
        reasoning: None, or the reasoning the answer follows (`REASONING_MODES`; case T1: ended by `</think>`
            or by `<tool_call>`, which the reasoning parser then drops).

    Raises:
        InvalidRequestError: the schema is not one llguidance takes (param None: the caller names it).
    """
    try:
        if reasoning is None:
            return _llguidance().LLMatcher.grammar_from_json_schema(_with_options(schema or {"type": "object"}))
        return _grammar(_json_rule(schema), [], reasoning)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"the JSON schema is not supported: {exc}") from exc


def tool_calls_grammar(tools: list[dict], max_calls: int | None = None, json_answer: dict | None = None,
                       reasoning: str | None = None) -> str:
    """A grammar for Hermes-format tool calls (`<tool_call>\n{"name":...,"arguments":{...}}\n</tool_call>`, as
    `voltserve.parsers.hermes` reads them), each naming one of `tools` with arguments of its schema.

    Args:
        tools: `{"name", "parameters"}` dicts (Chat Completions' `function` objects) the calls may name.
        max_calls: 1 = exactly one call (a named tool, or parallel_tool_calls false: case T2); None = one or
            more, the model ending the list.
        json_answer: a JSON schema the output may match instead of calling tools (tools with a JSON
            response_format and tool_choice auto, case T5); None = calls only.
        reasoning: None, or the reasoning the calls follow (`REASONING_MODES`); a `<tool_call>` that ends it
            opens the first call (case T1).

    Raises:
        InvalidRequestError: no tools, or a tool whose parameters are not an object schema.
    """
    if not tools:
        raise InvalidRequestError("a forced tool call needs at least one tool", param="tools")
    rules = []
    for k, tool in enumerate(tools):
        head = '\n{"name":' + json.dumps(tool["name"], ensure_ascii=False) + ',"arguments":'
        arguments = json.dumps(_arguments_schema(tool["name"], tool.get("parameters")), ensure_ascii=False)
        rules.append(f"rest_{k}: {_lark_literal(head)} %json {arguments} {_lark_literal(_CALL_END)}")
    more = "" if max_calls == 1 else ' ("\\n" call)*'
    body = "call" + more
    if json_answer is not None:
        body += f" | {_json_rule(json_answer)}"
    rules += [f"call: {_lark_literal(_CALL_OPEN)} rest", f"first_rest: rest{more}",
              "rest: " + " | ".join(f"rest_{k}" for k in range(len(tools)))]
    return _grammar(body, rules, reasoning, has_calls=True)


class GrammarState:
    """One sequence's position in its grammar.

    Args:
        tokenizer: the engine's tokenizer (`ll_tokenizer`).
        grammar: the request's grammar text.

    Attributes:
        done: the grammar is complete and allows no further token (the sequence then ends).
        error: None, or llguidance's error once it failed (a resource limit hit mid-output, e.g. "lexer error: too
            many expressions constructed"): the grammar then allows only EOS, and the sequence must fail, not stop.
    """

    def __init__(self, tokenizer, grammar: str, matcher=None):
        self._matcher = matcher if matcher is not None else _matcher(ll_tokenizer(tokenizer), grammar)
        if self._matcher.is_error():
            raise InvalidRequestError(f"the grammar does not compile: {_error_text(self._matcher)}")
        self._bits = torch.arange(32, dtype=torch.int32)

    @classmethod
    def for_sequences(cls, tokenizer, grammar: str, n: int) -> list["GrammarState"]:
        """One state for each of a request's `n` sequences: compiled once, copied (~15 us) for the others.

        Raises:
            InvalidRequestError: the grammar does not compile.
        """
        first = cls(tokenizer, grammar)
        return [first] + [cls(tokenizer, grammar, first._matcher.deep_copy()) for _ in range(n - 1)]

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar allows next (ids past the tokenizer's vocabulary, e.g. a
        padded lm_head, never)."""
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        mask = ((words.unsqueeze(-1) >> self._bits) & 1).bool().flatten()
        if mask.numel() >= vocab_size:
            return mask[:vocab_size]
        return torch.cat([mask, torch.zeros(vocab_size - mask.numel(), dtype=torch.bool)])

    def accept(self, token: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped() and not self._matcher.is_error()  # stopped is true on errors too

    @property
    def error(self) -> str | None:
        return _error_text(self._matcher) if self._matcher.is_error() else None
