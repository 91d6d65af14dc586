"""POST /v1/chat/completions (https://platform.openai.com/docs/api-reference/chat/create)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import orjson
from quart import Blueprint

from api.metrics import NO_STATS
from api.openai.chat_prompt import chat_prompt_ids
from api.openai.common import (
    ChunkFrames, NewTokens, add_request, check_stream_options, check_top_logprobs, collect, drive_stream, finish_json,
    json_response, logprob_entries, request_body, sampling_params, sse_response,
)
from api.openai.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatLogprobs, CompletionTokensDetails, DeltaMessage, DeltaToolCall, FunctionCall,
    ToolCallOut, Usage, parse_request,
)
from api.state import get_state
from api.reasoning import reasoning_mode
from api.structured import Constraint, request_grammar, sequence_parser
from api.tool_calls import call_id, parser_factory
from voltserve.parsers.output import OutputParser, parse_deltas, split
from voltserve.errors import InvalidRequestError
from voltserve.grammar import check_parameters
from voltserve.request import SamplingParams, TokenLogprob

bp = Blueprint("openai_chat", __name__)


def _params(req: ChatCompletionRequest) -> SamplingParams:
    check_stream_options(req)
    top = req.top_logprobs
    check_top_logprobs(top)
    if top and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, name = req.max_tokens, "max_tokens"
    return sampling_params(req, max_tokens=max_tokens, max_tokens_param=name,
                           logprobs=(top or 0) if req.logprobs else None)


def _logprobs(tokenizer, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=logprob_entries(tokenizer, logprobs))


def _with_reasoning_tokens(usage: Usage, parsers: Iterable[OutputParser]) -> Usage:
    """`usage` with `completion_tokens_details.reasoning_tokens`: the reasoning's tokens summed over the choices'
    output parsers (for a request whose output a reasoning parser reads)."""
    details = CompletionTokensDetails(reasoning_tokens=sum(p.reasoning_tokens for p in parsers))
    return usage.model_copy(update={"completion_tokens_details": details})


def _functions(req: ChatCompletionRequest) -> tuple[dict, ...]:
    functions = []
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function" or tool.function is None:
            raise InvalidRequestError("a tool must be {'type': 'function', 'function': {'name': ..., "
                                      "'parameters': ...}}", param=f"tools.{i}")
        check_parameters(tool.function.name, tool.function.parameters, f"tools.{i}.function.parameters")
        functions.append(tool.function.model_dump(exclude_none=True))
    return tuple(functions)


def _json_schema(response_format: dict | None) -> dict | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequestError("response_format json_schema needs 'json_schema': {'name', 'schema'}",
                                      param="response_format.json_schema")
        return spec.get("schema") or {}
    raise InvalidRequestError(f"response_format type '{kind}' is not supported", param="response_format.type")


def constraint(req: ChatCompletionRequest, tools_parsed: bool) -> Constraint:
    """The request's tool_choice, parallel_tool_calls and response_format as a `Constraint`.

    Raises:
        InvalidRequestError: a malformed tool (parameters not an object schema too), tool_choice or
            response_format.
    """
    choice, forced = req.tool_choice, None
    if choice == "required":
        forced = "any"
    elif isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
                                      param="tool_choice")
        forced = name
    elif choice not in (None, "auto", "none"):
        raise InvalidRequestError(f"tool_choice '{choice}' is not one of none, auto, required or a named function",
                                  param="tool_choice")
    functions = _functions(req)
    return Constraint(functions=functions, forced=forced, parallel=req.parallel_tool_calls is not False,
                      json_schema=_json_schema(req.response_format),
                      function_params=tuple(f"tools.{i}.function.parameters" for i in range(len(functions))),
                      tools_parsed=tools_parsed and choice != "none")


@bp.post("/v1/chat/completions")
async def chat_completions():
    """Create a chat completion; `stream: true` answers with server-sent events."""
    state = get_state()
    stats = state.request_stats()
    req = parse_request(ChatCompletionRequest, await request_body())
    state.check_model(req.model)
    params = _params(req)
    engine = state.ready_engine()
    free_parser = parser_factory(state.config, engine, req.tools, req.tool_choice)
    c = constraint(req, free_parser is not None)
    prompt_ids = await chat_prompt_ids(engine, req, state.config.trust_request_mm_kwargs)
    c = replace(c, reasoning=reasoning_mode(state.config, engine, prompt_ids, req.chat_template_kwargs))
    params.grammar = await request_grammar(engine.tokenizer, c)
    new_parser = sequence_parser(c, free_parser, engine.tokenizer)
    # Validation (context length, params) raises here, before any byte of a stream is sent.
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    stream = state.track(add_request(engine, prompt_ids, params, prompt_param="messages",
                                     max_tokens_param=max_tokens_param))
    response_id, created = state.new_id("chatcmpl-"), state.clock()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream_events(engine, stream, req, params, response_id, created, include_usage,
                                state.config.sse_keep_alive_interval, stats, new_parser, c.forced is not None,
                                c.reasoning is not None)
        return sse_response(events, stream)
    results, counter = await collect(stream, stats)
    choices, parsers = [], []
    for i, seq in sorted(results.items()):
        message, finish = AssistantMessage(content=seq.text), seq.finish_reason
        if new_parser is not None:
            parsers.append(parser := new_parser())
            reasoning, content, calls = split(parse_deltas(parser, seq.deltas, seq.token_ids))
            calls = calls if c.parallel else calls[:1]
            message = AssistantMessage(content=content or None if reasoning else content,
                                       reasoning_content=reasoning or None)
            if calls or c.forced is not None:  # forced: only calls, never the markup of one left unfinished
                message = AssistantMessage(content=None if c.forced is not None else content or None,
                                           reasoning_content=reasoning or None, tool_calls=[
                    ToolCallOut(id=call_id("call_", response_id, i, k), function=FunctionCall(**vars(call)))
                    for k, call in enumerate(calls)] or None)
                finish = "tool_calls" if calls and finish == "stop" else finish
        logprobs = _logprobs(engine.tokenizer, seq.logprobs) if params.logprobs is not None else None
        choices.append(ChatChoice(index=i, message=message, finish_reason=finish, logprobs=logprobs))
    usage = counter.usage()
    if c.reasoning is not None:
        usage = _with_reasoning_tokens(usage, parsers)
    return json_response(ChatCompletionResponse(id=response_id, created=created, model=req.model,
                                                choices=choices, usage=usage))


def _stream_events(engine, stream, req, params, response_id, created, include_usage, keep_alive_s=0.0,
                   stats=NO_STATS, new_parser=None, forced=False, count_reasoning=False):
    """Chunks: a role delta per choice, content deltas, a finish chunk per choice, usage, [DONE].

    With an output parser (`new_parser`, see `api.structured.sequence_parser`), each choice's text goes through its
    own parser: `reasoning_content` deltas carry the reasoning, content deltas the content, each call goes out
    whole in a `tool_calls` delta once the model closed it, and a choice that called tools finishes with
    "tool_calls". A forced choice (`forced`) sends calls only. When a reasoning parser reads the output
    (`count_reasoning`), the usage chunk counts its tokens (`completion_tokens_details.reasoning_tokens`).

    Without logprobs a chunk is assembled from bytes: the head and tail that pydantic renders once per request
    (`chunk_frame_parts`) around `{"index":i,"delta":{"content":<text>},"logprobs":null,"finish_reason":...}`,
    the same bytes `ChatChunkChoice` would give, at a fraction of the cost of building and dumping models per token.
    """
    frames = ChunkFrames(ChatCompletionChunk, response_id, created, req.model, include_usage)
    chunk, head, tail = frames.frame, frames.head, frames.tail
    # per choice index: everything before the content string, and after it while the choice is unfinished
    content_head: dict[int, bytes] = {}
    content_tail = b'},"logprobs":null,"finish_reason":null}' + tail

    parsers = {}
    new_tokens = NewTokens()
    max_calls = 1 if req.parallel_tool_calls is False else 1 << 30

    def tool_chunk(out, held_logprobs: list[TokenLogprob]) -> bytes:
        parser = parsers.get(out.index) or parsers.setdefault(out.index, new_parser())
        before = min(len(parser.calls), max_calls)
        reasoning, content, calls = parser.feed(out.text, new_tokens(out), out.token_ids)
        finish = out.finish_reason.value if out.finish_reason is not None else None
        if finish is not None:
            last_reasoning, last, last_calls = parser.finish()
            reasoning, content, calls = reasoning + last_reasoning, content + last, calls + last_calls
            if parser.calls and finish == "stop":
                finish = "tool_calls"
        if forced:
            content = ""  # the grammar writes calls only: other text is a call the output did not finish
        calls = calls[:max(0, max_calls - before)]  # parallel_tool_calls false: the first call only
        if not reasoning and not content and not calls and finish is None:
            return b""  # nothing that can be sent yet (held markup or whitespace)
        delta = DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=[
            DeltaToolCall(index=before + k, id=call_id("call_", response_id, out.index, before + k),
                          function=FunctionCall(**vars(call))) for k, call in enumerate(calls)] or None)
        logprobs = _logprobs(engine.tokenizer, held_logprobs) if params.logprobs is not None else None
        return chunk([ChatChunkChoice(index=out.index, delta=delta, logprobs=logprobs, finish_reason=finish)])

    def choice_chunk(out, held_logprobs: list[TokenLogprob]) -> bytes:
        if params.logprobs is not None:
            finish = out.finish_reason.value if out.finish_reason is not None else None
            delta = DeltaMessage(content=out.text) if out.text else DeltaMessage()
            logprobs = _logprobs(engine.tokenizer, held_logprobs)
            return chunk([ChatChunkChoice(index=out.index, delta=delta, logprobs=logprobs, finish_reason=finish)])
        if out.finish_reason is None:  # the per-token case
            pre = content_head.get(out.index)
            if pre is None:
                pre = content_head[out.index] = head + b'{"index":%d,"delta":{"content":' % out.index
            return pre + orjson.dumps(out.text) + content_tail
        delta = b'{"content":' + orjson.dumps(out.text) + b"}" if out.text else b"{}"
        return b"".join((head, b'{"index":%d,"delta":' % out.index, delta, b',"logprobs":null,"finish_reason":',
                         finish_json(out), b"}", tail))

    def usage_chunk(usage: Usage) -> bytes:
        return chunk([], _with_reasoning_tokens(usage, parsers.values()) if count_reasoning else usage)

    roles = [chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
             for i in range(params.n)]
    return drive_stream(stream, tool_chunk if new_parser is not None else choice_chunk,
                        usage_chunk if include_usage else None, roles, keep_alive_s, stats)
