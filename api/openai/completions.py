"""POST /v1/completions (https://platform.openai.com/docs/api-reference/completions/create).

`logprobs` rule: an integer k in 0..20 (OpenAI allows 5; vLLM-style servers allow more). Each output position
then lists the sampled token's logprob and, in `top_logprobs`, the k most likely tokens plus the sampled one
(k + 1 entries when the sampled token is not among the top k). `text_offset` is where each token starts in the
choice's `text`, in characters (OpenAI's meaning): a token adds what it adds to the text, so a special token the
text leaves out (`<|im_start|>`) adds nothing, and a character split over byte tokens counts once it is whole.
"""

from __future__ import annotations

import codecs

import orjson
from quart import Blueprint

from api.metrics import NO_STATS
from api.openai.common import (
    ChunkFrames, add_request, check_prompt_chars, check_stream_options, check_token_ids, check_top_logprobs, collect,
    drive_stream, finish_json, json_response, prompt_work, request_body, sampling_params, sse_response, token_text,
)
from api.openai.chat_prompt import check_mm_kwargs
from api.openai.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, parse_request,
)
from api.state import get_state
from voltserve.errors import InvalidRequestError
from voltserve.request import SamplingParams, TokenLogprob

bp = Blueprint("openai_completions", __name__)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


def _params(req: CompletionRequest) -> SamplingParams:
    check_stream_options(req)
    check_top_logprobs(req.logprobs, "logprobs")
    if req.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise InvalidRequestError("best_of must equal n (or be left out)", param="best_of")
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    return sampling_params(req, max_tokens=max_tokens, max_tokens_param="max_tokens", logprobs=req.logprobs)


def _single_prompt(prompt):
    """The request's one prompt: a string or a token-id list, unwrapped from a one-element list of either.

    Raises:
        InvalidRequestError: several prompts.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    return prompt


def _prompt_ids(tokenizer, prompt) -> list[int]:
    """One prompt (`_single_prompt`: a string or a token-id list) -> token ids.

    Raises:
        InvalidRequestError: an empty prompt, or ids outside the vocabulary.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return tokenizer.encode(prompt, add_special_tokens=True, parse_special=True)
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    check_token_ids(tokenizer, prompt, "prompt")
    return list(prompt)


class _LogprobsBuilder:
    """Builds CompletionLogprobs incrementally, keeping `text_offset` running across stream chunks: per choice, the
    characters of the text so far, decoded from the bytes each token adds to it (the tokenizer's `byte_table`, as
    the text is decoded: exact for byte-level BPE; without one, the token's own bytes, none for the ids the text
    skips, which misses a SentencePiece decoder's dropped leading space and its one U+FFFD per invalid byte
    token). The U+FFFD of an invalid byte sequence, which the decoder writes when the next token's bytes arrive,
    counts before that next token. Built only for requests asking for logprobs (the table is built on first use).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        table = getattr(tokenizer, "byte_table", None)
        self.table = table(skip_special_tokens=True) if table is not None else None
        self.skipped = getattr(tokenizer, "skipped_ids", frozenset())
        self.offset: dict[int, tuple[int, codecs.IncrementalDecoder]] = {}

    def _text_bytes(self, token_id: int) -> bytes:
        if self.table is not None:
            return self.table[token_id] if 0 <= token_id < len(self.table) else b""
        return b"" if token_id in self.skipped else self.tokenizer.token_bytes(token_id)

    def build(self, index: int, logprobs: list[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        offset, utf8 = self.offset.get(index) or (0, codecs.getincrementaldecoder("utf-8")("replace"))
        for lp in logprobs:
            text = token_text(self.tokenizer, lp.token_id)
            top = {token_text(self.tokenizer, t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(top)
            held = bool(utf8.getstate()[0])  # bytes of an earlier token not decoded yet
            piece = utf8.decode(self._text_bytes(lp.token_id))
            out.text_offset.append(offset + (held and piece.startswith("\ufffd")))  # that token's U+FFFD first
            offset += len(piece)
        self.offset[index] = (offset, utf8)
        return out


@bp.post("/v1/completions")
async def completions():
    """Create a text completion; `stream: true` answers with server-sent events."""
    state = get_state()
    stats = state.request_stats()
    req = parse_request(CompletionRequest, await request_body())
    state.check_model(req.model)
    check_mm_kwargs(req, state.config.trust_request_mm_kwargs)
    params = _params(req)
    engine = state.ready_engine()
    prompt = _single_prompt(req.prompt)
    if isinstance(prompt, str):
        check_prompt_chars(engine, len(prompt), "prompt")
    prompt_ids = await prompt_work(len(prompt), _prompt_ids, engine.tokenizer, prompt)
    stream = state.track(add_request(engine, prompt_ids, params, prompt_param="prompt", max_tokens_param="max_tokens"))
    response_id, created = state.new_id("cmpl-"), state.clock()
    builder = _LogprobsBuilder(engine.tokenizer) if params.logprobs is not None else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream_events(stream, req, params, builder, response_id, created, include_usage,
                                state.config.sse_keep_alive_interval, stats)
        return sse_response(events, stream)
    results, counter = await collect(stream, stats)
    choices = [
        CompletionChoice(index=i, text=seq.text, finish_reason=seq.finish_reason,
                         logprobs=builder.build(i, seq.logprobs) if params.logprobs is not None else None)
        for i, seq in sorted(results.items())
    ]
    return json_response(CompletionResponse(id=response_id, created=created, model=req.model, choices=choices,
                                            usage=counter.usage()))


def _stream_events(stream, req, params, builder, response_id, created, include_usage, keep_alive_s=0.0,
                   stats=NO_STATS):
    """Chunks: text deltas (the last per choice with finish_reason), usage when asked, [DONE].

    Without logprobs a chunk is assembled from bytes around the text, as chat's are (`chunk_frame_parts`).
    """
    frames = ChunkFrames(CompletionResponse, response_id, created, req.model, include_usage)
    chunk, head, tail = frames.frame, frames.head, frames.tail
    text_head: dict[int, bytes] = {}
    text_tail = b',"logprobs":null,"finish_reason":null}' + tail

    def choice_chunk(out, held_logprobs: list[TokenLogprob]) -> bytes:
        if params.logprobs is not None:
            logprobs = builder.build(out.index, held_logprobs)
            finish = out.finish_reason.value if out.finish_reason is not None else None
            return chunk([CompletionChoice(index=out.index, text=out.text, logprobs=logprobs, finish_reason=finish)])
        pre = text_head.get(out.index)
        if pre is None:
            pre = text_head[out.index] = head + b'{"index":%d,"text":' % out.index
        if out.finish_reason is None:  # the per-token case
            return pre + orjson.dumps(out.text) + text_tail
        return b"".join((pre, orjson.dumps(out.text), b',"logprobs":null,"finish_reason":', finish_json(out),
                         b"}", tail))

    return drive_stream(stream, choice_chunk, (lambda usage: chunk([], usage)) if include_usage else None,
                        keep_alive_s=keep_alive_s, stats=stats)
