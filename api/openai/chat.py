"""POST /v1/chat/completions (https://platform.openai.com/docs/api-reference/chat/create)."""

from __future__ import annotations

import orjson
from quart import Blueprint

from api.metrics import NO_STATS
from api.openai.chat_prompt import chat_prompt_ids
from api.openai.common import (
    ChunkFrames, add_request, collect, drive_stream, finish_json, json_response, request_body,
    sampling_params, sse_response, token_text,
)
from api.openai.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob, DeltaMessage, DeltaToolCall, FunctionCall, ToolCallOut,
    TopLogprob, parse_request,
)
from api.state import get_state
from api.tool_calls import call_id, parser_factory
from voltserve.parsers.hermes import parse_tool_calls
from voltserve.errors import InvalidRequestError
from voltserve.request import MAX_LOGPROBS, SamplingParams, TokenLogprob

bp = Blueprint("openai_chat", __name__)


def _params(req: ChatCompletionRequest) -> SamplingParams:
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
    if top and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    forced = req.tool_choice not in (None, "auto", "none")
    if forced:  # "required" or a named tool needs a grammar, which is not built yet
        raise InvalidRequestError("tool_choice other than 'auto' or 'none' is not supported yet",
                                  param="tool_choice")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise InvalidRequestError("response_format other than 'text' is not supported yet", param="response_format")
    if req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, name = req.max_tokens, "max_tokens"
    return sampling_params(req, max_tokens=max_tokens, max_tokens_param=name,
                           logprobs=(top or 0) if req.logprobs else None)


def _logprobs(tokenizer, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=token_text(tokenizer, token_id), logprob=logprob,
                          bytes=list(tokenizer.token_bytes(token_id)))

    content = []
    for lp in logprobs:
        first = entry(lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(**first.model_dump(), top_logprobs=[entry(t, v) for t, v in lp.top]))
    return ChatLogprobs(content=content)


@bp.post("/v1/chat/completions")
async def chat_completions():
    """Create a chat completion; `stream: true` answers with server-sent events."""
    state = get_state()
    stats = state.metrics.request()
    req = parse_request(ChatCompletionRequest, await request_body())
    state.check_model(req.model)
    params = _params(req)
    engine = state.ready_engine()
    prompt_ids = await chat_prompt_ids(engine, req)
    # Validation (context length, params) raises here, before any byte of a stream is sent.
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    stream = state.track(add_request(engine, prompt_ids, params, prompt_param="messages",
                                     max_tokens_param=max_tokens_param))
    response_id, created = state.new_id("chatcmpl-"), state.clock()
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        new_parser = parser_factory(state.config, engine, req.tools, req.tool_choice)
        events = _stream_events(engine, stream, req, params, response_id, created, include_usage,
                                state.config.sse_keep_alive_interval, stats, new_parser)
        return sse_response(events, stream)
    new_parser = parser_factory(state.config, engine, req.tools, req.tool_choice)
    results, counter = await collect(stream, stats)
    choices = []
    for i, seq in sorted(results.items()):
        message, finish = AssistantMessage(content=seq.text), seq.finish_reason
        if new_parser is not None:
            content, calls = parse_tool_calls(seq.text)
            if req.parallel_tool_calls is False:
                calls = calls[:1]
            if calls:
                message = AssistantMessage(content=content or None, tool_calls=[
                    ToolCallOut(id=call_id("call_", response_id, i, k), function=FunctionCall(**vars(call)))
                    for k, call in enumerate(calls)])
                finish = "tool_calls" if finish == "stop" else finish
        logprobs = _logprobs(engine.tokenizer, seq.logprobs) if params.logprobs is not None else None
        choices.append(ChatChoice(index=i, message=message, finish_reason=finish, logprobs=logprobs))
    return json_response(ChatCompletionResponse(id=response_id, created=created, model=req.model,
                                                choices=choices, usage=counter.usage()))


def _stream_events(engine, stream, req, params, response_id, created, include_usage, keep_alive_s=0.0,
                   stats=NO_STATS, new_parser=None):
    """Chunks: a role delta per choice, content deltas, a finish chunk per choice, usage, [DONE].

    With a tool-call parser (`new_parser`, see `api.tool_calls`), each choice's text goes through its own parser:
    content deltas carry the content, each call goes out whole in a `tool_calls` delta once the model closed it,
    and a choice that called tools finishes with "tool_calls".

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
    max_calls = 1 if req.parallel_tool_calls is False else 1 << 30

    def tool_chunk(out, held_logprobs: list[TokenLogprob]) -> bytes:
        parser = parsers.get(out.index) or parsers.setdefault(out.index, new_parser())
        before = min(len(parser.calls), max_calls)
        content, calls = parser.feed(out.text)
        finish = out.finish_reason.value if out.finish_reason is not None else None
        if finish is not None:
            last, last_calls = parser.finish()
            content, calls = content + last, calls + last_calls
            if parser.calls and finish == "stop":
                finish = "tool_calls"
        calls = calls[:max(0, max_calls - before)]  # parallel_tool_calls false: the first call only
        if not content and not calls and finish is None:
            return b""  # nothing that can be sent yet (held markup or whitespace)
        delta = DeltaMessage(content=content or None, tool_calls=[
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

    roles = [chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
             for i in range(params.n)]
    return drive_stream(stream, tool_chunk if new_parser is not None else choice_chunk,
                        (lambda usage: chunk([], usage)) if include_usage else None, roles, keep_alive_s, stats)
