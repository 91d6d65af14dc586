"""Pydantic models of the OpenAI Chat Completions and Completions protocols (plus vLLM's sampling extras).

Requests ignore unknown fields, as OpenAI does, and parse in strict mode so a wrong JSON type is a 400 rather
than a silent coercion ("5" is not an integer). Reference: https://platform.openai.com/docs/api-reference/chat
and https://platform.openai.com/docs/api-reference/completions.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_serializer, model_serializer,
)

from voltserve.errors import InvalidRequestError


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ObfuscationOptions(_Request):
    """The `stream_options` of a Responses request (`include_obfuscation` only), and the part that Chat
    Completions' and Completions' share with it. `include_obfuscation` is accepted and ignored: OpenAI pads each
    delta event with an `obfuscation` field against side channels that read payload sizes; this server adds none."""

    include_obfuscation: bool | None = None


class StreamOptions(ObfuscationOptions):
    """The `stream_options` of Chat Completions and Completions."""

    include_usage: bool = False


class ContentPart(_Request):
    """One part of a message's content list; only `text` parts are accepted by a text-only model."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


# A tool's name: OpenAI's rule for function names (Chat Completions, Responses;
# https://platform.openai.com/docs/api-reference/chat/create#chat-create-tools); Anthropic's client tools allow
# up to 128 characters (its Messages API's `Tool.name`: ^[a-zA-Z0-9_-]{1,128}$), e.g. MCP's `mcp__server__tool`
ToolName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
AnthropicToolName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]


class FunctionDefinition(_Request):
    """A Chat Completions tool's `function`; `parameters` is the JSON schema (an object) of its arguments. Other
    fields are kept: the chat template gets the tool as sent."""

    model_config = ConfigDict(extra="allow")

    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    """One of a chat request's `tools`; a type other than "function", or no `function`, is refused when the
    tools are read (`api.openai.chat`)."""

    model_config = ConfigDict(extra="allow")

    type: str = "function"
    function: FunctionDefinition | None = None


class SamplingFields(_Request):
    """Fields shared by both endpoints; None means "the server default"."""

    model: str
    stream: bool | None = False  # null = false (OpenAI's clients may send it)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # parsed so it can be refused, not silently ignored
    mm_processor_kwargs: dict[str, Any] | None = None  # parsed so they can be refused (case S7)
    media_io_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them: dicts of the fields sent (declared ones first); None
        without tools."""
        return [tool.model_dump(exclude_unset=True) for tool in self.tools] if self.tools else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


# ---- responses -------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens of the reasoning (`voltserve.parsers.reasoning`)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler):
        # `completion_tokens_details` only when a reasoning parser read the output: usage without one keeps
        # its shape
        data = handler(self)
        if self.completion_tokens_details is None:
            data.pop("completion_tokens_details", None)
        return data


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    """A tool call of an assistant message (`tool_calls[i]`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(BaseModel):
    """A tool call in a streamed delta: sent whole, once the model closed it (`index` orders the calls)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # vLLM's field: the text between `<think>` and `</think>`
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler):
        # `tool_calls` only when the model called tools, as OpenAI's messages; `reasoning_content` only when the
        # model reasoned (a model that does not think keeps OpenAI's shape)
        data = handler(self)
        for name in ("reasoning_content", "tool_calls"):
            if getattr(self, name) is None:
                data.pop(name, None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict:
        # OpenAI deltas carry only the fields that changed: {"content": "x"}, and {} on the finish chunk.
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "voltserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- parsing ---------------------------------------------------------------------------------------------

_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_path(loc: tuple) -> str | None:
    """`("messages", 0, "role")` -> "messages.0.role"; pydantic's union member tags ("str", "list[int]",
    "ContentPart") are left out so `param` names only request fields."""
    parts = [str(p) for p in loc if isinstance(p, int) or (_FIELD.match(p) and p not in _UNION_TAGS)]
    return ".".join(parts) or None


# pydantic's (jiter's) words for a `\\uXXXX` escape of a UTF-16 surrogate without its other half: "lone leading
# surrogate in hex escape" (a low one, or a high one followed by another escape), "unexpected end of hex escape"
# (a high one followed by no escape)
_SURROGATE_ERRORS = ("surrogate", "end of hex escape")
_SURROGATE_RULE = "surrogate escapes come in pairs: one of \\ud800-\\udbff, then one of \\udc00-\\udfff"


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what json.loads makes of an escape without its other half
# Bodies up to this size have the field holding the surrogate named: its search (json.loads, then a walk in Python,
# ~20 ms for 1 MiB of short strings) runs on the event loop; a larger body's 400 leaves the field unnamed
SURROGATE_SEARCH_MAX_BYTES = 1 << 20


def _entries(node: dict | list):
    """(key, child) of a dict's or list's children in document order: a dict's key (as a child) before its value."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, key
            yield key, value
    else:
        yield from enumerate(node)


