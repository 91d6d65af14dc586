"""One sequence's output read by the reasoning parser first and the tool-call parser next: reasoning text, then
content and calls in the order the model wrote them. Either parser may be absent (plain content passes)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby

from voltserve.parsers.hermes import HermesToolParser, ToolCall
from voltserve.parsers.reasoning import ReasoningParser


@dataclass(frozen=True)
class Reasoning:
    """A piece of reasoning text (what the model wrote between `<think>` and `</think>`)."""

    text: str


Piece = Reasoning | str | ToolCall
Delta = tuple[str, int] | tuple[str, int, int]  # (text, tokens new in it[, the end of its ids in the output's])


class OutputParser:
    """Streaming splitter of one sequence's output into reasoning, content and tool calls.

    Args:
        reasoning: the sequence's reasoning parser, or None (no reasoning is read).
        tools: its tool-call parser, or None (content is plain text).

    `pieces(delta)` / `finish_pieces()` give what can be sent now in the model's order (Reasoning pieces, content
    strings and ToolCalls; never "", never two strings or two Reasonings in a row); `feed` / `finish` the same
    as (reasoning, content, calls). `calls` lists every call so far; `reasoning_tokens` counts the reasoning's
    tokens from each delta's `num_tokens` and `token_ids` (see `ReasoningParser`).
    """

    def __init__(self, reasoning: ReasoningParser | None = None, tools: HermesToolParser | None = None):
        self._reasoning, self._tools = reasoning, tools

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    @property
    def reasoning_tokens(self) -> int:
        """The reasoning's tokens so far (`ReasoningParser.reasoning_tokens`); 0 without a reasoning parser."""
        return self._reasoning.reasoning_tokens if self._reasoning is not None else 0

    @property
    def in_content(self) -> bool:
        """The reasoning is over, or there is none to read (`ReasoningParser.in_content`): how the next text is cut
        into deltas no longer changes `reasoning_tokens`."""
        return self._reasoning is None or self._reasoning.in_content

    def _after_reasoning(self, reasoning: str, content: str) -> list[Piece]:
        out: list[Piece] = [Reasoning(reasoning)] if reasoning else []
        if content:
            out += self._tools.pieces(content) if self._tools is not None else [content]
        return out

    def pieces(self, text: str, num_tokens: int = 0, token_ids: Sequence[int] = ()) -> list[Piece]:
        """Take the next text delta (`num_tokens`: the tokens new in it, `token_ids`: the ids of its last ones,
        for `reasoning_tokens`: `ReasoningParser.feed`); returns the pieces that can be sent now."""
        if self._reasoning is None:
            return self._after_reasoning("", text)
        return self._after_reasoning(*self._reasoning.feed(text, num_tokens, token_ids))

    def finish_pieces(self) -> list[Piece]:
        """The end of the output: what the parsers still held (see theirs)."""
        out = self._after_reasoning(*self._reasoning.finish()) if self._reasoning is not None else []
        if self._tools is not None:
            out += self._tools.finish_pieces()
        return _merged(out)

    def feed(self, text: str, num_tokens: int = 0, token_ids: Sequence[int] = ()) -> tuple[str, str, list[ToolCall]]:
        """`pieces` as (reasoning, content, calls), each possibly empty."""
        return split(self.pieces(text, num_tokens, token_ids))

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """`finish_pieces` as (reasoning, content, calls)."""
        return split(self.finish_pieces())


def _merged(pieces: list[Piece]) -> list[Piece]:
    """`pieces` with adjacent strings (and adjacent Reasonings) joined, each run once (linear: a whole output fed
    delta by delta is a piece a token)."""
    merged: list[Piece] = []
    for kind, run in groupby(pieces, key=type):
        if kind is str:
            merged.append("".join(run))
        elif kind is Reasoning:
            merged.append(Reasoning("".join(p.text for p in run)))
        else:
            merged.extend(run)
    return merged


def split(pieces: list[Piece]) -> tuple[str, str, list[ToolCall]]:
    """(reasoning joined, content joined, calls) of ordered pieces."""
    return ("".join(p.text for p in pieces if isinstance(p, Reasoning)),
            "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)])


def parse_output(parser: OutputParser, text: str) -> list[Piece]:
    """A whole output text through a fresh `parser` as ordered pieces (the stream's rules)."""
    return parse_deltas(parser, [(text, 0)])


def with_ids(deltas: Iterable[Delta], token_ids: Sequence[int]) -> Iterator[tuple[str, int, Sequence[int]]]:
    """(text, tokens new in it, its ids) of each delta: a delta's ids run from the previous one's end to its own
    in `token_ids` (none for a delta without an end)."""
    start = 0
    for text, num_tokens, *end in deltas:
        stop = end[0] if end else start
        yield text, num_tokens, token_ids[start:stop]
        start = stop


def parse_deltas(parser: OutputParser, deltas: Iterable[Delta], token_ids: Sequence[int] = ()) -> list[Piece]:
    """A whole output through a fresh `parser`, fed delta by delta as the stream feeds it, as ordered pieces:
    the same pieces and `parser.reasoning_tokens` as streamed.

    Args:
        deltas: (text, tokens new in it[, the end of its ids in `token_ids`]) of each delta, in order
            (`api.openai.common.SequenceResult.deltas`).
        token_ids: the output's ids (`with_ids`).
    """
    pieces: list[Piece] = []
    for text, num_tokens, ids in with_ids(deltas, token_ids):
        pieces += parser.pieces(text, num_tokens, ids)
    return _merged(pieces + parser.finish_pieces())
