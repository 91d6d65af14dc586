"""The streamed request each API takes and how to read its stream, for the HTTP benchmarks
(`tools/bench_http_overhead.py --api`): OpenAI Chat Completions, OpenAI Responses, Anthropic Messages.

Each shape gives the request path, a streamed request body of `max_tokens` output tokens that ignores EOS, and
two readers of the SSE body: the completion tokens its usage reports with the content events it held, and
whether a piece of it holds content (for time to first token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ApiShape:
    """One API's streamed request and stream readers.

    Attributes:
        path: the route.
        body: max_tokens -> the JSON request body (streamed, EOS ignored where the API takes `ignore_eos`).
        count: the whole SSE body -> (completion tokens from its usage, content events).
        has_content: a piece of the body -> whether it holds a content event with text.
    """

    path: str
    body: Callable[[str, int], dict]
    count: Callable[[bytes], tuple[int, int]]
    has_content: Callable[[bytes], bool]


def _frames(buf: bytes) -> list[bytes]:
    return [f for f in buf.split(b"\n\n") if f]


def _chat_count(buf: bytes) -> tuple[int, int]:
    frames = buf.split(b"\n\n")
    if frames[-2:] != [b"data: [DONE]", b""]:
        raise RuntimeError(f"stream did not end with [DONE]: {buf[-200:]!r}")
    usage = json.loads(frames[-3][6:])["usage"]
    return usage["completion_tokens"], buf.count(b'"content":"') - 1  # minus the role chunk's content ""


def _typed_data(frame: bytes) -> dict:
    return json.loads(frame.split(b"\ndata: ", 1)[1])


def _responses_count(buf: bytes) -> tuple[int, int]:
    last = _frames(buf)[-1]
    if not last.startswith(b"event: response.completed") and not last.startswith(b"event: response.incomplete"):
        raise RuntimeError(f"stream did not end with response.completed: {buf[-200:]!r}")
    return _typed_data(last)["response"]["usage"]["output_tokens"], buf.count(b"event: response.output_text.delta")


def _messages_count(buf: bytes) -> tuple[int, int]:
    frames = _frames(buf)
    if not frames[-1].startswith(b"event: message_stop"):
        raise RuntimeError(f"stream did not end with message_stop: {buf[-200:]!r}")
    return _typed_data(frames[-2])["usage"]["output_tokens"], buf.count(b'"type":"text_delta"')


SHAPES = {
    "chat": ApiShape(
        "/v1/chat/completions",
        lambda model, n: {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": n,
                          "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
        _chat_count,
        lambda data: data.count(b'"content":"') > data.count(b'"content":""')),
    "responses": ApiShape(
        "/v1/responses",
        lambda model, n: {"model": model, "input": "Hi", "max_output_tokens": n, "ignore_eos": True,
                          "stream": True},
        _responses_count,
        lambda data: b"event: response.output_text.delta" in data),
    "messages": ApiShape(
        "/v1/messages",
        lambda model, n: {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": n,
                          "stream": True},
        _messages_count,
        lambda data: b'"type":"text_delta"' in data),
}
