"""Pieces the generating endpoints share (Chat Completions, Completions, Responses, Anthropic Messages):
SamplingParams from a request, usage, token text, collecting a request, JSON and SSE responses."""

from __future__ import annotations

import asyncio
import json
import weakref

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import orjson
from pydantic import BaseModel
from quart import Response, request
from werkzeug.exceptions import RequestTimeout

from api import sse
from api.errors import ErrorKind, describe, kind_of, openai_payload
from api.metrics import NO_STATS
from api.openai.protocol import ChatTokenLogprob, PromptTokensDetails, SamplingFields, TopLogprob, Usage
from voltserve.errors import ContextLengthError, InvalidRequestError, VoltError
from voltserve.request import (MAX_LOGPROBS, RequestOutput, SamplingParams, TokenLogprob, check_output_budget,
                               prompt_fills_context)


# OpenAI's temperature range is [0, 2] (the engine takes up to `voltserve.request.MAX_TEMPERATURE`)
OPENAI_MAX_TEMPERATURE = 2


def check_stream_options(req: SamplingFields) -> None:
    """OpenAI's rule for Chat Completions, Completions and Responses: `stream_options` only with `stream: true`
    (null is fine either way).

    Raises:
        InvalidRequestError: `stream_options` set on a request that does not stream (param "stream_options").
    """
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                                  param="stream_options")


def sampling_params(req: SamplingFields, *, max_tokens: int | None, max_tokens_param: str,
                    logprobs: int | None) -> SamplingParams:
    """OpenAI/vLLM request fields -> validated SamplingParams (None fields take SamplingParams' defaults;
    temperature within OpenAI's [0, 2]).

    Args:
        req: the parsed request.
        max_tokens: output token limit (None = the rest of the context window).
        max_tokens_param: the field name to blame when max_tokens is out of range.
        logprobs: None = no logprobs; k = sampled token plus the top k alternatives.

    Raises:
        InvalidRequestError: a value out of range, with `param` naming the request field.
    """
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(f"{max_tokens_param} must be >= 1", param=max_tokens_param)
    if req.logit_bias:
        raise InvalidRequestError("logit_bias is not supported yet", param="logit_bias")
    if req.temperature is not None and req.temperature > OPENAI_MAX_TEMPERATURE:
        raise InvalidRequestError(f"temperature must be <= {OPENAI_MAX_TEMPERATURE}", param="temperature")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    defaults = SamplingParams()
    given = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "n": req.n, "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }
    values = {k: (getattr(defaults, k) if v is None else v) for k, v in given.items()}
    return SamplingParams(
        **values, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
    ).validate(max_tokens_name=max_tokens_param)


def check_prompt_chars(engine, num_chars: int, param: str, num_tokens: int = 0) -> None:
    """Refuse, before tokenizing it, a prompt of `num_chars` characters (after `num_tokens` tokens already
    encoded) that cannot fit the context: its tokens number at least `Tokenizer.min_num_tokens` (a 30 MB prompt
    otherwise costs ~30 s of encoding to learn that).

    Raises:
        ContextLengthError: that bound fills the window (param `param`).
    """
    if num_tokens + num_chars < engine.max_model_len:  # the bound is at most one token a character
        return
    bound = getattr(engine.tokenizer, "min_num_tokens", None)  # absent from test doubles' tokenizers
    least = num_tokens + (bound(num_chars) if bound is not None else 0)
    if least >= engine.max_model_len:
        raise prompt_fills_context(engine.max_model_len, f"at least {least}", param)


def check_token_ids(tokenizer, ids: list[int], param: str) -> None:
    """Raises InvalidRequestError (param `param`) unless every id is in [0, vocab_size) (>= 0 only, for a
    tokenizer double without `vocab_size`)."""
    vocab_size = getattr(tokenizer, "vocab_size", None)
    if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in ids):
        raise InvalidRequestError(f"{param}: token ids must be in [0, {vocab_size or 'vocab_size'})", param=param)


