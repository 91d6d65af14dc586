"""Reasoning text (`<think>` ... `</think>`) split out of a model's output as it streams: Qwen3, DeepSeek-R1 and
QwQ write their reasoning there before the answer (vLLM's `reasoning_content`,
https://docs.vllm.ai/en/latest/features/reasoning_outputs.html).

One parser serves the whole text and the stream alike (a whole text is one `feed` and `finish`), so the joined
streamed reasoning and content always equal the non-streamed ones. The rules:
- an output that begins with `<think>` starts inside the reasoning (the tag is dropped);
- without it the output starts inside the reasoning only when the prompt already opened it (`starts_inside`:
  DeepSeek-R1's template and Qwen3's thinking-only models write `<think>` at the end of the prompt), else the
  whole output is content;
- `</think>` ends the reasoning and is dropped; so does `implicit_end` (`<tool_call>`, case T1: under a JSON
  grammar the model may open a call without closing its reasoning first), which is kept as the first content
  when a tool-call parser reads the content next (`keep_implicit_end`: it opens the first call);
- text that may still become a marker (a trailing `<`, `</thi`) is held only until it cannot;
- an output that ends inside the reasoning (no end marker) is all reasoning.

It also counts the reasoning's tokens (`reasoning_tokens`, the usage's `reasoning_tokens`) from the tokens each
delta brings (`feed(text, num_tokens, token_ids)`): every token up to the end of the reasoning counts, the
`<think>` and `</think>` tokens included, and so does an EOS inside a reasoning that never ended; the implicit end
(`<tool_call>`) does not (it is the call's), and an output that opens with it before any reasoning counts 0. In the
delta that ends the reasoning the count is exact where the end marker is one token of the tokenizer (`marker_ids`)
found among the delta's ids; otherwise (a marker of several tokens, or no ids) that whole delta counts, and the
tokens of a multi-token implicit end count too (reasoning text until complete): exact at one token a delta but
for those.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_START, _REASONING, _CONTENT = range(3)


def _held_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`."""
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class ReasoningParser:
    """Streaming splitter of one sequence's output into reasoning and content.

    Args:
        starts_inside: the prompt opened the reasoning (the output starts in it without `<think>`).
        implicit_end: another marker that also ends the reasoning (`<tool_call>` under a JSON grammar), or None.
        keep_implicit_end: `implicit_end` is sent on as the first content (a tool-call parser reads it).
        marker_ids: the id of each end marker that is one token of the served tokenizer (`</think>` and
            `<tool_call>` are in Qwen3's); a marker missing here is counted by the delta (see `reasoning_tokens`).

    Use `feed(delta, num_tokens, token_ids)` for each text delta and `finish()` once at the end; each returns
    (reasoning, content) that can be sent now, either possibly "". Each character is looked at a bounded number of
    times.

    Attributes:
        ended_by: the marker that ended the reasoning, None while it has not ended (or never began).
        reasoning_tokens: the tokens of the reasoning: every token of the deltas fed before the reasoning ended
            (`<think>`, an EOS in a reasoning that never ends), and of the delta that ends it those before the end
            marker, plus the marker itself when it is `</think>` (the implicit end opens the content). Exact when
            that marker is one token (`marker_ids`) among the delta's `token_ids`; else the whole delta counts,
            content after the marker included (exact at one token a delta, but that the tokens of a multi-token
            implicit end count: reasoning text until complete). An output that begins with the
            implicit end, before any reasoning, counts 0. Tokens fed before the output showed whether it
            reasons count once it does, at the latest in `finish()`; 0 for an output that never reasons.
    """

    def __init__(self, starts_inside: bool = False, implicit_end: str | None = None, keep_implicit_end: bool = False,
                 marker_ids: Mapping[str, int] | None = None):
        self._starts_inside = starts_inside
        self._ends = (THINK_CLOSE,) if implicit_end is None else (THINK_CLOSE, implicit_end)
        self._keep = implicit_end if keep_implicit_end else None
        self._marker_ids = dict(marker_ids or {})
        self._state = _START
        self._held = ""  # text that may still become a marker
        self.ended_by: str | None = None  # the marker that ended the reasoning
        self.reasoning_tokens = 0
        self._pending = 0  # tokens fed while held as a possible `<think>`: reasoning or not, not known yet
        self._began = False  # the output wrote `<think>` or reasoning text

    @property
    def in_content(self) -> bool:
        """The reasoning is over (or the output does not reason): what comes next is content, passed on as it comes,
        and nothing more counts in `reasoning_tokens`."""
        return self._state == _CONTENT

    def feed(self, text: str, num_tokens: int = 0, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """Take the next text delta.

        Args:
            text: the delta's text.
            num_tokens: the tokens new in the delta (for `reasoning_tokens`; 0 counts nothing).
            token_ids: the ids of its last tokens, in order (all of them, or fewer: the tokens before them, e.g.
                of deltas with no text held back, count as before the marker); () = unknown.
        Returns:
            (reasoning, content) that can be sent now, each possibly "".
        """
        held = len(self._held)  # the first `held` characters of `text` came in earlier deltas
        text, self._held = self._held + text, ""
        if self._state == _START:
            if len(text) < len(THINK_OPEN) and THINK_OPEN.startswith(text):
                self._held = text
                self._pending += num_tokens
                return "", ""
            if text.startswith(THINK_OPEN):
                self._state, text, self._began = _REASONING, text[len(THINK_OPEN):], True
                held = 0  # a held beginning of `<think>` is gone with it
            else:
                self._state = _REASONING if self._starts_inside else _CONTENT
            num_tokens, self._pending = num_tokens + self._pending, 0
        if self._state == _CONTENT:
            return "", text
        return self._read_reasoning(text, held, num_tokens, token_ids)

    def _read_reasoning(self, text: str, held: int, num_tokens: int, token_ids: Sequence[int]) -> tuple[str, str]:
        hits = [(at, m) for m in self._ends if (at := text.find(m)) >= 0]
        if not hits:
            keep = _held_len(text, self._ends)
            self._held = text[len(text) - keep:]
            self.reasoning_tokens += num_tokens
            self._began = self._began or keep < len(text)
            return text[:len(text) - keep], ""
        at, marker = min(hits)
        self._state, self.ended_by = _CONTENT, marker
        if marker != THINK_CLOSE and at == 0 and not self._began:
            self.reasoning_tokens = 0  # the output opened with a call: whatever was counted is its tag's tokens
        else:
            self.reasoning_tokens += self._ending_tokens(text[held:], at >= held, marker, num_tokens, token_ids)
        content = text[at + len(marker):]
        return text[:at], (marker + content if marker == self._keep else content)

    def _ending_tokens(self, own: str, in_own: bool, marker: str, num_tokens: int, token_ids: Sequence[int]) -> int:
        """The reasoning's tokens of the delta that ends it (text `own`; `in_own`: the marker begins in it).

        Exact when the marker is one token seen in `token_ids` as often as its text is in `own` (so its first id
        is the marker that ended the reasoning, not one spelled in pieces or one in the content after it);
        else all `num_tokens`."""
        marker_id = self._marker_ids.get(marker)
        if marker_id is None or not in_own or marker_id not in token_ids \
                or token_ids.count(marker_id) != own.count(marker):
            return num_tokens
        after = len(token_ids) - token_ids.index(marker_id) - (marker == THINK_CLOSE)  # `</think>` is reasoning
        return max(num_tokens - after, 0)

    def finish(self) -> tuple[str, str]:
        """The end of the output: held text is reasoning inside the reasoning, else content (and so are the
        tokens still pending: an output that stopped on a possible `<think>`).

        Returns:
            (the last reasoning, the last content), each possibly "".
        """
        held, self._held = self._held, ""
        inside = self._state == _REASONING or (self._state == _START and self._starts_inside)
        if inside:
            self.reasoning_tokens += self._pending
        self._pending = 0
        return (held, "") if inside else ("", held)