def _find_lone_surrogate(root: Any) -> tuple[tuple, str] | None:
    """(the path, the surrogate) of the first string, key or value, in document order that holds a lone
    surrogate (a key's path ends with that key); None when there is none. Iterative (a body may nest deeper than
    Python's recursion limit) and linear: one iterator per open container, one path kept."""
    search = _LONE_SURROGATE.search
    if isinstance(root, str):
        found = search(root)
        return ((), found.group()) if found is not None else None
    if not isinstance(root, (dict, list)):
        return None
    path: list = []  # the keys from the root to the container whose iterator is on top
    stack = [_entries(root)]
    while stack:
        for key, node in stack[-1]:
            if isinstance(node, str):
                if (found := search(node)) is not None:
                    return (*path, key), found.group()
            elif isinstance(node, (dict, list)):
                path.append(key)
                stack.append(_entries(node))
                break
        else:  # this container is done
            stack.pop()
            if path:
                path.pop()
    return None


def _lone_surrogate_error(body: bytes) -> InvalidRequestError:
    """The 400 of a body whose JSON holds a `\\uXXXX` escape of a lone UTF-16 surrogate (no Unicode text can hold
    one: pydantic refuses it), naming the field that holds it (json.loads, which accepts lone surrogates, finds
    it; when it fails too, on a later syntax error, or the body is over `SURROGATE_SEARCH_MAX_BYTES`, the field
    stays unnamed)."""
    found = None
    if len(body) <= SURROGATE_SEARCH_MAX_BYTES:
        try:
            found = _find_lone_surrogate(json.loads(body))
        except (ValueError, RecursionError):
            pass
    if found is None or not found[0]:
        return InvalidRequestError("the request body holds an invalid Unicode escape: a lone surrogate "
                                   f"({_SURROGATE_RULE})", None)
    where, ch = found
    # a key may itself hold the surrogate, which no JSON encoder writes: escaped as the request spelled it
    param = ".".join(str(p).encode("utf-8", "backslashreplace").decode() for p in where)
    return InvalidRequestError(f"the request body holds an invalid Unicode escape at '{param}': \\u{ord(ch):04x} "
                               f"is a lone surrogate ({_SURROGATE_RULE})", param)


def parse_request(model: type[_Request], body: bytes) -> Any:
    """Parse a JSON body into `model`.

    Args:
        model: the request class.
        body: the raw HTTP body.

    Returns:
        An instance of `model`.

    Raises:
        InvalidRequestError: malformed JSON (param None; for an escape of a lone UTF-16 surrogate, the path of the
            string that holds it), or the first field error with `param` set to its path.
    """
    try:
        return model.model_validate_json(body or b"", strict=True)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid" and any(word in first["msg"] for word in _SURROGATE_ERRORS):
            raise _lone_surrogate_error(body) from None
        if first["type"] in ("json_invalid", "json_type") or not first["loc"]:
            raise InvalidRequestError(
                "request body is not a valid JSON object" + (f": {first['msg']}" if body else ""), None
            ) from None
        param = _param_path(first["loc"])
        if first["type"] == "missing":
            raise InvalidRequestError(f"missing required field '{param}'", param) from None
        raise InvalidRequestError(f"invalid value for '{param}': {first['msg']}", param) from None
