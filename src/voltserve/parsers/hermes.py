"""Tool calls in the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, split out of a
model's output text as it streams (Hermes 2/3, Qwen2.5 and many Llama fine-tunes; their chat templates ask for
it: https://github.com/NousResearch/Hermes-Function-Calling).

One parser serves the whole text and the stream alike (a whole text is one `feed` and `finish`), so the joined
streamed content always equals the non-streamed content. The rules (cases T7, T8, T10 of the API cases):
- a call is emitted whole once its `</tool_call>` arrives: never a truncated `{`, however many calls a delta holds;
- the body is read as JSON up to its closing brace, so `</tool_call>` inside a string argument does not end it;
- text that may still become `<tool_call>` (a trailing `<`, `<tool`) is held only until it cannot;
- whitespace is held while it is all the pending content: it goes out with the next text, is dropped when a call
  follows, and at the end is sent only if there was no call;
- markup that does not parse as a call (not a JSON object with a string `name`) is content, as written.
"""

from __future__ import annotations

from dataclasses import dataclass

from voltserve.parsers.tool_json import decode_object_prefix, dumps_arguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call.

    Attributes:
        name: the function's name.
        arguments: its arguments as JSON text (an object; `{}` when the model gave none).
    """

    name: str
    arguments: str


def _held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (text that may become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _as_call(body: object) -> ToolCall | None:
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            parsed = decode_object_prefix(arguments)
        except ValueError:
            return None
        if parsed is None or arguments[parsed[1]:].strip():
            return None
        arguments = parsed[0]
    if not isinstance(arguments, dict):
        return None
    return ToolCall(body["name"], dumps_arguments(arguments))


class HermesToolParser:
    """Streaming splitter of one sequence's output into content and tool calls.

    Use `feed(delta)` for each text delta and `finish()` once at the end; each returns (content to send now,
    calls completed now). `pieces(delta)` / `finish_pieces()` give the same output in the order the model wrote
    it (content strings and ToolCalls interleaved), for APIs whose output keeps that order (Anthropic's content
    blocks, the Responses API's output items). `calls` lists every call so far.
    """

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._buffer = ""  # unparsed text: a held marker prefix, or a call body being read
        self._in_call = False
        self._held_space = ""

    def _content(self, text: str, out: list) -> None:
        pending = self._held_space + text
        body = pending.rstrip()
        if body:
            out.append(body)
        self._held_space = pending[len(body):]

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Take the next text delta.

        Returns:
            (content that can be sent now, possibly ""; calls completed by this delta).
        """
        return _split(self.pieces(text))

    def pieces(self, text: str) -> list[str | ToolCall]:
        """Take the next text delta.

        Returns:
            What can be sent now, in the model's order: content strings (never two in a row, never "") and calls.
        """
        self._buffer += text
        out: list[str | ToolCall] = []
        while self._buffer:
            if not self._in_call:
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = _held_prefix_len(self._buffer, OPEN)
                    self._content(self._buffer[:len(self._buffer) - keep], out)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                self._content(self._buffer[:at], out)
                self._buffer, self._in_call = self._buffer[at + len(OPEN):], True
                continue
            step = self._read_call()
            if step is None:  # the body or its closing tag is still coming
                break
            call, rest = step
            self._in_call = False
            if call is None:  # not a call after all: the markup is content
                self._content(OPEN, out)
                continue
            self._held_space = ""  # whitespace before a call is dropped
            self._buffer = rest
            self.calls.append(call)
            out.append(call)
        return _merged(out)

    def _read_call(self) -> tuple[ToolCall | None, str] | None:
        """The call whose body `_buffer` begins with: (call, text after `</tool_call>`), (None, _) when it is
        not a call, None while incomplete."""
        try:
            decoded = decode_object_prefix(self._buffer)
        except ValueError:
            return None, self._buffer
        if decoded is None:
            return None
        body, end = decoded
        tail = self._buffer[end:].lstrip(" \t\r\n")
        if len(tail) < len(CLOSE):
            return None if CLOSE.startswith(tail) else (None, self._buffer)
        if not tail.startswith(CLOSE):
            return None, self._buffer
        call = _as_call(body)
        return call, tail[len(CLOSE):]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the output: an unfinished call or held marker text is content, as written; held whitespace
        is sent only when there was no call.

        Returns:
            (the last content, possibly ""; no calls).
        """
        return _split(self.finish_pieces())

    def finish_pieces(self) -> list[str]:
        """`finish` as `pieces`: the last content as one string, or nothing."""
        out: list[str | ToolCall] = []
        rest = (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        if rest:
            self._content(rest, out)
        if not self.calls:
            out.append(self._held_space)
        self._held_space = ""
        return _merged(out)


def _merged(pieces: list[str | ToolCall]) -> list[str | ToolCall]:
    """`pieces` with adjacent strings joined and empty ones dropped."""
    merged: list[str | ToolCall] = []
    for piece in pieces:
        if isinstance(piece, str):
            if not piece:
                continue
            if merged and isinstance(merged[-1], str):
                merged[-1] += piece
                continue
        merged.append(piece)
    return merged


def _split(pieces: list[str | ToolCall]) -> tuple[str, list[ToolCall]]:
    """(all content joined, the calls) of ordered pieces."""
    return ("".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)])


def parse_pieces(text: str) -> list[str | ToolCall]:
    """A whole output text as ordered pieces (content strings and calls; the stream's rules: `HermesToolParser`)."""
    parser = HermesToolParser()
    return _merged(parser.pieces(text) + parser.finish_pieces())


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split a whole output text into content and calls (the stream's rules: `HermesToolParser`).

    Returns:
        (content, possibly ""; calls in order).
    """
    return _split(parse_pieces(text))
