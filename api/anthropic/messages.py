"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, text only
(https://docs.anthropic.com/en/api/messages, streaming: https://docs.anthropic.com/en/docs/build-with-claude/streaming).

The request becomes chat messages and goes through the same template and tokenizer path as Chat Completions
(`api.openai.chat_prompt`: special-token text in user content stays plain text, case S6; the billing-header line of
a system prompt is dropped, case S2). A last `assistant` message is a prefill: the answer continues it, and the
response holds only the continuation. Errors take Anthropic's shape (`api.errors.speaks_anthropic`).
"""

from __future__ import annotations

import orjson
from quart import Blueprint

from api import sse
from api.anthropic.protocol import (
    ContentBlock, CountTokensRequest, MessageResponse, MessagesRequest, MessageUsage, TextBlock, TokenCount,
)
from api.errors import ErrorKind, anthropic_payload
from api.metrics import NO_STATS
from api.openai.chat_prompt import messages_prompt_ids, strip_billing_header
from api.openai.common import (
    add_request, collect, drive_stream, json_response, prompt_work, request_body, sse_response,
)
from api.openai.protocol import parse_request
from api.state import get_state
from voltserve.errors import InvalidRequestError
from voltserve.request import FinishReason, RequestOutput, SamplingParams

bp = Blueprint("anthropic_messages", __name__)

_SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # earlier turns' reasoning: not part of the prompt
_MEDIA_BLOCKS = frozenset({"image", "document", "search_result"})


def _blocks_text(content: str | list[ContentBlock], param: str) -> str:
    """A message's or the system prompt's content as one string; text blocks join with newlines.

    Raises:
        InvalidRequestError: a media block (the served model reads text only), a tool block (no tool calling
            yet), or a text block without text.
    """
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        if block.type == "text":
            if block.text is None:
                raise InvalidRequestError("a text block needs 'text'", param=f"{where}.text")
            texts.append(block.text)
        elif block.type in _MEDIA_BLOCKS:
            raise InvalidRequestError(f"content block type '{block.type}' is not supported: the served model "
                                      "accepts text only", param=f"{where}.type")
        elif block.type not in _SKIPPED_BLOCKS:
            raise InvalidRequestError(f"content block type '{block.type}' is not supported yet",
                                      param=f"{where}.type")
    return "\n".join(texts)


def _check_unsupported(req: CountTokensRequest) -> None:
    if req.tools:
        raise InvalidRequestError("tools are not supported yet", param="tools")
    if req.tool_choice and req.tool_choice.get("type") not in ("auto", "none"):
        raise InvalidRequestError("tool_choice needs tools, which are not supported yet", param="tool_choice")
    if req.thinking is not None and req.thinking.type != "disabled":
        raise InvalidRequestError("extended thinking is not supported by the served model", param="thinking")
    for name, config in (("output_config.format", (req.output_config or {}).get("format")),
                         ("output_format", req.output_format)):
        if config is not None:
            raise InvalidRequestError("structured output is not supported yet", param=name)


def split_prefill(req: CountTokensRequest) -> tuple[list[dict], str]:
    """The request's system prompt and messages as chat messages, and the prefill.

    Returns:
        (`{"role", "content"}` dicts for the chat template, the last assistant message's text when the
        conversation ends with one, else ""); the prefill is left out of the messages.

    Consecutive messages of one role are joined into one turn (with a newline), as Anthropic does.

    Raises:
        InvalidRequestError: no messages, a prefill that ends in whitespace (as Anthropic refuses it), a block
            `_blocks_text` refuses, tools, a forced tool_choice, extended thinking or structured output (not
            served yet).
    """
    _check_unsupported(req)
    if not req.messages:
        raise InvalidRequestError("'messages' must contain at least one message", param="messages")
    messages = []
    if req.system is not None:
        messages.append({"role": "system", "content": strip_billing_header(_blocks_text(req.system, "system"))})
    for i, msg in enumerate(req.messages):
        text = _blocks_text(msg.content, f"messages.{i}.content")
        if i and msg.role == req.messages[i - 1].role:  # consecutive turns of one role are one turn (Anthropic's)
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": msg.role, "content": text})
    prefill = ""
    if req.messages[-1].role == "assistant":
        prefill = messages.pop()["content"]
        if prefill != prefill.rstrip():
            raise InvalidRequestError("final assistant content cannot end with trailing whitespace",
                                      param=f"messages.{len(req.messages) - 1}.content")
    return messages, prefill


async def prompt_ids(engine, req: CountTokensRequest) -> list[int]:
    """Render and tokenize a Messages request like a chat request; a prefill's tokens follow the generation
    prompt (tokenized as plain text).

    Returns:
        [num_prompt_tokens] token ids.

    Raises:
        InvalidRequestError: see `split_prefill` and `api.openai.chat_prompt.messages_prompt_ids`.
    """
    messages, prefill = split_prefill(req)
    ids = await messages_prompt_ids(engine, messages)
    if prefill:  # a long one in a thread, as the messages (`prompt_work`)
        ids += await prompt_work(len(prefill), _encode_plain, engine.tokenizer, prefill)
    return ids


def _encode_plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, parse_special=False)


def sampling_params(req: MessagesRequest) -> SamplingParams:
    """Anthropic sampling fields -> validated SamplingParams (temperature defaults to 1.0, as Anthropic's).

    Raises:
        InvalidRequestError: a value out of range.
    """
    defaults = SamplingParams()
    return SamplingParams(
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        top_k=req.top_k or 0, max_tokens=req.max_tokens, stop=list(req.stop_sequences or []),
    ).validate()


def stop_fields(finish_reason: FinishReason | str | None, stop_reason: str | int | None) -> dict:
    """`stop_reason` and `stop_sequence` of a finished sequence: max_tokens (length), stop_sequence (a stop
    string matched; `stop_sequence` names it) or end_turn (EOS or a stop token); None when it was aborted."""
    reason = FinishReason(finish_reason) if finish_reason is not None else None
    if reason is FinishReason.LENGTH:
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if reason is FinishReason.STOP:
        if isinstance(stop_reason, str):
            return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}
    return {"stop_reason": None, "stop_sequence": None}


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> MessageUsage:
    return MessageUsage(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                        cache_read_input_tokens=cached_tokens)


@bp.post("/v1/messages")
async def create_message():
    """Create a message; `stream: true` answers with Anthropic's named server-sent events."""
    state = get_state()
    stats = state.metrics.request()
    req = parse_request(MessagesRequest, await request_body())
    state.check_model(req.model)
    params = sampling_params(req)
    engine = state.ready_engine()
    ids = await prompt_ids(engine, req)
    stream = state.track(add_request(engine, ids, params, prompt_param="messages", max_tokens_param="max_tokens"))
    message_id = state.new_id("msg_")
    if req.stream:
        events = _stream_events(stream, message_id, req.model, len(ids), state.config.sse_keep_alive_interval,
                                stats)
        return sse_response(events, stream)
    results, counter = await collect(stream, stats)
    seq = results[0]
    return json_response(MessageResponse(
        id=message_id, model=req.model, content=[TextBlock(text=seq.text)],
        **stop_fields(seq.finish_reason, seq.stop_reason),
        usage=_usage(counter.prompt_tokens, counter.cached_tokens, sum(counter.output_tokens.values()))))


@bp.post("/v1/messages/count_tokens")
async def count_tokens():
    """The prompt's token count as /v1/messages would see it (system prompt, messages and prefill)."""
    state = get_state()
    req = parse_request(CountTokensRequest, await request_body())
    state.check_model(req.model)
    ids = await prompt_ids(state.ready_engine(), req)
    return json_response(TokenCount(input_tokens=len(ids)))


def anthropic_error_frame(kind: ErrorKind, message: str, param: str | None) -> bytes:
    """An error sent in-band on a Messages stream: `event: error` with Anthropic's error body."""
    return sse.typed_frame("error", anthropic_payload(message, kind))


_DELTA_HEAD = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,' \
              b'"delta":{"type":"text_delta","text":'
_DELTA_TAIL = b"}}\n\n"


def _stream_events(stream, message_id: str, model: str, num_prompt_tokens: int, keep_alive_s: float = 0.0,
                   stats=NO_STATS):
    """The event sequence of a streamed message: message_start, content_block_start (one text block), ping,
    content_block_delta per delta, then content_block_stop, message_delta (stop_reason, stop_sequence and the
    final usage: the prompt's cached share is known only once it was scheduled) and message_stop."""
    start = MessageResponse(id=message_id, model=model, content=[], stop_reason=None, stop_sequence=None,
                            usage=_usage(num_prompt_tokens, 0, 0))
    first = [
        sse.typed_frame("message_start", {"type": "message_start", "message": start.model_dump(mode="json")}),
        sse.typed_frame("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}}),
        sse.typed_frame("ping", {"type": "ping"}),
    ]

    def event(out: RequestOutput, _logprobs) -> bytes:
        delta = _DELTA_HEAD + orjson.dumps(out.text) + _DELTA_TAIL if out.text else b""
        if out.finish_reason is None:
            return delta
        usage = _usage(out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens).model_dump()
        return b"".join((
            delta,
            sse.typed_frame("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse.typed_frame("message_delta", {"type": "message_delta",
                                              "delta": stop_fields(out.finish_reason, out.stop_reason),
                                              "usage": usage}),
            sse.typed_frame("message_stop", {"type": "message_stop"}),
        ))

    return drive_stream(stream, event, None, first, keep_alive_s, stats, error_frame=anthropic_error_frame,
                        done=b"")
