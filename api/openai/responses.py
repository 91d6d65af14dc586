"""POST /v1/responses: the OpenAI Responses API, text and function calls
(https://platform.openai.com/docs/api-reference/responses).

The input becomes chat messages and takes the chat path to prompt ids (`chat_prompt.messages_prompt_ids`: the chat
template, special-token text kept plain (case S6), the billing-header line dropped from system text (case S2)):
message items are messages (a developer message a system one; `instructions` and the system / developer items
that open the input one system message), function_call items the tool calls of an assistant message,
function_call_output items tool messages. Function `tools` are rendered by the chat template, and with tool_choice
"auto" the server's tool-call parser (`api.tool_calls`) splits the output into message items and function_call
items, in the order the model wrote them. Nothing is stored: `previous_response_id` is refused and there is no GET
/v1/responses/{id}.

A streamed response is a sequence of named events, `event: <type>\\ndata: <json>\\n\\n` (`sse.typed_frame`), whose
`sequence_number` counts from 0 (https://platform.openai.com/docs/api-reference/responses-streaming):
response.created, response.in_progress, response.output_item.added, response.content_part.added, then one
response.output_text.delta per text delta, then response.output_text.done, response.content_part.done,
response.output_item.done and response.completed (response.incomplete when max_output_tokens cut the output),
whose response carries the usage. No `data: [DONE]`. An error after the stream began is an `error` event.
With `include: ["message.output_text.logprobs"]` (`top_logprobs` alternatives each), the output_text parts carry
their tokens' logprobs, and each text delta event those of its delta (`ResponseEvents`).

With the tool-call parser, a message item is added when its first text is ready (never, when the model only
calls), and each call, once the model closed it, closes the open message item (output_text.done,
content_part.done, output_item.done) and is sent as its own item: response.output_item.added (status
"in_progress", arguments ""), response.function_call_arguments.delta (the whole arguments),
response.function_call_arguments.done, response.output_item.done. Text after a call opens a new message item.
`output_index` numbers the items in that order. An output with no call is one message item, as without tools,
but under a forced tool choice (whose text can only be an unfinished call) there is none.

With a reasoning parser (`api.reasoning`), the model's reasoning is a `reasoning` item ahead of the others
(`summary` empty, `content` [{"type": "reasoning_text", "text"}]), streamed as response.output_item.added, one
response.reasoning_text.delta per reasoning delta, response.reasoning_text.done and response.output_item.done.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import replace

import orjson
from quart import Blueprint

from api import sse
from api.errors import ErrorKind
from api.openai.chat_prompt import (
    check_mm_kwargs, content_text, messages_prompt_ids, strip_billing_header, template_role,
)
from api.openai.common import (
    NewTokens, add_request, check_stream_options, check_top_logprobs, collect, drive_stream, json_response,
    logprob_entries, request_body, sampling_params, sse_response,
)
from api.openai.protocol import ChatTokenLogprob, parse_request
from api.openai.responses_protocol import (
    LOGPROBS_INCLUDE, ContentPartEvent, ErrorEvent, EventLogprob, FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent, FunctionCallItem, IncompleteDetails, OutputItemEvent, OutputMessage, OutputText,
    OutputTextDeltaEvent, OutputTextDoneEvent, OutputTokensDetails, ReasoningItem, ReasoningText,
    ReasoningTextDeltaEvent, ReasoningTextDoneEvent, ResponseError, ResponseEvent, ResponsesRequest,
    ResponsesResponse, ResponseUsage,
)
from api.state import get_state
from api.reasoning import reasoning_mode
from api.structured import Constraint, request_grammar, sequence_parser
from api.tool_calls import ToolCall, call_id, parser_factory
from voltserve.parsers.output import Reasoning, with_ids
from voltserve.errors import InvalidRequestError
from voltserve.grammar import check_parameters
from voltserve.request import RequestOutput, SamplingParams, TokenLogprob

bp = Blueprint("openai_responses", __name__)
TEXT_PART_TYPES = frozenset({"input_text", "output_text"})  # an earlier response's output may come back as input
OUTPUT_PART_TYPES = frozenset({"input_text"})  # a function_call_output's parts
# the fields each served input item type requires
REQUIRED_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                   "function_call_output": ("call_id", "output")}


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's instructions and input as chat messages (`{"role", "content": str, ...}` dicts).

    `instructions` and the system and developer message items that lead the input (a developer message is a system
    one: `template_role`) are one system message placed first, their texts joined with a blank line, instructions
    first: templates that take a single leading system message render them all. A string `input` is one user
    message; a list holds message items, whose text parts join with newlines as Chat Completions joins them (a
    system or developer item after the first other item stays a system message of its own); function_call items,
    each a tool
    call (`{"id": call_id, "type": "function", "function": {"name", "arguments"}}`) of the assistant message
    before it, or of a new one (content "") when the message before is not the assistant's; and
    function_call_output items, each a tool message (`{"role": "tool", "tool_call_id", "content"}`).

    Raises:
        InvalidRequestError: an empty input list, or one of reasoning items only; an item of another type (not
            supported yet; reasoning items, an earlier response's output sent back, are dropped: the template gets
            no reasoning of past turns, as Chat Completions clients do not send it); an item without a field its
            type requires; a non-text part.
    """
    messages = []
    if req.instructions:
        messages.append({"role": "system", "content": strip_billing_header(req.instructions)})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise InvalidRequestError("'input' must contain at least one item", param="input")
    for i, item in enumerate(req.input):
        if item.type == "reasoning":
            continue
        required = REQUIRED_FIELDS.get(item.type)
        if required is None:
            raise InvalidRequestError(f"input items of type '{item.type}' are not supported yet: this server takes "
                                      "messages, function calls and function call outputs", param=f"input.{i}")
        for name in required:
            if getattr(item, name) is None:
                raise InvalidRequestError(f"missing required field 'input.{i}.{name}'", param=f"input.{i}.{name}")
        if item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            output = content_text(item.output, f"input.{i}.output", OUTPUT_PART_TYPES)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            text = content_text(item.content, f"input.{i}.content", TEXT_PART_TYPES)
            role = template_role(item.role)
            messages.append({"role": role, "content": strip_billing_header(text) if role == "system" else text})
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequestError("'input' holds no message, function call or function call output", param="input")
    return _one_leading_system(messages)


