"""Pydantic models of Anthropic's Messages API: text and client tools (https://docs.anthropic.com/en/api/messages,
https://docs.anthropic.com/en/docs/build-with-claude/streaming and
https://docs.anthropic.com/en/docs/build-with-claude/tool-use).

Requests ignore unknown fields (`cache_control`, `metadata`, `service_tier`, ...) and parse in strict mode, as the
OpenAI requests do (`api.openai.protocol.parse_request`), so a wrong JSON type is a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from api.openai.protocol import AnthropicToolName


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(_Request):
    """One block of a message's (or the system prompt's) content. `text` blocks reach the prompt, and so do
    `tool_use` (an assistant's earlier call: `id`, `name`, `input`) and `tool_result` (its answer, in a user
    message: `tool_use_id`, `content`, `is_error`) blocks; `thinking` and `redacted_thinking` blocks are dropped
    (Anthropic drops earlier turns' thinking); every other type is refused with a 400 naming it."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    # a tool_result's: a string or text blocks (a dict parses too, so that another block type that carries an
    # object here, e.g. a server tool's result, is refused by its type rather than by this field)
    content: list[ContentBlock] | str | dict[str, Any] | None = None
    is_error: bool | None = None


class InputMessage(_Request):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] | str  # the list first: a bad block's error names the block


class Tool(_Request):
    """A client tool: `name`, `description`, `input_schema` (a JSON schema). A server tool (a `type` such as
    "web_search_20250305") is refused with a 400."""

    name: AnthropicToolName
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of client tools: checked with the type
    type: str | None = None  # absent or "custom" for a client tool


class ToolChoice(_Request):
    """How the model may use the tools: "auto", "none", "any" (at least one call) or "tool" (a call of `name`);
    the forced ones are held to it by a grammar (`api.structured`)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Request):
    type: str
    budget_tokens: int | None = None


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str
    messages: list[InputMessage]
    system: list[ContentBlock] | str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
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


class ThinkingBlock(BaseModel):
    """The model's reasoning (its `<think>` text), ahead of its text and tool_use blocks. `signature` is always
    empty: this server does not sign reasoning (a client sends the block back as written; it is dropped)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(BaseModel):
    """A call the model made: `input` is its arguments as an object."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


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
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


class ModelInfo(BaseModel):
    """A model as Anthropic's `GET /v1/models` lists it (https://docs.anthropic.com/en/api/models-list)."""

    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str  # RFC 3339
    lifecycle: Literal["active"] = "active"


class ModelInfoList(BaseModel):
    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
