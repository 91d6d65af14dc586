"""Tool calls in the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, split out of a
model's output text as it streams (Hermes 2/3, Qwen2.5 and many Llama fine-tunes; their chat templates ask for
it: https://github.com/NousResearch/Hermes-Function-Calling).

One parser serves the whole text and the stream alike (a whole text is one `feed` and `finish`), so the joined
streamed content always equals the non-streamed content. The rules (cases T7, T8, T10 of the API cases):
- a call is emitted whole once its `</tool_call>` arrives: never a truncated `{`, however many calls a delta holds;
- the body is read as JSON up to its closing brace, so `</tool_call>` inside a string argument does not end it;
- text that may still become `<tool_call>` (a trailing `<`, `<tool`) is held only until it cannot;
- whitespace (space, tab, CR, LF) at the end of the content so far is held: it goes out with the next text, is
  dropped when a call follows, and at the end is sent only if there was no call;
- markup that does not parse as a call (not a JSON object with a string `name`, a lone surrogate escape, nesting
  deeper than `tool_json.MAX_DEPTH`) is content, as written; a body that closed when the output ended (no
  `</tool_call>` yet) is a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from voltserve.parsers.tool_json import ObjectScanner, decode_object, dumps_arguments

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


_WS = " \t\r\n"


def _held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (text that may become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _as_call(body: object) -> ToolCall | None:
    """The call a decoded body spells, or None: not an object with a string `name` and object arguments (given
    as `arguments` or `parameters`, as an object or as JSON text), or text that UTF-8 cannot carry (a lone
    surrogate escape)."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = decode_object(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    call = ToolCall(body["name"], dumps_arguments(arguments))
    try:
        (call.name + call.arguments).encode()
    except UnicodeEncodeError:
        return None
    return call


def _call_from(body: str) -> ToolCall | None:
    try:
        return _as_call(decode_object(body))
    except ValueError:
        return None


class HermesToolParser:
    """Streaming splitter of one sequence's output into content and tool calls.

    Use `feed(delta)` for each text delta and `finish()` once at the end; each returns (content to send now,
    calls completed now). `pieces(delta)` / `finish_pieces()` give the same output in the order the model wrote
    it (content strings and ToolCalls interleaved), for APIs whose output keeps that order (Anthropic's content
    blocks, the Responses API's output items). `calls` lists every call so far.

    Each character is looked at a bounded number of times (`ObjectScanner` keeps its place inside a call body),
    so a long call streamed a token at a time costs its length.
    """

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._marker = ""  # outside a call: the end of the text, which may still become `<tool_call>`
        self._body: list[str] | None = None  # inside a call: its body so far
        self._scanner: ObjectScanner | None = None
        self._closing: tuple[str, str] | None = None  # (the closed body, the text after it) until `</tool_call>`
        self._held: list[str] = []  # whitespace not sent yet

    def _content(self, text: str, out: list) -> None:
        """Content for `out`, its trailing whitespace held (sent with the next text, dropped before a call)."""
        body = text.rstrip(_WS)
        if not body:
            if text:
                self._held.append(text)
            return
        if self._held:
            out.append("".join(self._held))
            self._held = []
        out.append(body)
        if len(body) < len(text):
            self._held.append(text[len(body):])

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
        out: list[str | ToolCall] = []
        while text:
            if self._closing is not None:
                text = self._read_close(text, out)
            elif self._body is not None:
                text = self._read_body(text, out)
            else:
                text = self._read_content(text, out)
        return _merged(out)

    def _read_content(self, text: str, out: list) -> str:
        text, self._marker = self._marker + text, ""
        at = text.find(OPEN)
        if at < 0:
            keep = _held_prefix_len(text, OPEN)
            self._content(text[:len(text) - keep], out)
            self._marker = text[len(text) - keep:]
            return ""
        self._content(text[:at], out)
        self._body, self._scanner = [], ObjectScanner()
        return text[at + len(OPEN):]

    def _read_body(self, text: str, out: list) -> str:
        try:
            end = self._scanner.scan(text)
        except ValueError:
            return self._not_a_call("".join(self._body) + text, out)
        if end is None:
            self._body.append(text)
            return ""
        self._body.append(text[:end])
        self._closing, self._body, self._scanner = ("".join(self._body), ""), None, None
        return text[end:]

    def _read_close(self, text: str, out: list) -> str:
        body, after = self._closing
        after += text
        tail = after.lstrip(_WS)
        if len(tail) < len(CLOSE) and CLOSE.startswith(tail):
            self._closing = (body, after)
            return ""
        self._closing = None
        call = _call_from(body) if tail.startswith(CLOSE) else None
        if call is None:
            return self._not_a_call(body + after, out)
        self._held = []  # whitespace before a call is dropped
        self.calls.append(call)
        out.append(call)
        return tail[len(CLOSE):]

    def _not_a_call(self, rest: str, out: list) -> str:
        """The `<tool_call>` just read opens no call: it is content, and what followed it is read again."""
        self._body = self._scanner = self._closing = None
        self._content(OPEN, out)
        return rest

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the output: an unfinished call or held marker text is content, as written; held whitespace
        is sent only when there was no call.

        Returns:
            (the last content, possibly ""; no calls).
        """
        return _split(self.finish_pieces())

    def finish_pieces(self) -> list[str | ToolCall]:
        """`finish` as `pieces`. A call whose body closed but whose `</tool_call>` never came (the output ended
        first) is still a call."""
        out: list[str | ToolCall] = []
        rest = self._marker
        if self._closing is not None:
            body, after = self._closing
            call = _call_from(body)
            if call is not None:  # only whitespace or the start of `</tool_call>` followed it
                self._held = []
                self.calls.append(call)
                out.append(call)
            else:
                rest = OPEN + body + after
        elif self._body is not None:
            rest = OPEN + "".join(self._body)
        self._marker, self._body, self._scanner, self._closing = "", None, None, None
        self._content(rest, out)
        if not self.calls:
            out.append("".join(self._held))
        self._held = []
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
