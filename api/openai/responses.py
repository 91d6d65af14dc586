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

from dataclasses import replace

from quart import Blueprint

from api.openai.chat_prompt import (
    check_mm_kwargs, content_text, messages_prompt_ids, strip_billing_header, template_role,
)
from api.openai.common import (
    add_request, check_stream_options, check_top_logprobs, collect, drive_stream, json_response, logprob_entries,
    request_body, sampling_params, sse_response,
)
from api.openai.protocol import parse_request
from api.openai.responses_protocol import (
    LOGPROBS_INCLUDE, OutputMessage, OutputText, ResponsesRequest, ResponsesResponse, ResponseUsage,
)
from api.openai.response_events import ResponseEvents, response_outcome
from api.openai.responses_truncation import truncated_prompt_ids
from api.state import get_state
from api.reasoning import reasoning_mode
from api.structured import Constraint, request_grammar, sequence_parser
from api.tool_calls import parser_factory
from voltserve.parsers.output import with_ids
from voltserve.errors import InvalidRequestError
from voltserve.grammar import check_parameters
from voltserve.request import SamplingParams

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
        metadata=req.metadata or {}, truncation=req.truncation or "disabled")


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
    if req.truncation == "auto":
        prompt_ids = await truncated_prompt_ids(engine, messages, tools or None, req.max_output_tokens,
                                                params.min_tokens)
    else:
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
    end = response_outcome(seq.finish_reason)
    logprobs = logprob_entries(tokenizer, seq.logprobs) if tokenizer is not None else []
    message = OutputMessage(id=item_id, status=end["status"], content=[OutputText(text=seq.text, logprobs=logprobs)])
    return json_response(started.model_copy(update={**end, "output": [message], "usage": usage}))
