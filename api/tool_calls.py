"""Which requests have tool calls read from their output, and the ids their calls get; for every API.

A request that gives tools (and does not set tool_choice "none") has its output split into content and calls by
the server's tool-call parser (`EngineConfig.tool_call_parser`; "auto" picks Hermes when the model's chat template
writes `<tool_call>`). Without tools, or with "none" (case T6), the output is content as the model wrote it.
"""

from __future__ import annotations

from collections.abc import Callable

from voltserve.parsers.hermes import OPEN, HermesToolParser, ToolCall

__all__ = ["ToolCall", "call_id", "parser_factory", "parser_name"]


def parser_name(config, engine) -> str:
    """The parser the server uses: the configured one, or for "auto" "hermes" when the chat template writes
    `<tool_call>` (its source holds the marker) and "none" otherwise."""
    name = getattr(config, "tool_call_parser", "auto")
    if name != "auto":
        return name
    source = getattr(engine.chat_template, "source", "") or ""
    return "hermes" if OPEN in source else "none"


def parser_factory(config, engine, tools: list | None, tool_choice) -> Callable[[], HermesToolParser] | None:
    """A constructor of one sequence's parser, or None when the output is plain content (no tools, tool_choice
    "none", or no parser for this model)."""
    if not tools or tool_choice == "none" or parser_name(config, engine) == "none":
        return None
    return HermesToolParser


def call_id(prefix: str, response_id: str, choice: int, index: int) -> str:
    """A call's id, unique as the response id is: e.g. `call_<response id's random part>_<choice>_<index>`."""
    return f"{prefix}{response_id.rsplit('_', 1)[-1].rsplit('-', 1)[-1]}_{choice}_{index}"
