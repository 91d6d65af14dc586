"""Grammar-constrained decoding with llguidance (https://github.com/guidance-ai/llguidance): the grammars the APIs
ask for (a JSON schema, forced tool calls in the Hermes format) and the per-sequence matcher that masks the
tokens a grammar does not allow.

A request carries its grammar as text (`SamplingParams.grammar`, what `llguidance.LLMatcher.grammar_from_*` and
`grammar_from` return), so it crosses to the engine process as a plain string; the engine builds one
`GrammarState` per sequence. Sequences with a grammar are sampled on the host (`voltserve.sampling.sample` with
the row's mask): their next mask needs the token just sampled.
"""

from __future__ import annotations

import copy
import json
from typing import Any

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


def check(tokenizer, grammar: str, param: str) -> None:
    """Raise InvalidRequestError (param `param`) when `grammar` does not compile for `tokenizer`: a 400 before
    the request is queued, rather than a sequence that cannot start."""
    error = _llguidance().LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    if error:
        raise InvalidRequestError(f"the grammar this request asks for does not compile: {error}", param=param)


def json_schema_grammar(schema: dict | None) -> str:
    """A grammar for one JSON value of `schema` (None or {} = any JSON object), e.g. a JSON response_format.

    Raises:
        InvalidRequestError: the schema is not one llguidance takes (param None: the caller names it).
    """
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(schema or {"type": "object"}, defaults=_COMPACT)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"the JSON schema is not supported: {exc}") from exc


# JSON as `json.dumps` writes it (", " and ": "), not free whitespace: a small model otherwise spends its tokens
# on line breaks and indents (llguidance's JSON compile options, which a schema's own "x-guidance" overrides)
_COMPACT = {"whitespace_flexible": False}


def _arguments_schema(parameters: dict | None) -> tuple[dict, dict]:
    """(the arguments' schema, the definitions it refers to, moved out for the call's root): a tool without
    parameters takes exactly `{}` (case T4); `$defs` / `definitions` go to the root of the schema the call is
    checked against, where `#/$defs/...` references resolve (case T11)."""
    if not parameters or parameters == {"type": "object"} and "properties" not in parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}, {}
    parameters = copy.deepcopy(parameters)
    defs = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return parameters, defs


def _call_schema(name: str, parameters: dict | None) -> dict:
    arguments, defs = _arguments_schema(parameters)
    schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
              "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _COMPACT}
    schema.update(defs)
    return schema


def tool_calls_grammar(tools: list[dict], max_calls: int | None = None, json_answer: dict | None = None) -> str:
    """A grammar for Hermes-format tool calls (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, as
    `voltserve.parsers.hermes` reads them), each naming one of `tools` with arguments of its schema.

    Args:
        tools: `{"name", "parameters"}` dicts (Chat Completions' `function` objects) the calls may name.
        max_calls: 1 = exactly one call (parallel_tool_calls false, case T2); None = one or more.
        json_answer: a JSON schema the output may match instead of calling tools (tools with a JSON
            response_format and tool_choice auto, case T5); None = calls only.

    Raises:
        InvalidRequestError: no tools, or a tool's schema llguidance does not take.
    """
    if not tools:
        raise InvalidRequestError("a forced tool call needs at least one tool", param="tools")
    rules = []
    for k, tool in enumerate(tools):
        schema = json.dumps(_call_schema(tool["name"], tool.get("parameters")))
        rules.append(f'call_{k}: "<tool_call>\\n" %json {schema} "\\n</tool_call>"')
    calls = "call" if max_calls == 1 else 'call ("\\n" call)*'
    if json_answer is None:
        start = f"start: {calls}"
    else:
        start = f"start: {calls} | %json {json.dumps({'x-guidance': _COMPACT, **(json_answer or {'type': 'object'})})}"
    lark = "\n".join([start, "call: " + " | ".join(f"call_{k}" for k in range(len(tools))), *rules])
    return _llguidance().grammar_from("lark", lark)


class GrammarState:
    """One sequence's position in its grammar.

    Args:
        tokenizer: the engine's tokenizer (`ll_tokenizer`).
        grammar: the request's grammar text.

    Attributes:
        done: the grammar is complete and allows no further token (the sequence then ends).
    """

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        self._matcher = llg.LLMatcher(ll_tokenizer(tokenizer), grammar)
        if self._matcher.is_error():
            raise InvalidRequestError(f"the grammar does not compile: {self._matcher.get_error()}")
        self._bits = torch.arange(32, dtype=torch.int32)

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
        return self._matcher.is_stopped() or self._matcher.is_error()