def _one_leading_system(messages: list[dict]) -> list[dict]:
    """`messages` with its leading system messages joined into one (their non-empty texts with a blank line
    between)."""
    lead = next(k for k, m in enumerate(messages) if m["role"] != "system")
    if lead < 2:
        return messages
    system = {"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead] if m["content"])}
    return [system, *messages[lead:]]


def template_tools(req: ResponsesRequest) -> list[dict]:
    """The request's function tools as the chat template takes them, Chat Completions' shape
    (`{"type": "function", "function": {"name", "description", "parameters"}}`, the absent fields left out).

    Raises:
        InvalidRequestError: a tool of another type (web_search, file_search, mcp, ...: not supported yet), a
            function tool without a name, or one whose parameters are not an object schema.
    """
    tools = []
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise InvalidRequestError(f"tools of type '{tool.type}' are not supported yet: this server serves "
                                      "function tools only", param=f"tools.{i}.type")
        if tool.name is None:
            raise InvalidRequestError(f"missing required field 'tools.{i}.name'", param=f"tools.{i}.name")
        function = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.parameters is not None:
            check_parameters(tool.name, tool.parameters, f"tools.{i}.parameters")
            function["parameters"] = tool.parameters
        tools.append({"type": "function", "function": function})
    return tools


def _params(req: ResponsesRequest) -> SamplingParams:
    """The request's sampling parameters, after refusing the features that are not served (each a 400 naming
    its field; `stream_options` without `stream`, as OpenAI's)."""
    check_stream_options(req)
    stored = {"previous_response_id": "responses", "conversation": "conversations", "prompt": "prompts"}
    for name, what in stored.items():
        if getattr(req, name) is not None:
            raise InvalidRequestError(f"{name} is not supported: this server does not store {what}", param=name)
    if req.background:
        raise InvalidRequestError("background responses are not supported: this server answers in the foreground",
                                  param="background")
    check_top_logprobs(req.top_logprobs)
    logprobs = (req.top_logprobs or 0) if LOGPROBS_INCLUDE in (req.include or ()) else None
    return sampling_params(req, max_tokens=req.max_output_tokens, max_tokens_param="max_output_tokens",
                           logprobs=logprobs)


def constraint(req: ResponsesRequest, tools: list[dict], tools_parsed: bool) -> Constraint:
    """The request's tool_choice, parallel_tool_calls and text.format as a `Constraint` (`tools`: the function
    tools as `template_tools` gives them).

    Raises:
        InvalidRequestError: a malformed tool_choice or text.format.
    """
    choice, forced = req.tool_choice, None
    if choice == "required":
        forced = "any"
    elif isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError("a named tool_choice is {'type': 'function', 'name': ...}", param="tool_choice")
        forced = choice["name"]
    elif choice not in (None, "auto", "none"):
        raise InvalidRequestError(f"tool_choice '{choice}' is not one of none, auto, required or a named function",
                                  param="tool_choice")
    text_format = req.text.format if req.text is not None else None
    schema = None
    if text_format is not None and text_format.type != "text":
        if text_format.type not in ("json_object", "json_schema"):
            raise InvalidRequestError(f"text.format of type '{text_format.type}' is not supported",
                                      param="text.format.type")
        if text_format.type == "json_schema" and text_format.schema_ is None:
            raise InvalidRequestError("text.format of type 'json_schema' needs 'schema'", param="text.format.schema")
        schema = text_format.schema_ or {}
    return Constraint(functions=tuple(t["function"] for t in tools), forced=forced,
                      parallel=req.parallel_tool_calls is not False, json_schema=schema, format_param="text.format",
                      function_params=tuple(f"tools.{i}.parameters" for i in range(len(tools))),
                      tools_parsed=tools_parsed and choice != "none")


def _text_echo(req: ResponsesRequest) -> dict:
    """`text` as the response echoes it: the format the request gave ("text" by default)."""
    text_format = req.text.format if req.text is not None else None
    if text_format is None:
        return {"format": {"type": "text"}}
    return {"format": text_format.model_dump(by_alias=True, exclude_none=True)}


def _started(req: ResponsesRequest, params: SamplingParams, response_id: str, created_at: int) -> ResponsesResponse:
    """The response object before any output: the request's settings echoed, with the defaults applied."""
    return ResponsesResponse(
        id=response_id, created_at=created_at, status="in_progress", instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, model=req.model, output=[],
        parallel_tool_calls=req.parallel_tool_calls is not False,  # null = the default, true (case T3)
        temperature=params.temperature, text=_text_echo(req), tool_choice=req.tool_choice or "auto",
        tools=list(req.tools or ()), top_logprobs=req.top_logprobs or 0, top_p=params.top_p, user=req.user,
        metadata=req.metadata or {})


def _outcome(finish_reason: str | None) -> dict:
    """The response fields set when the output ended: status "completed" on a stop, else "incomplete" (a length
    finish is max_output_tokens', or the context window's)."""
    if finish_reason == "stop":
        return {"status": "completed", "incomplete_details": None}
    return {"status": "incomplete",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens" if finish_reason == "length" else None)}


@bp.post("/v1/responses")
async def create_response():
    """Create a model response; `stream: true` answers with server-sent events."""
    state = get_state()
    stats = state.request_stats()
    req = parse_request(ResponsesRequest, await request_body())
    state.check_model(req.model)
    check_mm_kwargs(req, state.config.trust_request_mm_kwargs)
    params = _params(req)
    tools = template_tools(req)
    messages = input_messages(req)
    engine = state.ready_engine()
    free_parser = parser_factory(state.config, engine, tools, req.tool_choice)
    c = constraint(req, tools, free_parser is not None)
    prompt_ids = await messages_prompt_ids(engine, messages, tools=tools or None, param="input")
    c = replace(c, reasoning=reasoning_mode(state.config, engine, prompt_ids))
    params.grammar = await request_grammar(engine.tokenizer, c)
    new_parser = sequence_parser(c, free_parser, engine.tokenizer)
    # Validation (context length, params) raises here, before any byte of a stream is sent.
    stream = state.track(add_request(engine, prompt_ids, params, prompt_param="input",
                                     max_tokens_param="max_output_tokens"))
    started = _started(req, params, state.new_id("resp_"), state.clock())
    item_id = state.new_id("msg_")
    parallel = c.parallel
    forced = c.forced is not None
    tokenizer = engine.tokenizer if params.logprobs is not None else None  # None: no logprobs asked
    if req.stream:
        events = ResponseEvents(started, item_id, new_parser, parallel, forced, logprobs_tokenizer=tokenizer)
        return sse_response(drive_stream(stream, events.chunk if new_parser is None else events.tool_chunk, None,
                                         events.opening(), state.config.sse_keep_alive_interval, stats,
                                         error_frame=events.error, done=b""), stream)
    results, counter = await collect(stream, stats)
    usage = ResponseUsage.of(counter.prompt_tokens, counter.cached_tokens, sum(counter.output_tokens.values()))
    seq = results[0]
    if new_parser is not None:  # the stream's path without its bytes: the same items and usage as streamed
        events = ResponseEvents(started, item_id, new_parser, parallel, forced, frames=False,
                                logprobs_tokenizer=tokenizer)
        start = 0
        for (delta, num_tokens, ids), end in zip(with_ids(seq.deltas, seq.token_ids), seq.logprob_ends):
            events.feed(delta, num_tokens, ids, seq.logprobs[start:end])
            start = end
        events.end(seq.finish_reason, usage)
        return json_response(events.response)
    end = _outcome(seq.finish_reason)
    logprobs = logprob_entries(tokenizer, seq.logprobs) if tokenizer is not None else []
    message = OutputMessage(id=item_id, status=end["status"], content=[OutputText(text=seq.text, logprobs=logprobs)])
    return json_response(started.model_copy(update={**end, "output": [message], "usage": usage}))


class ResponseEvents:
    """The framed events of one streamed response, numbered (`sequence_number`) in the order they are made.

    Args:
        started: the response object before any output (`_started`).
        item_id: the first output message's id (a later one, after a call, is `<item_id>_<n>`).
        new_parser: the output parser's constructor (`api.structured.sequence_parser`: reasoning, then tool
            calls), None for text only.
        parallel_tool_calls: False keeps only the model's first call.
        forced: the grammar forced calls: text is not sent (it can only be a call the output did not finish).
        frames: make the events' bytes; False for a non-streamed response, which reads `response` alone (the
            methods then return empty frames).
        logprobs_tokenizer: the tokenizer that renders the tokens of the logprobs asked for (`include`
            "message.output_text.logprobs"), None when none are asked. Each text delta event carries the entries
            of its tokens, the message's output_text and output_text.done all of them (`PendingLogprobs` says
            which tokens' entries a message gets with the parser).

    Use `opening()` for the events before any output, `chunk` (text only) or `tool_chunk` (with the parser) as
    `drive_stream`'s `choice_chunk`, and `error` as its `error_frame`. A non-streamed response with the parser
    takes the same path, `feed` then `end`, and reads `response`.

    Attributes:
        response: the final response object, once `end` made it.
    """

    def __init__(self, started: ResponsesResponse, item_id: str, new_parser=None, parallel_tool_calls: bool = True,
                 forced: bool = False, frames: bool = True, logprobs_tokenizer=None):
        self._started, self._item_id = started, item_id
        self._tokenizer = logprobs_tokenizer
        self._pending = PendingLogprobs(logprobs_tokenizer) if logprobs_tokenizer is not None else None
        self._entries: list[ChatTokenLogprob] = []  # the open message's logprob entries (when asked)
        self._frames = frames
        self._forced = forced
        self._parser = new_parser() if new_parser is not None else None
        self._parallel = parallel_tool_calls
        self._next = 0  # the next event's sequence_number
        self._items: list[OutputMessage | FunctionCallItem] = []  # the output items done, in order
        self._open: str | None = None  # the open message item's id
        self._texts: list[str] = []  # its text deltas
        self._messages = 0  # message items opened
        self._calls = 0  # calls the model made
        self._reasoning: list[str] | None = None  # the open reasoning item's text deltas
        self._new_tokens = NewTokens()
        self.response: ResponsesResponse | None = None

    @staticmethod
    def _frame(event) -> bytes:
        return sse.typed_frame(event.type, event)

    def _event(self, event_cls, **fields) -> bytes:
        number, self._next = self._next, self._next + 1
        return self._frame(event_cls(sequence_number=number, **fields)) if self._frames else b""

    def opening(self) -> list[bytes]:
        """response.created and response.in_progress; without the parser the empty message item and its text part
        being added too (with it, they wait for the first text)."""
        frames = [self._event(ResponseEvent, type="response.created", response=self._started),
                  self._event(ResponseEvent, type="response.in_progress", response=self._started)]
        return frames + self._open_message() if self._parser is None else frames

    def _open_message(self) -> list[bytes]:
        """The events adding a message item and its text part (the next output item)."""
        item_id = self._item_id if not self._messages else f"{self._item_id}_{self._messages}"
        self._messages += 1
        self._open, index = item_id, len(self._items)
        # The delta event's bytes around its two varying values, rendered once per message by pydantic: the
        # per-token path is head + sequence_number + mid + JSON text + tail, the same bytes `sse.typed_frame`
        # gives for the model.
        framed = self._frame(OutputTextDeltaEvent(sequence_number=0, item_id=item_id, output_index=index, delta=""))
        number_at = framed.index(b'"sequence_number":0') + len(b'"sequence_number":')
        delta_at = framed.index(b'"delta":""') + len(b'"delta":')
        self._head, self._mid, self._tail = framed[:number_at], framed[number_at + 1:delta_at], framed[delta_at + 2:]
        item = OutputMessage(id=item_id, status="in_progress", content=[])
        return [self._event(OutputItemEvent, type="response.output_item.added", output_index=index, item=item),
                self._event(ContentPartEvent, type="response.content_part.added", item_id=item_id,
                            output_index=index, part=OutputText(text=""))]

    def _close_message(self, status: str) -> list[bytes]:
        """The events ending the open message item: its whole text, its part, the item with `status`."""
        entries, self._entries = self._entries, []
        item = OutputMessage(id=self._open, status=status, content=[OutputText(text="".join(self._texts),
                                                                              logprobs=entries)])
        index = len(self._items)
        self._items.append(item)
        self._open, self._texts = None, []
        part = item.content[0]
        return [
            self._event(OutputTextDoneEvent, item_id=item.id, output_index=index, text=part.text,
                        logprobs=[EventLogprob.of(e) for e in entries]),
            self._event(ContentPartEvent, type="response.content_part.done", item_id=item.id, output_index=index,
                        part=part),
            self._event(OutputItemEvent, type="response.output_item.done", output_index=index, item=item),
        ]

    def _delta(self, text: str, entries: list[ChatTokenLogprob] | None = None) -> bytes:
        """A text delta event of the open message; `entries`: its tokens' logprobs (None when none are asked)."""
        self._texts.append(text)
        if entries is not None:  # logprobs asked: the event through its model
            self._entries += entries
            return self._event(OutputTextDeltaEvent, item_id=self._open, output_index=len(self._items), delta=text,
                               logprobs=[EventLogprob.of(e) for e in entries])
        number, self._next = self._next, self._next + 1
        if not self._frames:
            return b""
        return b"".join((self._head, b"%d" % number, self._mid, orjson.dumps(text), self._tail))

    def _call(self, call: ToolCall) -> list[bytes]:
        """The events of one whole call: the open message item ends, and the function_call item is added, its
        arguments sent in one delta, and done. Without parallel calls, every call after the first is dropped."""
        k, self._calls = self._calls, self._calls + 1
        if k and not self._parallel:
            return []
        frames = self._close_message("completed") if self._open is not None else []
        response_id, index = self._started.id, len(self._items)
        item = FunctionCallItem(id=call_id("fc_", response_id, 0, k), call_id=call_id("call_", response_id, 0, k),
                                name=call.name, arguments=call.arguments, status="completed")
        self._items.append(item)
        added = item.model_copy(update={"status": "in_progress", "arguments": ""})
        return frames + [
            self._event(OutputItemEvent, type="response.output_item.added", output_index=index, item=added),
            self._event(FunctionCallArgumentsDeltaEvent, item_id=item.id, output_index=index, delta=item.arguments),
            self._event(FunctionCallArgumentsDoneEvent, item_id=item.id, output_index=index, name=item.name,
                        arguments=item.arguments),
            self._event(OutputItemEvent, type="response.output_item.done", output_index=index, item=item),
        ]

    def _reasoning_id(self) -> str:
        return "rs_" + self._started.id.removeprefix("resp_")

    def _reasoning_delta(self, text: str) -> list[bytes]:
        """A reasoning text delta; the reasoning item added first when none is open."""
        frames, index = [], len(self._items)
        if self._reasoning is None:
            self._reasoning = []
            item = ReasoningItem(id=self._reasoning_id(), content=[], status="in_progress")
            frames.append(self._event(OutputItemEvent, type="response.output_item.added", output_index=index,
                                      item=item))
        self._reasoning.append(text)
        return frames + [self._event(ReasoningTextDeltaEvent, item_id=self._reasoning_id(), output_index=index,
                                     delta=text)]

    def _close_reasoning(self, status: str = "completed") -> list[bytes]:
        """The events ending the open reasoning item (none when none is open): its whole text, the item."""
        if self._reasoning is None:
            return []
        text, self._reasoning, index = "".join(self._reasoning), None, len(self._items)
        item = ReasoningItem(id=self._reasoning_id(), content=[ReasoningText(text=text)], status=status)
        self._items.append(item)
        return [self._event(ReasoningTextDoneEvent, item_id=item.id, output_index=index, text=text),
                self._event(OutputItemEvent, type="response.output_item.done", output_index=index, item=item)]

    def _attributed(self, pieces, parts: list) -> None:
        """Append each parsed piece to `parts` as (piece, the logprob entries of a content piece, None when none are
        asked), a content piece's text as a list of strings: it takes the queued entries (`PendingLogprobs`), a
        call drops them; content right after content joins it (one text delta per run of content, however the
        text was fed; `_frames_of` joins the strings)."""
        pending = self._pending
        for piece in pieces:
            entries = None
            if pending is not None:
                pending.drop_reasoning(self._parser.reasoning_tokens)
                if isinstance(piece, str):
                    entries = pending.take()
                elif not isinstance(piece, Reasoning):
                    pending.drop()  # the call's tokens
            if not isinstance(piece, str):
                parts.append((piece, None))
            elif parts and isinstance(parts[-1][0], list):
                parts[-1][0].append(piece)
                if entries is not None:
                    parts[-1][1].extend(entries)
            else:
                parts.append(([piece], entries))

    def _frames_of(self, parts: list) -> list[bytes]:
        """The events of `_attributed`'s parts, in order."""
        frames = []
        for piece, entries in parts:
            frames += self._piece("".join(piece) if isinstance(piece, list) else piece, entries)
        return frames

    def _piece(self, piece, entries: list[ChatTokenLogprob] | None = None) -> list[bytes]:
        """The events of one parsed piece: reasoning, content text (`entries`: its tokens' logprobs, when asked) or
        a call (which end the reasoning)."""
        if isinstance(piece, Reasoning):
            return self._reasoning_delta(piece.text)
        frames = self._close_reasoning()
        return frames + (self._content(piece, entries) if isinstance(piece, str) else self._call(piece))

    def _content(self, text: str, entries: list[ChatTokenLogprob] | None) -> list[bytes]:
        if self._forced:  # the grammar writes calls only: other text is a call the output did not finish
            return []
        if self._open is not None:
            return [self._delta(text, entries)]
        return self._open_message() + [self._delta(text, entries)]

    def feed(self, text: str, num_tokens: int = 0, token_ids: Sequence[int] = (),
             logprobs: Sequence[TokenLogprob] = ()) -> list[bytes]:
        """The events of the next output text (`num_tokens`: the tokens new in it, `token_ids`: the ids of its
        last ones, for the usage's `reasoning_tokens`; `logprobs`: the entries new with it, when asked), through
        the output parser: reasoning deltas, text deltas (the item added first when none is open) and whole calls;
        none while the parser holds the text back.

        With logprobs, a delta of several tokens is fed to the parser token by token once the reasoning is over
        (`PendingLogprobs.by_token`), so that each message gets its own tokens' entries however the engine's
        deltas merged (a stream interval, a consumer that fell behind, a verify step's tokens).
        """
        pending = self._pending
        if pending is None:  # the per-token path without logprobs
            frames = []
            for piece in self._parser.pieces(text, num_tokens, token_ids):  # in the model's order
                frames += self._piece(piece)
            return frames
        # the reasoning counts its tokens by delta: a delta is fed whole until it is over
        runs = pending.by_token(text, logprobs) if self._parser.in_content else ((text, logprobs),)
        parts = []
        for run, entries in runs:
            pending.add(entries)
            self._attributed(self._parser.pieces(run, num_tokens, token_ids), parts)
            num_tokens, token_ids = 0, ()  # the reasoning is over: no later run needs them
        return self._frames_of(parts)

    def end(self, finish_reason: str | None, usage: ResponseUsage) -> list[bytes]:
        """The closing events: the parser's last text, the open message item done (an output with no item at
        all is one empty message, as without tools; a forced one has none: its output is only the calls made,
        as Chat gives content null), and response.completed or response.incomplete with every output item and the
        usage (`response`; with the parser, `reasoning_tokens` is its count)."""
        end = _outcome(finish_reason)
        frames = []
        if self._parser is not None:
            parts = []
            self._attributed(self._parser.finish_pieces(), parts)  # the last text, or a call the output ended in
            frames += self._frames_of(parts)
            frames += self._close_reasoning(end["status"])  # an output that ended in its reasoning
            if self._open is None and not self._items and not self._forced:
                frames += self._open_message()
            details = OutputTokensDetails(reasoning_tokens=self._parser.reasoning_tokens)
            usage = usage.model_copy(update={"output_tokens_details": details})
        if self._open is not None:
            frames += self._close_message(end["status"])
        self.response = self._started.model_copy(update={**end, "output": self._items, "usage": usage})
        return frames + [self._event(ResponseEvent, type=f"response.{end['status']}", response=self.response)]

    @staticmethod
    def _usage(out: RequestOutput) -> ResponseUsage:
        return ResponseUsage.of(out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens)

    def chunk(self, out: RequestOutput, logprobs: list[TokenLogprob]) -> bytes:
        """A delta's events, text only: its text as a response.output_text.delta (with its `logprobs` when
        asked); the last delta's closing events too (`drive_stream` calls it only for deltas with text or a
        finish)."""
        entries = logprob_entries(self._tokenizer, logprobs) if self._tokenizer is not None else None
        if out.finish_reason is None:  # the per-token case
            return self._delta(out.text, entries)
        frames = [self._delta(out.text, entries)] if out.text else []
        return b"".join(frames + self.end(out.finish_reason.value, self._usage(out)))

    def tool_chunk(self, out: RequestOutput, logprobs: list[TokenLogprob]) -> bytes:
        """A delta's events with the tool-call parser (`feed`; the last delta's `end` too); b"" while the parser
        holds its text back."""
        new = self._pending.from_stream(logprobs) if self._pending is not None else ()
        frames = self.feed(out.text, self._new_tokens(out), out.token_ids, new)  # a delta with no text counts too
        if out.finish_reason is not None:
            frames += self.end(out.finish_reason.value, self._usage(out))
        data = b"".join(frames)
        if self._pending is not None:
            self._pending.returned(data, logprobs)
        return data

    def error(self, kind: ErrorKind, message: str, param: str | None) -> bytes:
        """The in-band `error` event for an error after the stream began, then `response.failed` (status
        "failed", the error as a "server_error"), the lifecycle event that ends the stream."""
        failed = self._started.model_copy(update={"status": "failed", "error": ResponseError(message=message)})
        return self._event(ErrorEvent, code=kind.reason, message=message, param=param) + \
            self._event(ResponseEvent, type="response.failed", response=failed)


class PendingLogprobs:
    """The logprobs of an output read by the output parser, waiting for the message text they go with.

    Rule: a message gets the entries of the tokens that came (engine deltas, in order) up to the delta whose text
    the parser released as that message's text, since the last piece released; the entries of the reasoning's
    tokens (the first `reasoning_tokens` of the output, as the reasoning parser counts them) and of the tokens
    before a call (its markup, and whitespace the call drops) go nowhere. Exact at one token a delta, and so is a
    delta of several tokens after the reasoning (`by_token` cuts it into its tokens' texts), unless its entries'
    tokens do not spell its text (text a stop string held back, a token without text); such a delta, and one that
    ends the reasoning, gives all its entries after the reasoning's to the first content it releases.

    Entries arrive with `add` (a non-streamed response, delta by delta) or `from_stream` and `returned` (as
    `drive_stream`'s `choice_chunk`, which hands the logprobs of a chunk that sent nothing back with the next).
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._queued: list[TokenLogprob] = []
        self._first = 0  # the output position of the first queued entry
        self._handed_back = 0  # entries `drive_stream` hands back: already queued

    def by_token(self, text: str, logprobs: Sequence[TokenLogprob]) -> list[tuple[str, Sequence[TokenLogprob]]]:
        """A delta's `text` cut into its tokens' texts, each with its token's entry, when the entries' tokens decode
        to exactly `text` (a character split over tokens goes with the token that completes it, the others get "");
        else the whole delta with all its entries."""
        if len(logprobs) < 2:
            return [(text, logprobs)]
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        texts = [decoder.decode(self._tokenizer.token_bytes(lp.token_id)) for lp in logprobs]
        if "".join(texts) != text:
            return [(text, logprobs)]
        return [(run, (lp,)) for run, lp in zip(texts, logprobs)]

    def add(self, logprobs: Sequence[TokenLogprob]) -> None:
        """Queue the entries of the next delta."""
        self._queued += logprobs

    def from_stream(self, logprobs: list[TokenLogprob]) -> list[TokenLogprob]:
        """The entries of `drive_stream`'s list that are new (it leads with those of chunks that sent nothing)."""
        return logprobs[self._handed_back:]

    def returned(self, data: bytes, logprobs: list[TokenLogprob]) -> None:
        """Note what a chunk given `logprobs` returned: `drive_stream` hands them back with the next when b""."""
        self._handed_back = 0 if data else len(logprobs)

    def drop_reasoning(self, reasoning_tokens: int) -> None:
        """Drop the queued entries of the first `reasoning_tokens` output tokens (the reasoning's)."""
        cut = min(max(0, reasoning_tokens - self._first), len(self._queued))
        if cut:
            del self._queued[:cut]
            self._first += cut

    def drop(self) -> None:
        """Drop every queued entry (a call's tokens)."""
        self._first += len(self._queued)
        self._queued = []

    def take(self) -> list[ChatTokenLogprob]:
        """Every queued entry, rendered (`logprob_entries`), for the message text released now."""
        entries = logprob_entries(self._tokenizer, self._queued)
        self.drop()
        return entries