def add_request(engine, prompt_ids: list[int], params: SamplingParams, *, prompt_param: str,
                max_tokens_param: str):
    """`engine.add_request`, with a context-length or output-budget error in the request's own field names.

    Returns:
        The engine's RequestStream.

    Raises:
        ContextLengthError: param = `prompt_param` when the prompt alone fills the window, else `max_tokens_param`
            (named in the message too).
        InvalidRequestError: min_tokens above the rest of the window (its message names `max_tokens_param`); any
            other from the engine.
        EngineDeadError: from the engine.
    """
    try:
        return engine.add_request(prompt_ids, params)
    except InvalidRequestError as exc:
        if isinstance(exc, ContextLengthError):
            exc.param = prompt_param if len(prompt_ids) >= engine.max_model_len else max_tokens_param
        if exc.param in (max_tokens_param, "min_tokens") and max_tokens_param != "max_tokens":
            # the engine's message speaks of SamplingParams' max_tokens: the same check again raises it in the
            # request's words (Responses' max_output_tokens); on the error path only, so no cost to a request
            check_output_budget(len(prompt_ids), params, engine.max_model_len, max_tokens_param)
        raise


# Prompts up to this many characters are rendered and tokenized on the event loop (~0.1-1.5 ms with the default
# model's tokenizer): a trip through `asyncio.to_thread` costs a short request far more under streaming load, since
# the thread waits for the GIL (up to the 5 ms switch interval, several times) and then for a loop turn. Longer
# prompts still go to a thread: `Tokenizer.encode` releases the GIL for them, so the loop keeps streaming meanwhile.
INLINE_PROMPT_CHARS = 1024


async def prompt_work(size: int, fn: Callable, *args):
    """`fn(*args)`: inline when `size` (the prompt's characters) is at most INLINE_PROMPT_CHARS, else in
    `asyncio.to_thread`. For rendering and tokenizing a request's prompt."""
    if size <= INLINE_PROMPT_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def request_body() -> bytes:
    """The current request's body, as `quart.request.get_data()` returns it (same BODY_TIMEOUT, RequestTimeout
    and MAX_CONTENT_LENGTH checks). On Python 3.11, get_data's `asyncio.wait_for` wraps the body in a task: three
    loop turns even when the body came with the headers, which under streaming load is milliseconds of TTFT;
    `asyncio.timeout` needs none."""
    try:
        async with asyncio.timeout(request.body_timeout):
            return await request.body
    except TimeoutError as exc:
        raise RequestTimeout() from exc


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token as logprobs show it (bytes of a split UTF-8 character become U+FFFD)."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def check_top_logprobs(top: int | None, param: str = "top_logprobs") -> None:
    """Raises InvalidRequestError (param `param`: chat's and Responses' "top_logprobs", completions' "logprobs")
    unless `top` is None or in [0, MAX_LOGPROBS]."""
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(f"{param} must be between 0 and {MAX_LOGPROBS}", param=param)


def logprob_entries(tokenizer, logprobs: list[TokenLogprob]) -> list[ChatTokenLogprob]:
    """Per-token logprob entries as Chat Completions' `logprobs.content` and Responses' `output_text.logprobs`
    show them: each token's text, logprob and bytes, with its `top_logprobs` alternatives alike."""
    def entry(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=token_text(tokenizer, token_id), logprob=logprob,
                          bytes=list(tokenizer.token_bytes(token_id)))

    content = []
    for lp in logprobs:
        first = entry(lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(token=first.token, logprob=first.logprob, bytes=first.bytes,
                                        top_logprobs=[entry(t, v) for t, v in lp.top]))
    return content


