"""Pydantic models of the OpenAI Responses API, text and function calls: the request, the response object, the
stream events.

Requests parse like `protocol.py`'s (strict types, unknown fields ignored) and share its sampling fields.
Field names and required fields follow the API reference (https://platform.openai.com/docs/api-reference/responses)
and the `openai` SDK's `types/responses` models, which clients validate against.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.openai.protocol import ChatTokenLogprob, ContentPart, ObfuscationOptions, SamplingFields, ToolName

# ---- request ---------------------------------------------------------------------------------------------

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the `include` value that asks for the output's logprobs
# The values `include` takes: OpenAI's (the `openai` SDK's `ResponseIncludable`, in its order), any other a 400.
# Only LOGPROBS_INCLUDE is served; the others ask for data of items this server refuses before they could occur
# (file_search / web_search / code_interpreter tools, computer_call_output items, input images) or that it has
# none of (reasoning items carry no `encrypted_content`: nothing of them is kept or read back), so they are
# accepted and change nothing.
Includable = Literal[
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", LOGPROBS_INCLUDE,
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputItem(_Request):
    """One item of a list `input`: a message (`type` "message", the default), an earlier function call
    ("function_call") or its result ("function_call_output"). Any other item type (reasoning, ...) is parsed just
    far enough to be refused by name. Which fields an item type requires is checked when the item is converted.

    Attributes:
        type: the item type.
        role: a message's author.
        content: a message's text, or a list of parts (`input_text` / `output_text` with `text`).
        call_id: a function call's id, which its output names.
        name, arguments: a function call's function and its arguments (JSON text).
        output: a function call's result: text, or a list of `input_text` parts.
    """

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[ContentPart] | str | None = None  # the list first: a bad part's error names the part
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: list[ContentPart] | str | None = None


class FunctionTool(_Request):
    """One of `tools`. Only function tools are served; any other type (web_search, file_search, mcp, ...) is
    parsed just far enough to be refused by name, so `name`'s presence is checked when the tools are converted.

    Attributes:
        type: the tool type ("function").
        name: the function's name (`ToolName`'s rule).
        description: what it does, for the model.
        parameters: the JSON schema of its arguments.
        strict: accepted and echoed; free calls are not held to the schema, forced ones always are
            (`api.structured`).
    """

    type: str
    name: ToolName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Request):
    """`text.format`: "text", "json_object" or "json_schema" (with its `schema`; `name` and `strict` are taken
    as given: the grammar always holds the output to the schema)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)  # echoed as sent (name, strict, ...)

    type: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    """POST /v1/responses (https://platform.openai.com/docs/api-reference/responses/create).

    Attributes:
        input: one user message as a string, or a list of input items (the list first, so a bad item's error
            names the item's field rather than "not a string").
        instructions: a system message placed before the input.
        max_output_tokens: output token limit (None = the rest of the context window).
        text: output format: {"format": {"type": "text" | "json_object" | "json_schema", ...}} (JSON through a
            grammar, `api.structured`).
        tools: function tools, rendered into the prompt by the chat template; the model's calls are read from its
            output by the server's tool-call parser (`api.tool_calls`).
        tool_choice: "auto" (the default), "none" (the output is all text, case T6), "required" or a named
            function (held to a grammar, `api.structured`).
        parallel_tool_calls: false keeps only the model's first call; null means the default, true (case T3).
        previous_response_id, conversation, prompt, background: refused (400): this server stores no responses,
            conversations or prompts, and answers in the foreground.
        truncation: "auto" drops input items from the start of the conversation until the prompt fits the
            context window (`api.openai.responses_truncation`); "disabled" / null: such a request is a 400.
        store, metadata: accepted; nothing is stored, metadata is echoed.
        include: extra output data, each one of OpenAI's values (`Includable`; any other is a 400 naming its
            element, `include.<i>`); "message.output_text.logprobs" (`LOGPROBS_INCLUDE`) returns each output text's
            logprobs, the other values change nothing (`Includable` says why).
        top_logprobs: 0-20 alternatives listed with each token's logprob (with that `include` only, as OpenAI's);
            echoed by the response object either way.
        stream_options: `{"include_obfuscation": bool}`, with `stream: true` only (`check_stream_options`);
            accepted and ignored (`ObfuscationOptions`).
    The sampling fields (temperature, top_p, seed, vLLM's top_k, ...) are `SamplingFields`'; Chat's `n` and
    `max_tokens` are not Responses fields, so they are ignored like any unknown field.
    """

    n: ClassVar[None] = None
    max_tokens: ClassVar[None] = None
    input: list[InputItem] | str
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    include: list[Includable] | None = None
    top_logprobs: int | None = None
    stream_options: ObfuscationOptions | None = None  # Responses' own: no include_usage (the usage is always sent)


# ---- response object -------------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseError(BaseModel):
    """Why a response failed (`status` "failed"): every server-side failure is OpenAI's "server_error"."""

    code: Literal["server_error"] = "server_error"
    message: str


