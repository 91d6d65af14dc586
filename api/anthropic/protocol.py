"""Pydantic models of Anthropic's Messages API, text only (https://docs.anthropic.com/en/api/messages and
https://docs.anthropic.com/en/docs/build-with-claude/streaming).

Requests ignore unknown fields (`cache_control`, `metadata`, `service_tier`, ...) and parse in strict mode, as the
OpenAI requests do (`api.openai.protocol.parse_request`), so a wrong JSON type is a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(_Request):
    """One block of a message's (or the system prompt's) content. Only `text` blocks reach the prompt; `thinking`
    and `redacted_thinking` blocks are dropped (Anthropic drops earlier turns' thinking); every other type is
    refused with a 400 naming it."""

    type: str
    text: str | None = None


class InputMessage(_Request):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] | str  # the list first: a bad block's error names the block


class ThinkingConfig(_Request):
    type: str
    budget_tokens: int | None = None


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str
    messages: list[InputMessage]
    system: list[ContentBlock] | str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: dict[str, Any] | None = None  # parsed so that a structured output format can be refused
    output_format: dict[str, Any] | None = None  # (its beta spelling)


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. `max_tokens` is required, as in Anthropic's API; `top_k` 0 or absent = all tokens."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False  # null = false
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class MessageUsage(BaseModel):
    """Token counts. `input_tokens` leaves out the prompt tokens read from the prefix cache, which Anthropic
    reports apart as `cache_read_input_tokens` (prompt length = input_tokens + cache_read_input_tokens)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence"] | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int