@dataclass
class SequenceResult:
    """Everything one choice produced, accumulated over its deltas.

    Attributes:
        text: joined text deltas.
        deltas: (text, tokens new in it: `NewTokens`, the end of its ids in `token_ids`) of each delta, in order:
            what an output parser reads (`voltserve.parsers.output.parse_deltas`), as the stream feeds it.
        token_ids: [num_output_tokens] output token ids.
        logprobs: one TokenLogprob per output token whose text is in `text` (when requested; see RequestOutput).
        logprob_ends: the end of each delta's entries in `logprobs`, one per delta of `deltas`.
        finish_reason: "stop" / "length" / "abort", None while running.
        stop_reason: the stop string or stop token id that ended it, when one did.
    """

    text: str = ""
    deltas: list[tuple[str, int, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprob_ends: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class NewTokens:
    """The tokens each delta adds to its sequence, from the cumulative `num_output_tokens` (what usage counts):
    the tokens of a delta `drive_stream` does not hand on (no text yet: part of a UTF-8 character) count with the
    next one, so a streamed output parser counts every token, as one fed `collect`'s deltas does. The parser gets
    the delta's `token_ids` beside the count: tokens counted here beyond those ids came before them."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}  # per choice index: num_output_tokens counted so far

    def __call__(self, out: RequestOutput) -> int:
        """The tokens of `out`'s sequence since the last delta counted."""
        seen = self._seen.get(out.index, 0)
        self._seen[out.index] = out.num_output_tokens
        return out.num_output_tokens - seen


class UsageCounter:
    """Token counts of one request across its `n` sequences, from the RequestOutput counters."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens: dict[int, int] = {}
        self.finish_reason: str | None = None  # of the last sequence to finish

    def add(self, out: RequestOutput) -> None:
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
        self.output_tokens[out.index] = out.num_output_tokens
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason.value

    def record(self, stats) -> None:
        """Report the finished request to its `api.metrics.RequestStats`."""
        outputs = self.output_tokens.values()
        stats.finished(self.prompt_tokens, sum(outputs), max(outputs, default=0), self.finish_reason)

    def usage(self) -> Usage:
        completion = sum(self.output_tokens.values())
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))


async def collect(stream, stats=NO_STATS) -> tuple[dict[int, SequenceResult], UsageCounter]:
    """Drain a RequestStream into one SequenceResult per choice index; aborts the request if cancelled.
    `stats`: the request's `api.metrics.RequestStats` (first output, then finished or failed).

    Raises:
        EngineDeadError: the engine died mid-request.
    """
    results: dict[int, SequenceResult] = {}
    counter, new_tokens = UsageCounter(), NewTokens()
    finished = False
    try:
        async for out in stream:
            if not results:
                stats.first_token()
            seq = results.setdefault(out.index, SequenceResult())
            seq.token_ids.extend(out.token_ids)
            seq.deltas.append((out.text, new_tokens(out), len(seq.token_ids)))  # ids by index: not copied twice
            seq.logprobs.extend(out.logprobs or [])
            seq.logprob_ends.append(len(seq.logprobs))
            if out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason.value, out.stop_reason
            counter.add(out)
        finished = True
        for seq in results.values():  # joined once at the end: `+=` per delta is quadratic in the output length
            seq.text = "".join(delta[0] for delta in seq.deltas)
        counter.record(stats)
    except VoltError as exc:
        stats.failed(kind_of(exc).reason)
        raise
    except Exception:
        stats.failed("internal_error")
        raise
    finally:
        if not finished:  # client gone (handler cancelled) or engine error: free the request's KV blocks
            stats.failed("client_gone")  # no-op after an error
            stream.abort()
    return results, counter


def json_response(model: BaseModel, status: int = 200) -> Response:
    """A JSON response from a pydantic model, serialised with orjson (with the json module where orjson cannot:
    integers beyond 64 bits, which a tool call's input may hold)."""
    data = model.model_dump(mode="json")
    try:
        body = orjson.dumps(data)
    except TypeError:
        body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(body, status=status, content_type="application/json")


def sse_response(events: AsyncIterator[bytes], stream=None) -> Response:
    """A `text/event-stream` response without Quart's 60 s response timeout (it would cut long streams).

    Args:
        events: the SSE byte chunks (keep-alive comments included: `drive_stream` adds them).
        stream: the engine stream behind `events`; if the response is dropped before `events` ever runs (the client
            left before the first byte), its `finally` cannot abort the request, so the request is aborted when
            `events` is garbage-collected unfinished.
    """
    if stream is not None:
        weakref.finalize(events, lambda: None if stream.finished else stream.abort())
    # The generator is the body itself: Quart closes it (running its `finally`) when the response ends or the
    # client leaves, and no wrapper sits on the per-chunk path.
    response = Response(events, content_type="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.timeout = None
    return response


_CHOICES = b'"choices":['


def chunk_frame_parts(event: BaseModel, exclude: set[str] | None = None) -> tuple[bytes, bytes]:
    """The framed bytes of a streamed chunk around its choices, from the chunk's own model with `choices=[]`.

    A request's chunks differ only in their choices, so the part before them (`data: {"id":...,"model":...,
    "choices":[`) and after (`]}\\n\\n` or `],"usage":null}\\n\\n`) are rendered once, by pydantic, and each
    chunk is then `head + <choice JSON> + tail`, the same bytes `sse.frame` gives for the whole model.

    Args:
        event: the chunk model with an empty `choices` list.
        exclude: as `sse.frame`'s.
    Returns:
        (head, tail).
    """
    framed = sse.frame(event, exclude=exclude)
    # A `"choices":[` inside a JSON string (id, model) would have its quotes escaped, so the first hit is the field.
    cut = framed.index(_CHOICES + b"]") + len(_CHOICES)
    return framed[:cut], framed[cut:]


class ChunkFrames:
    """The SSE frames of one streamed response's chunks, which differ only in their choices and usage.

    Args:
        event_cls: the chunk model (ChatCompletionChunk, CompletionResponse).
        response_id, created, model: the fields every chunk repeats.
        include_usage: `stream_options.include_usage`; without it the `usage` field is left out of every chunk.
    Attributes:
        head, tail: the framed bytes around a chunk's choices (`chunk_frame_parts`), for chunks assembled from
            bytes on the per-token path.
    """

    def __init__(self, event_cls: type[BaseModel], response_id: str, created: int, model: str, include_usage: bool):
        self._fields = {"id": response_id, "created": created, "model": model}
        self._event_cls = event_cls
        self._exclude = None if include_usage else {"usage"}
        self.head, self.tail = chunk_frame_parts(event_cls(choices=[], **self._fields), self._exclude)

    def frame(self, choices: list, usage: Usage | None = None) -> bytes:
        """A whole chunk rendered through its model."""
        return sse.frame(self._event_cls(choices=choices, usage=usage, **self._fields), exclude=self._exclude)


def openai_error_frame(kind: ErrorKind, message: str, param: str | None) -> bytes:
    """An error sent in-band on an OpenAI stream (the status line is already out): `data: {"error": ...}`."""
    return sse.frame(openai_payload(message, kind, param))


def finish_json(out: RequestOutput) -> bytes:
    """The `finish_reason` value of a delta as JSON."""
    return b"null" if out.finish_reason is None else orjson.dumps(out.finish_reason.value)


async def drive_stream(stream, choice_chunk: Callable[[RequestOutput, list[TokenLogprob]], bytes],
                       usage_chunk: Callable[[Usage], bytes] | None, first: Iterable[bytes] = (),
                       keep_alive_s: float = 0.0, stats=NO_STATS, *,
                       error_frame: Callable[[ErrorKind, str, str | None], bytes] = openai_error_frame,
                       done: bytes = sse.DONE) -> AsyncIterator[bytes]:
    """The SSE body of a streamed request, shared by every streaming endpoint (OpenAI's and Anthropic's).

    Args:
        stream: the engine's RequestStream.
        choice_chunk: (delta, its logprobs, held back since the last chunk) -> its framed events, or b"" when
            nothing can be sent for it yet.
        usage_chunk: usage -> the final usage chunk; None for none (the client did not ask for usage, or the
            stream's last event, made by `choice_chunk`, carries it).
        first: chunks sent before any token (e.g. chat's role deltas).
        keep_alive_s: seconds of silence before a `: keep-alive` comment; 0 = none. A RequestStream is woken by
            an `sse.IdleTimer` (`interrupt()`); another source (test doubles) goes through `sse.with_keep_alive`.
        stats: the request's `api.metrics.RequestStats` (first output written, then finished or failed).
        error_frame: (table row, message, param) -> the in-band error event (OpenAI's shape by default).
        done: the stream's last bytes: `data: [DONE]` for OpenAI's chunk streams, b"" for typed-event streams
            (Responses, Anthropic Messages), whose last event comes from `choice_chunk`.
    Yields:
        Framed events, then `done`. Deltas with no text and no finish (bytes of a split character) are
        held, their logprobs joining the next chunk. An engine error after the status went out is sent in-band;
        a client that leaves mid-stream has its request aborted (its KV blocks freed).

        Events that are ready together go out as one body chunk (one write through the HTTP server, whose cost
        is per write, not per byte): every delta a RequestStream holds when its consumer wakes (`pop_ready`),
        and the last deltas with the usage chunk and `[DONE]`. The bytes on the wire are the events' bytes in
        order, exactly as one write per event would send them.
    """
    counter = UsageCounter()
    add = counter.add
    held: dict[int, list[TokenLogprob]] = {}
    finished = False
    timer, outputs = None, stream
    if keep_alive_s > 0:
        if hasattr(stream, "interrupt"):
            timer = sse.IdleTimer(keep_alive_s, stream.interrupt)
        else:
            outputs = sse.with_keep_alive(stream, keep_alive_s, marker=None)
    # a RequestStream hands over what else it holds without waiting; other sources (test doubles) one by one
    pop_ready = getattr(stream, "pop_ready", None) if outputs is stream else None
    tail: list[bytes] = []  # events that go out with [DONE]
    first_out = stats  # cleared once the first output is written
    try:
        for event in first:
            yield event
        async for out in outputs:  # the per-token path: keep it lean
            if out is None:  # idle for keep_alive_s
                if timer is not None:
                    timer.fired = False
                yield sse.KEEP_ALIVE
                continue
            parts = []
            while out is not None:
                add(out)
                logprobs = out.logprobs
                if not out.text and out.finish_reason is None:
                    if logprobs:
                        held.setdefault(out.index, []).extend(logprobs)
                else:
                    pending = held.pop(out.index, None) if held else None
                    if pending is None:
                        pending = logprobs or []  # read-only for choice_chunk: no copy per token
                    elif logprobs:
                        pending.extend(logprobs)
                    event = choice_chunk(out, pending)
                    if event:
                        parts.append(event)
                    elif pending:  # nothing to send yet (a tool call still being written): its logprobs wait
                        held[out.index] = list(pending)
                out = pop_ready() if pop_ready is not None else None
            if not parts:
                if timer is not None and timer.fired:  # the keep-alive's wake-up took deltas with no text yet
                    timer.fired = False
                    yield sse.KEEP_ALIVE
                continue
            if first_out is not None:
                first_out.first_token()
                first_out = None
            if timer is not None:
                timer.touch()
            if pop_ready is not None and stream.finished:  # nothing follows but usage and [DONE]
                tail = parts
                break
            yield parts[0] if len(parts) == 1 else b"".join(parts)
        finished = True
        counter.record(stats)
        if usage_chunk is not None:
            tail.append(usage_chunk(counter.usage()))
    except VoltError as exc:  # the status is already sent: report the error in-band
        finished = True
        kind, message, param = describe(exc)
        stats.failed(kind.reason)
        tail.append(error_frame(kind, message, param))
    except Exception:
        stats.failed("internal_error")
        raise
    finally:
        if timer is not None:
            timer.close()
        elif outputs is not stream:
            await outputs.aclose()  # its pending __anext__ task
        if not finished:  # client disconnected
            stats.failed("client_gone")
            stream.abort()
    tail.append(done)
    last = b"".join(tail)
    if last:  # nothing after a typed-event stream's last event: no empty write
        yield last

