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


def _object_end(text: str, start: int) -> int | None:
    """Index just after the `}` that closes the object opened at `text[start]`, None while it is unclosed."""
    depth, i, n = 0, start, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def decode_object_prefix(text: str, start: int = 0) -> tuple[dict, int] | None:
    """Decode the JSON object that begins at `text[start]` (after optional whitespace), leniently about
    non-finite numbers (`quote_non_finite`; numbers that overflow a float are kept as their text).

    Returns:
        (the object, index in `text` just after it), or None while the object is not closed yet.

    Raises:
        ValueError: the text there is not a JSON object (or not valid JSON once closed).
    """
    while start < len(text) and text[start] in " \t\r\n":
        start += 1
    if start == len(text):
        return None
    if text[start] != "{":
        raise ValueError("a tool call body must be a JSON object")
    end = _object_end(text, start)
    if end is None:
        return None
    value = _DECODER.decode(quote_non_finite(text[start:end]))  # JSONDecodeError is a ValueError
    return value, end


def dumps_arguments(arguments: Any) -> str:
    """A call's arguments as the JSON text OpenAI's `function.arguments` carries (non-ASCII kept as is)."""
    return json.dumps(arguments, ensure_ascii=False)
