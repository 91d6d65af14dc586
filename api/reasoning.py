"""Whether a request's output has its reasoning read, and the parser of each of its sequences; for every API.

The server's reasoning parser (`EngineConfig.reasoning_parser`; "auto" picks qwen3 when the chat template mentions
`<think>`, so the default model, which does not think, is unchanged) reads the reasoning unless the request turned
thinking off (`chat_template_kwargs: {"enable_thinking": false}`, Qwen3's switch). The output starts inside the
reasoning when the prompt ends in an open `<think>` (DeepSeek-R1's template, Qwen3's thinking-only models) or with
the deepseek_r1 parser; else it may open `<think>` itself.

Under a grammar (a forced call or a JSON format) `<tool_call>` ends the reasoning too (case T1): it opens the
first call when the grammar makes calls, and is dropped before a JSON answer.

The parser counts the reasoning's tokens exactly where an end marker is one token of the tokenizer (`marker_ids`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from voltserve.parsers.hermes import OPEN as CALL_OPEN
from voltserve.parsers.output import OutputParser
from voltserve.parsers.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningParser

_PROMPT_TAIL_TOKENS = 8  # enough for `<think>\n` in any tokenizer
_END_MARKERS = (THINK_CLOSE, CALL_OPEN)


def parser_name(config, engine) -> str:
    """The configured reasoning parser, "auto" resolved: "qwen3" when the chat template's source mentions
    `<think>`, else "none"."""
    name = getattr(config, "reasoning_parser", "auto")
    if name != "auto":
        return name
    source = getattr(engine.chat_template, "source", "") or ""
    return "qwen3" if THINK_OPEN in source else "none"


def _prompt_opens_reasoning(tokenizer, prompt_ids: list[int]) -> bool:
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False).rstrip()
    return tail.endswith(THINK_OPEN)


def reasoning_mode(config, engine, prompt_ids: list[int], template_kwargs: dict | None = None) -> str | None:
    """How a request's output holds reasoning (`voltserve.grammar.REASONING_MODES`): None (it is not read),
    "inside" (the output starts in it) or "open" (the output may open `<think>`).

    Args:
        prompt_ids: the rendered prompt's ids (its end tells whether the template opened the reasoning).
        template_kwargs: the request's `chat_template_kwargs`; `enable_thinking: false` turns reasoning off.
    """
    name = parser_name(config, engine)
    if name == "none" or (template_kwargs or {}).get("enable_thinking", True) is False:
        return None
    if name == "deepseek_r1" or _prompt_opens_reasoning(engine.tokenizer, prompt_ids):
        return "inside"
    return "open"


def marker_ids(tokenizer) -> dict[str, int]:
    """The id of each reasoning end marker (`</think>`, `<tool_call>`) that is one token of `tokenizer` (one id
    that stands for exactly the marker's text), for `ReasoningParser`'s exact count; found once, cached on it.

    Args:
        tokenizer: a `voltserve.tokenizer.Tokenizer` (or a double with `encode` and `token_bytes`), or None.
    """
    if tokenizer is None:
        return {}
    cached = getattr(tokenizer, "_reasoning_marker_ids", None)
    if cached is None:
        cached = {}
        for marker in _END_MARKERS:
            ids = tokenizer.encode(marker, parse_special=True)
            if len(ids) == 1 and tokenizer.token_bytes(ids[0]) == marker.encode():
                cached[marker] = ids[0]
        tokenizer._reasoning_marker_ids = cached
    return cached


def output_parser_factory(mode: str | None, tool_parser: Callable | None, constrained: bool = False,
                          calls_follow: bool = False,
                          marker_ids: Mapping[str, int] | None = None) -> Callable[[], OutputParser] | None:
    """A constructor of one sequence's `OutputParser`, or None when the output is plain content.

    Args:
        mode: `reasoning_mode`'s answer.
        tool_parser: the tool-call parser's constructor (`api.structured.output_parser`), or None.
        constrained: a grammar constrains the answer: `<tool_call>` ends the reasoning too (case T1).
        calls_follow: the grammar may make calls: that `<tool_call>` opens the first one (kept for the tool
            parser); else it is dropped.
        marker_ids: the end markers that are one token (`marker_ids(tokenizer)`), for the exact token count.
    """
    if mode is None and tool_parser is None:
        return None

    def make() -> OutputParser:
        reasoning = None
        if mode is not None:
            reasoning = ReasoningParser(mode == "inside", CALL_OPEN if constrained else None, calls_follow,
                                        marker_ids)
        return OutputParser(reasoning, tool_parser() if tool_parser is not None else None)

    return make


__all__ = ["marker_ids", "output_parser_factory", "parser_name", "reasoning_mode"]
