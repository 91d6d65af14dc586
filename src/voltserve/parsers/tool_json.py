"""Reading the JSON body a model writes for a tool call, leniently about numbers JSON cannot hold.

Models write `inf`, `Infinity`, `NaN` or `1e999` for a number parameter; strict JSON has no such values and a
float would turn them into `Infinity` (not JSON) or `inf`. Such numbers are kept as the original text, as a JSON
string (case T9 of the API cases), so the call's arguments stay valid JSON and the other calls are unaffected.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# bare non-finite words outside strings: inf, -inf, +Infinity, NaN, nan, ...
_NON_FINITE = re.compile(r"[-+]?(?:infinity|inf|nan)(?![A-Za-z0-9_])", re.IGNORECASE)
_DECODER = json.JSONDecoder(
    parse_float=lambda text: float(text) if math.isfinite(float(text)) else text,
    parse_constant=lambda name: name,  # NaN, Infinity, -Infinity: Python's json extensions
)


def quote_non_finite(text: str) -> str:
    """`text` with every bare non-finite number word outside JSON strings wrapped in quotes (`inf` -> `"inf"`),
    so a JSON parser reads it as a string. Text inside strings (escapes included) is left as it is."""
    out, i, start, n = [], 0, 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':  # skip the string, honouring backslash escapes
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            continue
        if ch in "-+iInN":
            match = _NON_FINITE.match(text, i)
            prev = text[i - 1] if i else " "
            if match and not (prev.isalnum() or prev in "_."):
                out.append(text[start:i])
                out.append('"' + match.group() + '"')
                i = start = match.end()
                continue
        i += 1
    out.append(text[start:])
    return "".join(out)


MAX_DEPTH = 128  # deeper bodies are not calls: Python's json recursion and pydantic's serializer both have limits
_WS = " \t\r\n"
_STRUCTURE = re.compile(r'["{}\[\]]')  # what changes the scanner's state outside strings
_STRING_STOP = re.compile(r'["\\]')  # ... and inside them


class ObjectScanner:
    """Finds where a JSON object ends as its text arrives piece by piece, looking at each character once (the
    body of a tool call streamed a token at a time costs its length, not its length squared).

    Call `scan` with each next piece of text; it keeps the nesting depth and whether it is inside a string (and
    after a backslash) across calls. Only structure is checked: the closed object is then decoded
    (`decode_object`), which finds any other error.
    """

    def __init__(self) -> None:
        self.started = False
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """Read the next piece.

        Returns:
            The index in `text` just after the object's closing brace, or None while it is still open.

        Raises:
            ValueError: the text does not begin (after whitespace) with `{`, a bracket closes what it did not
                open at depth 0, or the object nests deeper than MAX_DEPTH.
        """
        i, n = 0, len(text)
        while i < n:
            if self.in_string:
                if self.escaped:
                    self.escaped, i = False, i + 1
                    continue
                stop = _STRING_STOP.search(text, i)
                if stop is None:
                    return None
                i = stop.start()
                if text[i] == "\\":
                    self.escaped = True
                else:
                    self.in_string = False
                i += 1
                continue
            if not self.started:
                if text[i] in _WS:
                    i += 1
                    continue
                if text[i] != "{":
                    raise ValueError("a tool call body must be a JSON object")
                self.started, self.depth, i = True, 1, i + 1
                continue
            found = _STRUCTURE.search(text, i)
            if found is None:
                return None
            i, ch = found.start(), found.group()
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                if self.depth > MAX_DEPTH:
                    raise ValueError(f"a tool call body nested deeper than {MAX_DEPTH}")
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            i += 1
        return None


def decode_object(text: str) -> Any:
    """Decode one JSON value that spans all of `text`, leniently about non-finite numbers (`quote_non_finite`;
    numbers that overflow a float are kept as their text).

    Raises:
        ValueError: not valid JSON even so, or too deeply nested for the json module.
    """
    try:
        return _DECODER.decode(quote_non_finite(text))  # JSONDecodeError is a ValueError
    except RecursionError as exc:
        raise ValueError("a tool call body nested too deeply") from exc


def decode_object_prefix(text: str, start: int = 0) -> tuple[dict, int] | None:
    """Decode the JSON object that begins at `text[start]` (after optional whitespace), as `ObjectScanner` and
    `decode_object` read it.

    Returns:
        (the object, index in `text` just after it), or None while the object is not closed yet.

    Raises:
        ValueError: the text there is not a JSON object (or not valid JSON once closed).
    """
    end = ObjectScanner().scan(text[start:])
    if end is None:
        return None
    return decode_object(text[start:start + end]), start + end


def dumps_arguments(arguments: Any) -> str:
    """A call's arguments as the JSON text OpenAI's `function.arguments` carries (non-ASCII kept as is)."""
    return json.dumps(arguments, ensure_ascii=False)
