"""POST /v1/responses: the OpenAI Responses API, text only (https://platform.openai.com/docs/api-reference/responses).

The input becomes chat messages and takes the chat path to prompt ids (`chat_prompt.messages_prompt_ids`: the chat
template, special-token text kept plain (case S6), the billing-header line dropped from system text (case S2)).
Nothing is stored: `previous_response_id` is refused and there is no GET /v1/responses/{id}.

A streamed response is a sequence of named events, `event: <type>\\ndata: <json>\\n\\n` (`sse.typed_frame`), whose
`sequence_number` counts from 0 (https://platform.openai.com/docs/api-reference/responses-streaming):
response.created, response.in_progress, response.output_item.added, response.content_part.added, then one
response.output_text.delta per text delta, then response.output_text.done, response.content_part.done,
response.output_item.done and response.completed (response.incomplete when max_output_tokens cut the output),
whose response carries the usage. No `data: [DONE]`. An error after the stream began is an `error` event.
"""

from __future__ import annotations

import orjson
from quart import Blueprint

from api import sse
from api.errors import ErrorKind
from api.openai.chat_prompt import content_text, messages_prompt_ids, strip_billing_header
from api.openai.common import (
    add_request, collect, drive_stream, json_response, request_body, sampling_params, sse_response,
)
from api.openai.protocol import parse_request
from api.openai.responses_protocol import (
    ContentPartEvent, ErrorEvent, IncompleteDetails, OutputItemEvent, OutputMessage, OutputText,
    OutputTextDeltaEvent, OutputTextDoneEvent, ResponseError, ResponseEvent, ResponsesRequest, ResponsesResponse,
    ResponseUsage,
)
from api.state import get_state
from voltserve.errors import InvalidRequestError
from voltserve.request import RequestOutput, SamplingParams, TokenLogprob

bp = Blueprint("openai_responses", __name__)
TEXT_PART_TYPES = frozenset({"input_text", "output_text"})  # an earlier response's output may come back as input


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's instructions and input as chat messages (`{"role", "content": str}` dicts).

    `instructions` is a system message placed first; a string `input` is one user message; a list holds message
    items whose text parts join with newlines, as Chat Completions joins them.

    Raises:
        InvalidRequestError: an empty input list; a non-message item (function calls and their outputs,
            reasoning, ...: not supported yet); a message without role or content; a non-text part.
    """
    messages = []
    if req.instructions:
        messages.append({"role": "system", "content": strip_billing_header(req.instructions)})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise InvalidRequestError("'input' must contain at least one item", param="input")
    for i, item in enumerate(req.input):
        if item.type != "message":
            raise InvalidRequestError(f"input items of type '{item.type}' are not supported yet: this server takes "
                                      "text messages only", param=f"input.{i}")
        for name in ("role", "content"):
            if getattr(item, name) is None:
                raise InvalidRequestError(f"missing required field 'input.{i}.{name}'", param=f"input.{i}.{name}")
        text = content_text(item.content, f"input.{i}.content", TEXT_PART_TYPES)
        messages.append({"role": item.role, "content": strip_billing_header(text) if item.role == "system" else text})
    return messages


def _params(req: ResponsesRequest) -> SamplingParams:
    """The request's sampling parameters, after refusing the features that are not served (each a 400 naming
    its field)."""
    stored = {"previous_response_id": "responses", "conversation": "conversations", "prompt": "prompts"}
    for name, what in stored.items():
        if getattr(req, name) is not None:
            raise InvalidRequestError(f"{name} is not supported: this server does not store {what}", param=name)
    if req.background:
        raise InvalidRequestError("background responses are not supported: this server answers in the foreground",
                                  param="background")
    if req.tools:
        raise InvalidRequestError("tools are not supported yet", param="tools")
    if req.tool_choice not in (None, "auto", "none"):
        raise InvalidRequestError("tool_choice other than 'auto' or 'none' is not supported yet", param="tool_choice")
    text_format = req.text.format if req.text is not None else None
    if text_format is not None and text_format.type != "text":
        raise InvalidRequestError(f"text.format of type '{text_format.type}' is not supported yet",
                                  param="text.format")
    return sampling_params(req, max_tokens=req.max_output_tokens, max_tokens_param="max_output_tokens",
                           logprobs=None)


def _started(req: ResponsesRequest, params: SamplingParams, response_id: str, created_at: int) -> ResponsesResponse:
    """The response object before any output: the request's settings echoed, with the defaults applied."""
    return ResponsesResponse(
        id=response_id, created_at=created_at, status="in_progress", instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, model=req.model, output=[],
        parallel_tool_calls=req.parallel_tool_calls is not False,  # null = the default, true (case T3)
        temperature=params.temperature, text={"format": {"type": "text"}}, tool_choice=req.tool_choice or "auto",
        tools=[], top_p=params.top_p, user=req.user, metadata=req.metadata or {})


