"""The grammar a request's forced tool choice or JSON output format asks for, for every API
(`voltserve.grammar`: llguidance). The APIs map their own fields onto `Constraint` and read the output back with
the Hermes parser, which is what a forced-call grammar writes whatever the model's own format.

Cases of ../shared/cases/api-behaviour.md: T2 (one call when not parallel), T4 (a tool without parameters gets
`{}`), T5 (tools + a JSON format + auto: either), T11 ($ref), T13 (a forced call that does not parse), A1-A3.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from api.reasoning import marker_ids, output_parser_factory
from voltserve import grammar
from voltserve.errors import InvalidRequestError
from voltserve.parsers.hermes import HermesToolParser


@dataclass(frozen=True)
class Constraint:
    """What a request constrains, in the APIs' common terms.

    Attributes:
        functions: the request's tools as `{"name", "parameters"}` dicts (parameters may be absent).
        forced: None (the model chooses, or no tools), "any" (at least one call: "required" / Anthropic "any"),
            or a tool's name (that tool: a named tool_choice).
        parallel: more than one call allowed.
        json_schema: the output's JSON schema when the request asks for JSON ({} = any object), else None.
        tool_param / format_param: the request fields errors blame: the tool choice (no tools to force, a name no
            tool has), the JSON format (its schema).
        function_params: for each of `functions`, the request field of its schema (e.g.
            "tools.0.function.parameters"), which errors of that schema blame; "tools" for any not listed.
        field_first: error messages start with the field they blame ("tools.1.input_schema: ..."), as
            Anthropic's do (its error shape has no `param`); else OpenAI's wording ("Invalid schema for function
            'f': ...", "invalid response_format: ...").
        tools_parsed: the server parses tool calls of a free choice (`api.tool_calls.parser_factory` not None).
        reasoning: the reasoning the output starts with (`api.reasoning.reasoning_mode`: None, "inside" or
            "open"); a grammar lets it run free first (case T1).
    """

    functions: tuple[dict, ...] = ()
    forced: str | None = None
    parallel: bool = True
    json_schema: dict | None = None
    tool_param: str = "tool_choice"
    format_param: str = "response_format"
    function_params: tuple[str, ...] = ()
    field_first: bool = False
    tools_parsed: bool = False
    reasoning: str | None = None

    def function_param(self, i: int) -> str:
        """The request field of the schema of `functions[i]`."""
        return self.function_params[i] if i < len(self.function_params) else "tools"


async def request_grammar(tokenizer, c: Constraint) -> str | None:
    """The grammar of `c` (None when nothing is constrained), checked against `tokenizer` in a thread
    (llguidance compiles without the GIL: hundreds of tools take ~0.4 s, which the event loop must not wait).

    A forced choice wins over a JSON format (the output is then calls). A JSON format with tools the model may
    call (and a server that parses calls) allows either the calls or the JSON answer (case T5).

    Raises:
        InvalidRequestError: a forced call without tools or of a tool the request does not define (param
            `c.tool_param`); a grammar that does not compile (a schema llguidance does not take) or that
            llguidance fails on at the output's forced start (`voltserve.grammar.grammar_error`): param the field
            of the schema at fault (`c.format_param`, or the tool's in `c.function_params`).
    """
    if c.forced is None and c.json_schema is None:
        return None
    return await asyncio.to_thread(_checked_grammar, tokenizer, c)


def _checked_grammar(tokenizer, c: Constraint) -> str:
    if c.forced is not None and not c.functions:
        raise InvalidRequestError("tool_choice forces a call but the request gives no tools", param=c.tool_param)
    max_calls = 1 if not c.parallel or c.forced not in (None, "any") else None  # a named tool: one call
    tools = list(enumerate(c.functions)) if makes_calls(c) else []  # (index in the request, function)
    if c.forced not in (None, "any"):
        tools = [(i, f) for i, f in tools if f["name"] == c.forced]
        if not tools:
            raise InvalidRequestError(f"tool_choice names '{c.forced}', which is not one of the tools",
                                      param=c.tool_param)
    answer = c.json_schema if c.forced is None else None  # a forced choice: calls only
    try:
        if tools:
            text = grammar.tool_calls_grammar([f for _, f in tools], max_calls=max_calls, json_answer=answer,
                                              reasoning=c.reasoning)
        else:
            text = grammar.json_schema_grammar(answer, reasoning=c.reasoning)
    except InvalidRequestError as exc:  # a schema refused before compiling (one that refers to itself, ...)
        raise _schema_error(tokenizer, c, tools, answer, exc.message) from exc
    problem = grammar.grammar_error(tokenizer, text, c.tool_param if tools else c.format_param)
    if problem is not None:
        raise _schema_error(tokenizer, c, tools, answer, problem)
    return text


def _schema_error(tokenizer, c: Constraint, tools: list[tuple[int, dict]], answer: dict | None,
                  problem: str) -> InvalidRequestError:
    """The 400 of a grammar that cannot be served (`problem`: why), blaming the first of its schemas (the tools'
    in request order, then the JSON format's) that cannot constrain an output on its own; when each can, the
    grammar as a whole (its one schema, else the tools)."""
    suspects = [(c.function_param(i), f.get("parameters"), f["name"]) for i, f in tools]
    if answer is not None:
        suspects.append((c.format_param, answer, None))
    for param, schema, function in suspects:
        why = grammar.schema_error(tokenizer, schema, function)  # llguidance's words for that schema alone
        if why is not None:
            return _blame(c, param, function, why)
    if len(suspects) == 1:  # it fails only inside the grammar (behind the reasoning, ...): still its fault
        param, _, function = suspects[0]
        return _blame(c, param, function, problem)
    return _blame(c, "tools" if tools else c.format_param, None, problem)


def _blame(c: Constraint, param: str, function: str | None, why: str) -> InvalidRequestError:
    if c.field_first:
        return InvalidRequestError(f"{param}: {why}", param=param)
    if function is not None:
        return InvalidRequestError(f"Invalid schema for function '{function}': {why}", param=param)
    return InvalidRequestError(f"invalid {param}: {why}", param=param)


def makes_calls(c: Constraint) -> bool:
    """The grammar of `c` writes calls (forced, or T5's union of calls and a JSON answer)."""
    return c.forced is not None or (c.json_schema is not None and bool(c.functions) and c.tools_parsed)


def output_parser(c: Constraint, free_parser):
    """The tool-call parser of a request's output: Hermes when a grammar makes calls, else the server's own
    choice for free output (`free_parser`, None = plain content)."""
    return HermesToolParser if makes_calls(c) else free_parser


def sequence_parser(c: Constraint, free_parser, tokenizer=None):
    """A constructor of one sequence's `voltserve.parsers.output.OutputParser` (reasoning as `c.reasoning`
    says, then `output_parser`'s tool calls), or None when the output is plain content. `tokenizer`: the served
    one, whose one-token end markers make the reasoning's token count exact (`api.reasoning.marker_ids`)."""
    constrained = c.forced is not None or c.json_schema is not None
    ids = marker_ids(tokenizer) if c.reasoning is not None else None
    return output_parser_factory(c.reasoning, output_parser(c, free_parser), constrained, makes_calls(c), ids)


def forced_content(c: Constraint, content: str | None) -> str | None:
    """The content to return beside the calls: none when the grammar forced calls (anything else is a call the
    output did not finish, case A3 / T13), else the parsed content."""
    return None if c.forced is not None else content