class OutputText(BaseModel):
    """A text content part of an output message (no annotations: always empty).

    Attributes:
        logprobs: with `include` "message.output_text.logprobs", one entry per token of `text` (token, logprob,
            bytes, top_logprobs: Chat Completions' entries); else empty.
    """

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class EventTopLogprob(BaseModel):
    """One alternative of a streamed token's logprob (the text events' shape: no bytes)."""

    token: str
    logprob: float


class EventLogprob(BaseModel):
    """A token's logprob in a response.output_text.delta / .done event (the `openai` SDK's
    `ResponseTextDeltaEvent.Logprob`: token, logprob, top_logprobs; no bytes)."""

    token: str
    logprob: float
    top_logprobs: list[EventTopLogprob]

    @classmethod
    def of(cls, entry: ChatTokenLogprob) -> EventLogprob:
        """The event form of an output_text logprob entry."""
        return cls(token=entry.token, logprob=entry.logprob,
                   top_logprobs=[EventTopLogprob(token=t.token, logprob=t.logprob) for t in entry.top_logprobs])


class OutputMessage(BaseModel):
    """An output item holding the assistant's text. `id` is "msg_..."; `status` is the response's, or "completed"
    for a message that a function call followed."""

    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    """An output item holding one function call, sent once the model wrote it whole.

    Attributes:
        id: the item's id, "fc_...".
        call_id: the id that the call's `function_call_output` names, "call_...".
        name, arguments: the function and its arguments (JSON text of an object).
        status: "in_progress" only in the `response.output_item.added` event, else "completed".
    """

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(BaseModel):
    """A reasoning item's text: what the model wrote between `<think>` and `</think>`."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """An output item holding the model's reasoning, before the message or calls it led to. `id` is "rs_...";
    `summary` is always empty (this server does not summarise); `content` holds the whole reasoning text."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCallItem | ReasoningItem, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # required by the SDK's model; this server has no explicit cache writes


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens of the reasoning (`voltserve.parsers.reasoning`); 0 when none is read


class ResponseUsage(BaseModel):
    """Token counts of one response (input = prompt, output = generated)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, cached_tokens: int, output_tokens: int) -> ResponseUsage:
        """Usage from the three counts the engine reports."""
        return cls(input_tokens=input_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                   output_tokens=output_tokens, total_tokens=input_tokens + output_tokens)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None = None


class ResponsesResponse(BaseModel):
    """The response object, returned whole by a non-streamed request and carried by the `response.*` events.

    Attributes:
        id: "resp_..."; nothing is stored under it.
        created_at: unix seconds.
        status: "in_progress" while streaming, then "completed", or "incomplete" when output was cut
            (`incomplete_details.reason` "max_output_tokens" for a length finish).
        output: the output items in the order the model wrote them: message items and function calls (empty
            until the first starts).
        usage: null until the response ends.
        The other fields echo the request's settings, with the defaults applied (temperature, top_p,
        top_logprobs 0).
    """

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[FunctionTool]
    top_logprobs: int
    top_p: float
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str]


# ---- stream events (https://platform.openai.com/docs/api-reference/responses-streaming) ------------------


class _Event(BaseModel):
    """What every stream event carries: its `type` (also its SSE event name; each subclass narrows it) and its
    `sequence_number`, which counts the stream's events from 0."""

    type: str
    sequence_number: int


class ResponseEvent(_Event):
    """A lifecycle event carrying the whole response object."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponsesResponse


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int = 0
    item: OutputItem


class _ContentEvent(_Event):
    """An event about one content part: `content_index` of output item `output_index`, whose id is `item_id`."""

    item_id: str
    output_index: int = 0
    content_index: int = 0


class ContentPartEvent(_ContentEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText


class OutputTextDeltaEvent(_ContentEvent):
    """New text of the message; on the per-token path its bytes are assembled around the text (`responses.py`)."""

    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[EventLogprob] = Field(default_factory=list)  # of the delta's tokens, when asked


class OutputTextDoneEvent(_ContentEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[EventLogprob] = Field(default_factory=list)  # of the whole text's tokens, when asked


class ReasoningTextDeltaEvent(_ContentEvent):
    """New reasoning text of the reasoning item `item_id`."""

    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    delta: str


class ReasoningTextDoneEvent(_ContentEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    text: str


class _ArgumentsEvent(_Event):
    """An event about the arguments of the function call item `item_id`, output item `output_index`."""

    item_id: str
    output_index: int


class FunctionCallArgumentsDeltaEvent(_ArgumentsEvent):
    """The call's arguments (this server sends them whole, in one delta, once the model closed the call)."""

    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class FunctionCallArgumentsDoneEvent(_ArgumentsEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    name: str  # in the API reference's event; the `openai` SDK's model (3.x) ignores it
    arguments: str


class ErrorEvent(_Event):
    """An error after the stream began (the status line is already out). `code` is the error table's code, else
    its OpenAI type (`api.errors.ErrorKind.reason`)."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None = None