def _finished(started: ResponsesResponse, item_id: str, text: str, finish_reason: str | None,
              usage: ResponseUsage) -> ResponsesResponse:
    """The response object once the output ended: "completed" on a stop, else "incomplete" (a length finish is
    max_output_tokens', or the context window's)."""
    status = "completed" if finish_reason == "stop" else "incomplete"
    details = None
    if status == "incomplete":
        details = IncompleteDetails(reason="max_output_tokens" if finish_reason == "length" else None)
    message = OutputMessage(id=item_id, status=status, content=[OutputText(text=text)])
    return started.model_copy(update={"status": status, "incomplete_details": details, "output": [message],
                                      "usage": usage})


@bp.post("/v1/responses")
async def create_response():
    """Create a model response; `stream: true` answers with server-sent events."""
    state = get_state()
    stats = state.metrics.request()
    req = parse_request(ResponsesRequest, await request_body())
    state.check_model(req.model)
    params = _params(req)
    messages = input_messages(req)
    engine = state.ready_engine()
    prompt_ids = await messages_prompt_ids(engine, messages, param="input")
    # Validation (context length, params) raises here, before any byte of a stream is sent.
    stream = state.track(add_request(engine, prompt_ids, params, prompt_param="input",
                                     max_tokens_param="max_output_tokens"))
    started = _started(req, params, state.new_id("resp_"), state.clock())
    item_id = state.new_id("msg_")
    if req.stream:
        events = ResponseEvents(started, item_id)
        return sse_response(drive_stream(stream, events.chunk, None, events.opening(),
                                         state.config.sse_keep_alive_interval, stats, error_frame=events.error,
                                         done=b""), stream)
    results, counter = await collect(stream, stats)
    usage = ResponseUsage.of(counter.prompt_tokens, counter.cached_tokens, sum(counter.output_tokens.values()))
    return json_response(_finished(started, item_id, results[0].text, results[0].finish_reason, usage))


class ResponseEvents:
    """The framed events of one streamed response, numbered (`sequence_number`) in the order they are made.

    Args:
        started: the response object before any output (`_started`).
        item_id: the output message's id.

    Use `opening()` for the events before any text, `chunk` as `drive_stream`'s `choice_chunk` (a delta event
    per text delta, and the closing events on the last delta) and `error` as its `error_frame`.
    """

    def __init__(self, started: ResponsesResponse, item_id: str):
        self._started, self._item_id = started, item_id
        self._texts: list[str] = []
        self._next = 0  # the next event's sequence_number
        # The delta event's bytes around its two varying values, rendered once by pydantic: the per-token path is
        # head + sequence_number + mid + JSON text + tail, the same bytes `sse.typed_frame` gives for the model.
        framed = self._frame(OutputTextDeltaEvent(sequence_number=0, item_id=item_id, delta=""))
        number_at = framed.index(b'"sequence_number":0') + len(b'"sequence_number":')
        delta_at = framed.index(b'"delta":""') + len(b'"delta":')
        self._head, self._mid, self._tail = framed[:number_at], framed[number_at + 1:delta_at], framed[delta_at + 2:]

    @staticmethod
    def _frame(event) -> bytes:
        return sse.typed_frame(event.type, event)

    def _event(self, event_cls, **fields) -> bytes:
        number, self._next = self._next, self._next + 1
        return self._frame(event_cls(sequence_number=number, **fields))

    def opening(self) -> list[bytes]:
        """response.created, response.in_progress, and the empty message item and text part being added."""
        item = OutputMessage(id=self._item_id, status="in_progress", content=[])
        return [self._event(ResponseEvent, type="response.created", response=self._started),
                self._event(ResponseEvent, type="response.in_progress", response=self._started),
                self._event(OutputItemEvent, type="response.output_item.added", item=item),
                self._event(ContentPartEvent, type="response.content_part.added", item_id=self._item_id,
                            part=OutputText(text=""))]

    def _delta(self, text: str) -> bytes:
        self._texts.append(text)
        number, self._next = self._next, self._next + 1
        return b"".join((self._head, b"%d" % number, self._mid, orjson.dumps(text), self._tail))

    def chunk(self, out: RequestOutput, logprobs: list[TokenLogprob]) -> bytes:
        """A delta's events: its text as a response.output_text.delta; the last delta's closing events too
        (`drive_stream` calls it only for deltas with text or a finish)."""
        if out.finish_reason is None:  # the per-token case
            return self._delta(out.text)
        frames = [self._delta(out.text)] if out.text else []
        usage = ResponseUsage.of(out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens)
        response = _finished(self._started, self._item_id, "".join(self._texts), out.finish_reason.value, usage)
        item = response.output[0]
        part = item.content[0]
        frames += [
            self._event(OutputTextDoneEvent, item_id=self._item_id, text=part.text),
            self._event(ContentPartEvent, type="response.content_part.done", item_id=self._item_id, part=part),
            self._event(OutputItemEvent, type="response.output_item.done", item=item),
            self._event(ResponseEvent, type=f"response.{response.status}", response=response),
        ]
        return b"".join(frames)

    def error(self, kind: ErrorKind, message: str, param: str | None) -> bytes:
        """The in-band `error` event for an error after the stream began, then `response.failed` (status
        "failed", the error as a "server_error"), the lifecycle event that ends the stream."""
        failed = self._started.model_copy(update={"status": "failed", "error": ResponseError(message=message)})
        return self._event(ErrorEvent, code=kind.reason, message=message, param=param) + \
            self._event(ResponseEvent, type="response.failed", response=failed)
