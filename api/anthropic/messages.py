"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, text and client tools
(https://docs.anthropic.com/en/api/messages, streaming: https://docs.anthropic.com/en/docs/build-with-claude/streaming,
tools: https://docs.anthropic.com/en/docs/build-with-claude/tool-use).

The request becomes chat messages and goes through the same template and tokenizer path as Chat Completions
(`api.openai.chat_prompt`: special-token text in user content stays plain text, case S6; the billing-header line of
a system prompt is dropped, case S2). A last `assistant` message is a prefill: the answer continues it, and the
response holds only the continuation. Errors take Anthropic's shape (`api.errors.speaks_anthropic`).

Tools are given to the chat template as OpenAI-style functions; earlier `tool_use` blocks become the assistant
turn's `tool_calls` and `tool_result` blocks `tool` messages. With tools (and tool_choice not "none") the output
goes through the server's tool-call parser (`api.tool_calls`): each call becomes a `tool_use` block, and the
message stops with "tool_use". A forced call (tool_choice "any" / "tool") and a JSON output format are held to a
grammar (`api.structured`).

An output with nothing to show (no text, no call, no reasoning: e.g. a forced call cut by max_tokens) has no
content block, as Anthropic answers `content: []`: an empty text block could not be sent back to it.

With a reasoning parser (`api.reasoning`), the model's reasoning is a `thinking` block ahead of the others
(`signature` empty), streamed with `thinking_delta` events. `thinking: {"type": "disabled"}` turns the model's
thinking off (`enable_thinking` false); "enabled" needs a server that reads reasoning (else a 400).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import orjson
from quart import Blueprint

from api import sse
from api.anthropic.protocol import (
    ContentBlock, CountTokensRequest, InputMessage, MessageResponse, MessagesRequest, MessageUsage, TextBlock,
    ThinkingBlock, TokenCount, ToolUseBlock,
)
from api.errors import ErrorKind, anthropic_payload
from api.metrics import NO_STATS
from api.openai.chat_prompt import messages_prompt_ids, strip_billing_header
from api.openai.common import (
    add_request, check_prompt_chars, collect, drive_stream, json_response, prompt_work, request_body,
    sse_response,
)
from api.openai.protocol import parse_request
from api.state import get_state
from api.reasoning import parser_name as reasoning_parser_name, reasoning_mode
from api.structured import Constraint, request_grammar, sequence_parser
from api.tool_calls import ToolCall, call_id, parser_factory
from voltserve.errors import InvalidRequestError
from voltserve.parsers.output import Reasoning, parse_deltas
from voltserve.parsers.reasoning import THINK_CLOSE
from voltserve.parsers.tool_json import dumps_arguments
from voltserve.request import FinishReason, RequestOutput, SamplingParams

bp = Blueprint("anthropic_messages", __name__)

_SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # earlier turns' reasoning: not part of the prompt
_MEDIA_BLOCKS = frozenset({"image", "document", "search_result"})
_CLIENT_TOOL_TYPES = (None, "custom")


def _block_text(block: ContentBlock, where: str) -> str | None:
    """A text block's text; None for a block left out of the prompt (earlier thinking).

    Raises:
        InvalidRequestError: a media block (the served model reads text only), a text block without text or with
            empty or whitespace-only text (as Anthropic refuses them, naming the top-level field: "messages" or
            "system"), or any other type (tool blocks are read by `_chat_turns`, where they belong).
    """
    if block.type == "text":
        if block.text is None:
            raise InvalidRequestError("a text block needs 'text'", param=f"{where}.text")
        if not block.text.strip():
            field = where.split(".", 1)[0]
            rule = "be non-empty" if not block.text else "contain non-whitespace text"
            raise InvalidRequestError(f"{field}: text content blocks must {rule}", param=f"{where}.text")
        return block.text
    if block.type in _MEDIA_BLOCKS:
        raise InvalidRequestError(f"content block type '{block.type}' is not supported: the served model "
                                  "accepts text only", param=f"{where}.type")
    if block.type in _SKIPPED_BLOCKS:
        return None
    raise InvalidRequestError(f"content block type '{block.type}' is not supported here"
                              if block.type in ("tool_use", "tool_result") else
                              f"content block type '{block.type}' is not supported yet", param=f"{where}.type")


def _blocks_text(content: str | list[ContentBlock], param: str) -> str:
    """The system prompt's or a tool result's content as one string; text blocks join with newlines.

    Raises:
        InvalidRequestError: a block `_block_text` refuses.
    """
    if isinstance(content, str):
        return content
    texts = (_block_text(block, f"{param}.{j}") for j, block in enumerate(content))
    return "\n".join(text for text in texts if text is not None)


def _tool_call(block: ContentBlock, where: str) -> dict:
    """An earlier `tool_use` block as a chat `tool_calls` entry (arguments as JSON text)."""
    for field in ("id", "name", "input"):
        if getattr(block, field) is None:
            raise InvalidRequestError(f"a tool_use block needs '{field}'", param=f"{where}.{field}")
    return {"id": block.id, "type": "function",
            "function": {"name": block.name, "arguments": dumps_arguments(block.input)}}


def _tool_message(block: ContentBlock, where: str) -> dict:
    """A `tool_result` block as a chat `tool` message (`is_error` has no place there: the content tells)."""
    if block.tool_use_id is None:
        raise InvalidRequestError("a tool_result block needs 'tool_use_id'", param=f"{where}.tool_use_id")
    if isinstance(block.content, dict):
        raise InvalidRequestError("a tool_result's content must be a string or a list of text blocks",
                                  param=f"{where}.content")
    content = _blocks_text(block.content, f"{where}.content") if block.content is not None else ""
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _chat_turns(msg: InputMessage, i: int) -> list[dict]:
    """One Anthropic message as chat messages: a user message's tool results (`tool` messages), then its text
    turn unless it held only tool results; an assistant message's text with its `tool_use` blocks as
    `tool_calls`.

    Raises:
        InvalidRequestError: a tool block in the wrong role's message or missing a field, or a block
            `_block_text` refuses.
    """
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(msg.content):
        where = f"messages.{i}.content.{j}"
        if block.type == "tool_use" and msg.role == "assistant":
            calls.append(_tool_call(block, where))
        elif block.type == "tool_result" and msg.role == "user":
            results.append(_tool_message(block, where))
        elif block.type in ("tool_use", "tool_result"):
            owner = "an assistant" if block.type == "tool_use" else "a user"
            raise InvalidRequestError(f"a {block.type} block belongs in {owner} message", param=f"{where}.type")
        elif (text := _block_text(block, where)) is not None:
            texts.append(text)
    if results and not texts:
        return results
    turn = {"role": msg.role, "content": "\n".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return [*results, turn]


# thinking.type values the model's own default serves: "adaptive" (the model decides whether to think; clients
# of newer Claude models send it) and "between_tools" (in the `anthropic` SDK's types)
_MODEL_DEFAULT_THINKING = ("adaptive", "between_tools")


def thinking_kwargs(config, engine, req: CountTokensRequest) -> dict:
    """The chat template variables `thinking` asks for: `enable_thinking` false when disabled (Qwen3's switch;
    no reasoning is read then), none when enabled, absent or one of `_MODEL_DEFAULT_THINKING` (the model's
    default). `budget_tokens` is not enforced.

    Raises:
        InvalidRequestError: a `type` that is none of those (param `thinking.type`); thinking "enabled" on a server
            that reads no reasoning (`api.reasoning.parser_name`).
    """
    if req.thinking is None or req.thinking.type in _MODEL_DEFAULT_THINKING:
        return {}
    if req.thinking.type == "disabled":
        return {"enable_thinking": False}
    if req.thinking.type != "enabled":
        kinds = ", ".join(repr(k) for k in ("enabled", "disabled") + _MODEL_DEFAULT_THINKING)
        raise InvalidRequestError(f"thinking.type must be one of {kinds}, not {req.thinking.type!r}",
                                  param="thinking.type")
    if reasoning_parser_name(config, engine) == "none":
        raise InvalidRequestError("extended thinking is not supported by the served model", param="thinking")
    return {}


def template_tools(req: CountTokensRequest) -> list[dict] | None:
    """The request's tools as the OpenAI-style functions chat templates read (`{"type": "function", "function":
    {"name", "description", "parameters"}}`); None without tools.

    Raises:
        InvalidRequestError: a server tool (a `type` other than "custom"), a tool without `input_schema` or one
            whose schema has a `type` other than "object" (Anthropic's wording; a schema without `type` passes).
    """
    if not req.tools:
        return None
    functions = []
    for k, tool in enumerate(req.tools):
        if tool.type not in _CLIENT_TOOL_TYPES:
            raise InvalidRequestError(f"tool type '{tool.type}' is not supported: only client tools (name, "
                                      "description, input_schema) are", param=f"tools.{k}.type")
        if tool.input_schema is None:
            raise InvalidRequestError(f"missing required field 'tools.{k}.input_schema'",
                                      param=f"tools.{k}.input_schema")
        if tool.input_schema.get("type", "object") != "object":  # a call's input is always a JSON object
            raise InvalidRequestError(f"tools.{k}.custom.input_schema.type: Input should be 'object'",
                                      param=f"tools.{k}.input_schema.type")
        function = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        functions.append({"type": "function", "function": function})
    return functions


def split_prefill(req: CountTokensRequest) -> tuple[list[dict], str]:
    """The request's system prompt and messages as chat messages, and the prefill.

    Returns:
        (`{"role", "content", ...}` dicts for the chat template (`_chat_turns`), the last assistant message's
        text when the conversation ends with one, else ""); the prefill is left out of the messages.

    Consecutive messages of one role are joined into one turn (their texts with a newline), as Anthropic does;
    `tool` messages are never joined.

    Raises:
        InvalidRequestError: no messages, a message with empty content but a final assistant one (as Anthropic
            refuses them), a prefill that ends in whitespace (likewise) or holds tool_use blocks, a block
            `_chat_turns` refuses.
    """
    if not req.messages:
        raise InvalidRequestError("'messages' must contain at least one message", param="messages")
    last = len(req.messages) - 1
    for i, msg in enumerate(req.messages):
        if not msg.content and not (i == last and msg.role == "assistant"):
            raise InvalidRequestError(f"messages.{i}: all messages must have non-empty content except for the "
                                      "optional final assistant message", param=f"messages.{i}.content")
    messages = []
    if req.system is not None:
        messages.append({"role": "system", "content": strip_billing_header(_blocks_text(req.system, "system"))})
    for i, msg in enumerate(req.messages):
        for turn in _chat_turns(msg, i):
            last = messages[-1] if messages else None
            if last is not None and last["role"] == turn["role"] != "tool":  # one role's turns are one turn
                last["content"] = "\n".join(text for text in (last["content"], turn["content"]) if text)
                if "tool_calls" in turn:
                    last["tool_calls"] = last.get("tool_calls", []) + turn["tool_calls"]
            else:
                messages.append(turn)
    prefill = ""
    if req.messages[-1].role == "assistant":
        last = messages.pop()
        prefill, where = last["content"], f"messages.{len(req.messages) - 1}.content"
        if "tool_calls" in last:
            raise InvalidRequestError("a final assistant message (a prefill) cannot hold tool_use blocks: its "
                                      "tool_result must follow in a user message", param=where)
        if prefill != prefill.rstrip():
            raise InvalidRequestError("final assistant content cannot end with trailing whitespace", param=where)
    return messages, prefill


async def prompt_ids(engine, req: CountTokensRequest, tools: list[dict] | None,
                     template_kwargs: dict | None = None, reasoning_of: Callable[[list[int]], str | None] | None = None,
                     check_fit: bool = True) -> list[int] | tuple[list[int], str | None]:
    """Render and tokenize a Messages request like a chat request; a prefill's tokens follow the generation
    prompt (tokenized as plain text).

    Args:
        tools: the request's tools as `template_tools` gives them.
        template_kwargs: extra chat template variables (`thinking_kwargs`).
        reasoning_of: `api.reasoning.reasoning_mode` of rendered prompt ids; when given, the mode is decided on
            the prompt before the prefill (a prefill after an opened `<think>` continues the reasoning unless it
            closes it, then the output is "open") and returned too.
        check_fit: as `messages_prompt_ids`' (the prefill counted too); False for count_tokens.

    Returns:
        [num_prompt_tokens] token ids; with `reasoning_of`, (those ids, the reasoning mode).

    Raises:
        InvalidRequestError: see `split_prefill` and `api.openai.chat_prompt.messages_prompt_ids`.
    """
    messages, prefill = split_prefill(req)
    ids = await messages_prompt_ids(engine, messages, tools=tools, template_kwargs=template_kwargs,
                                    check_fit=check_fit)
    mode = reasoning_of(ids) if reasoning_of is not None else None
    if mode == "inside" and THINK_CLOSE in prefill:
        mode = "open"  # the prefill ended the reasoning: the output continues the answer
    if prefill:  # a long one in a thread, as the messages (`prompt_work`)
        if check_fit:
            check_prompt_chars(engine, len(prefill), "messages", num_tokens=len(ids))
        ids += await prompt_work(len(prefill), _encode_plain, engine.tokenizer, prefill)
    return (ids, mode) if reasoning_of is not None else ids


def _encode_plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, parse_special=False)


def sampling_params(req: MessagesRequest) -> SamplingParams:
    """Anthropic sampling fields -> validated SamplingParams (temperature defaults to 1.0, as Anthropic's).

    Raises:
        InvalidRequestError: a value out of range (temperature above Anthropic's 1.0 too; the rest of the
            ranges are SamplingParams').
    """
    if req.temperature is not None and req.temperature > 1:
        raise InvalidRequestError("temperature must be <= 1", param="temperature")
    defaults = SamplingParams()
    return SamplingParams(
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        top_k=req.top_k or 0, max_tokens=req.max_tokens, stop=list(req.stop_sequences or []),
    ).validate()


def stop_fields(finish_reason: FinishReason | str | None, stop_reason: str | int | None,
                called: bool = False) -> dict:
    """`stop_reason` and `stop_sequence` of a finished sequence: max_tokens (length), tool_use (it stopped after
    calling tools: `called`), stop_sequence (a stop string matched; `stop_sequence` names it) or end_turn (EOS or
    a stop token); None when it was aborted."""
    reason = FinishReason(finish_reason) if finish_reason is not None else None
    if reason is FinishReason.LENGTH:
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if reason is FinishReason.STOP:
        if called:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if isinstance(stop_reason, str):
            return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
        return {"stop_reason": "end_turn", "stop_sequence": None}
    return {"stop_reason": None, "stop_sequence": None}


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> MessageUsage:
    return MessageUsage(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                        cache_read_input_tokens=cached_tokens)


def _tool_use(call: ToolCall, message_id: str, k: int) -> ToolUseBlock:
    """The model's k-th call as a `tool_use` block (its arguments, JSON text, parsed back to an object: by the
    json module that wrote them, which keeps integers of any size)."""
    return ToolUseBlock(id=call_id("toolu_", message_id, 0, k), name=call.name, input=json.loads(call.arguments))


def _content_blocks(pieces: list, message_id: str, max_calls: int | None,
                    forced: bool = False) -> list[ThinkingBlock | TextBlock | ToolUseBlock]:
    """A whole output's content blocks, in the order the stream sends them (`_tool_block_events`): a thinking
    block for the reasoning, a text block per run of text (a dropped call does not split one), a `tool_use`
    block per kept call; none when there is nothing.

    Args:
        pieces: the output as `voltserve.parsers.output.parse_deltas` splits it.
        max_calls: the most calls kept (`disable_parallel_tool_use`: 1); None = all.
        forced: a grammar forced the calls: text is left out (it can only be a call the output did not finish,
            case A3).
    """
    blocks: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
    kept = 0
    for piece in pieces:
        if isinstance(piece, Reasoning):
            blocks.append(ThinkingBlock(thinking=piece.text))  # one piece: parse_deltas merges them
        elif isinstance(piece, str):
            if forced:
                continue
            if blocks and isinstance(blocks[-1], TextBlock):
                blocks[-1] = TextBlock(text=blocks[-1].text + piece)
            else:
                blocks.append(TextBlock(text=piece))
        elif max_calls is None or kept < max_calls:
            blocks.append(_tool_use(piece, message_id, kept))
            kept += 1
    return blocks


def constraint(req: MessagesRequest, tools: list[dict] | None, tools_parsed: bool) -> Constraint:
    """The request's tool_choice and JSON output format (`output_config.format`, or the beta `output_format`)
    as a `Constraint` (`tools`: as `template_tools` gives them).

    Raises:
        InvalidRequestError: a tool choice of type "tool" without a name, or an output format other than
            json_schema.
    """
    choice, forced = req.tool_choice, None
    if choice is not None and choice.type == "any":
        forced = "any"
    elif choice is not None and choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError("a tool_choice of type 'tool' needs 'name'", param="tool_choice.name")
        forced = choice.name
    schema, param = None, "output_config.format"
    for param, config in (("output_config.format", (req.output_config or {}).get("format")),
                          ("output_format", req.output_format)):
        if config is not None:
            if not isinstance(config, dict) or config.get("type") != "json_schema":
                raise InvalidRequestError("an output format must be {'type': 'json_schema', 'schema': {...}}",
                                          param=param)
            schema = config.get("schema") or {}
            break
    functions = tuple(t["function"] for t in tools or ())
    # Anthropic names the field at the head of the message ("tools.1.custom.input_schema: ..."): no `param`
    return Constraint(functions=functions, forced=forced,
                      parallel=not (choice is not None and choice.disable_parallel_tool_use), json_schema=schema,
                      format_param=param, field_first=True,
                      function_params=tuple(f"tools.{k}.custom.input_schema" for k in range(len(functions))),
                      tools_parsed=tools_parsed and (choice is None or choice.type != "none"))


@bp.post("/v1/messages")
async def create_message():
    """Create a message; `stream: true` answers with Anthropic's named server-sent events."""
    state = get_state()
    stats = state.request_stats()
    req = parse_request(MessagesRequest, await request_body())
    state.check_model(req.model)
    params = sampling_params(req)
    engine = state.ready_engine()
    tools = template_tools(req)
    choice = req.tool_choice
    free_parser = parser_factory(state.config, engine, tools, choice.type if choice is not None else None)
    c = constraint(req, tools, free_parser is not None)
    template_kwargs = thinking_kwargs(state.config, engine, req)
    ids, mode = await prompt_ids(engine, req, tools, template_kwargs,
                                 lambda rendered: reasoning_mode(state.config, engine, rendered, template_kwargs))
    c = replace(c, reasoning=mode)
    params.grammar = await request_grammar(engine.tokenizer, c)
    new_parser, max_calls, forced = sequence_parser(c, free_parser), None if c.parallel else 1, c.forced is not None
    stream = state.track(add_request(engine, ids, params, prompt_param="messages", max_tokens_param="max_tokens"))
    message_id = state.new_id("msg_")
    if req.stream:
        events = _stream_events(stream, message_id, req.model, state.config.sse_keep_alive_interval, stats,
                                new_parser, max_calls, forced)
        return sse_response(events, stream)
    results, counter = await collect(stream, stats)
    seq = results[0]
    blocks, called = [TextBlock(text=seq.text)] if seq.text else [], False
    if new_parser is not None:
        blocks = _content_blocks(parse_deltas(new_parser(), seq.deltas), message_id, max_calls, forced)
        called = any(isinstance(block, ToolUseBlock) for block in blocks)
    return json_response(MessageResponse(
        id=message_id, model=req.model, content=blocks,
        **stop_fields(seq.finish_reason, seq.stop_reason, called),
        usage=_usage(counter.prompt_tokens, counter.cached_tokens, sum(counter.output_tokens.values()))))


@bp.post("/v1/messages/count_tokens")
async def count_tokens():
    """The prompt's token count as /v1/messages would see it (system prompt, tools, messages and prefill)."""
    state = get_state()
    req = parse_request(CountTokensRequest, await request_body())
    state.check_model(req.model)
    engine = state.ready_engine()
    ids = await prompt_ids(engine, req, template_tools(req), thinking_kwargs(state.config, engine, req),
                           check_fit=False)  # a count, whether or not it fits
    return json_response(TokenCount(input_tokens=len(ids)))


def anthropic_error_frame(kind: ErrorKind, message: str, param: str | None) -> bytes:
    """An error sent in-band on a Messages stream: `event: error` with Anthropic's error body."""
    return sse.typed_frame("error", anthropic_payload(message, kind))


_DELTA_HEAD_AT = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,' \
                 b'"delta":{"type":"text_delta","text":'
_DELTA_HEAD = _DELTA_HEAD_AT % 0
_DELTA_TAIL = b"}}\n\n"
_TEXT_BLOCK = {"type": "text", "text": ""}
_THINKING_BLOCK = {"type": "thinking", "thinking": "", "signature": ""}
_PING = sse.typed_frame("ping", {"type": "ping"})


def _block_start(index: int, block: dict) -> bytes:
    return sse.typed_frame("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": block})


def _block_stop(index: int) -> bytes:
    return sse.typed_frame("content_block_stop", {"type": "content_block_stop", "index": index})


class _MessageFrames:
    """message_start and the closing message_delta + message_stop of one streamed message.

    message_start goes out with the engine's first output, not before: the prompt's prefix-cache share is known
    only once it was scheduled, and so message_start and message_delta report the same usage split
    (input_tokens = uncached prompt tokens, cache_read_input_tokens = cached ones, as `_usage`).
    """

    def __init__(self, message_id: str, model: str):
        self.message_id, self.model = message_id, model
        self.cached_tokens: int | None = None  # the prompt's cached tokens, as message_start reported them

    @property
    def started(self) -> bool:
        return self.cached_tokens is not None

    def start(self, out: RequestOutput) -> bytes:
        """message_start, with the usage of `out` (the first output)."""
        self.cached_tokens = out.num_cached_tokens
        message = MessageResponse(id=self.message_id, model=self.model, content=[], stop_reason=None,
                                  stop_sequence=None, usage=_usage(out.num_prompt_tokens, self.cached_tokens, 0))
        return sse.typed_frame("message_start", {"type": "message_start", "message": message.model_dump(mode="json")})

    def end(self, out: RequestOutput, called: bool = False) -> bytes:
        """message_delta (stop_reason, stop_sequence and the final usage) and message_stop."""
        usage = _usage(out.num_prompt_tokens, self.cached_tokens, out.num_output_tokens).model_dump()
        return sse.typed_frame("message_delta", {"type": "message_delta",
                                                 "delta": stop_fields(out.finish_reason, out.stop_reason, called),
                                                 "usage": usage}) + \
            sse.typed_frame("message_stop", {"type": "message_stop"})


def _stream_events(stream, message_id: str, model: str, keep_alive_s: float = 0.0, stats=NO_STATS,
                   new_parser=None, max_calls: int | None = None, forced: bool = False):
    """The event sequence of a streamed message: message_start (with the first output: `_MessageFrames`), one text
    block (content_block_start with the first text, then ping, content_block_delta per delta, content_block_stop),
    then message_delta and message_stop. An output without text has no block.

    With a tool-call parser (`new_parser`), see `_tool_block_events`.
    """
    frames = _MessageFrames(message_id, model)
    if new_parser is not None:
        event = _tool_block_events(new_parser(), frames, max_calls, forced)
    else:
        event = _text_block_events(frames)
    return drive_stream(stream, event, None, (), keep_alive_s, stats, error_frame=anthropic_error_frame, done=b"")


def _text_block_events(frames: _MessageFrames):
    """The event function of a message that is one text block, opened by its first text (Anthropic's order:
    message_start, content_block_start, ping, deltas)."""
    text_open = False

    def event(out: RequestOutput, _logprobs) -> bytes:
        nonlocal text_open
        if text_open and out.finish_reason is None:  # the per-token path (called only for a delta with text)
            return _DELTA_HEAD + orjson.dumps(out.text) + _DELTA_TAIL
        parts, first = [], not frames.started
        if first:
            parts.append(frames.start(out))
        if out.text and not text_open:
            parts.append(_block_start(0, _TEXT_BLOCK))
            text_open = True
        if first:
            parts.append(_PING)
        if out.text:
            parts.append(_DELTA_HEAD + orjson.dumps(out.text) + _DELTA_TAIL)
        if out.finish_reason is not None:
            if text_open:
                parts.append(_block_stop(0))
            parts.append(frames.end(out))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    return event


def _tool_block_events(parser, frames: _MessageFrames, max_calls: int | None, forced: bool = False):
    """The event function of a message whose output goes through an output parser (reasoning, then tool calls:
    `api.structured.sequence_parser`). Blocks are indexed in order: the reasoning is a thinking block
    (content_block_start with `thinking: ""`, one `thinking_delta` per reasoning delta, content_block_stop when
    anything else arrives); a text block opens when content first arrives (after a call, a new one); each call
    closes the open text block and goes out whole as a `tool_use` block (content_block_start with `input: {}`,
    one `input_json_delta` holding the arguments' JSON text, content_block_stop), once the model closed it. The
    first output's events start with message_start and ping (`_MessageFrames`); a message that ends with no block
    has none; it stops with "tool_use" when it called tools.

    Returns:
        (delta, its logprobs) -> its events, b"" while the parser holds the text back.
    """
    index, text_open, kept = 0, False, 0  # the open or next block's index; calls sent
    thinking_open = False

    def event(out: RequestOutput, _logprobs) -> bytes:
        nonlocal index, text_open, kept, thinking_open
        pieces = parser.pieces(out.text)  # in the model's order
        if out.finish_reason is not None:
            pieces += parser.finish_pieces()
        parts = [] if frames.started else [frames.start(out), _PING]
        for call in pieces:
            if isinstance(call, Reasoning):
                if not thinking_open:
                    parts.append(_block_start(index, _THINKING_BLOCK))
                    thinking_open = True
                parts.append(sse.typed_frame("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "thinking_delta", "thinking": call.text}}))
                continue
            if thinking_open:  # reasoning comes first: anything else ends it
                parts.append(_block_stop(index))
                index, thinking_open = index + 1, False
            if isinstance(call, str):
                if forced:  # see _content_blocks
                    continue
                if not text_open:
                    parts.append(_block_start(index, _TEXT_BLOCK))
                    text_open = True
                parts.append(_DELTA_HEAD_AT % index + orjson.dumps(call) + _DELTA_TAIL)
                continue
            if max_calls is not None and kept >= max_calls:
                continue
            if text_open:
                parts.append(_block_stop(index))
                index, text_open = index + 1, False
            block = {"type": "tool_use", "id": call_id("toolu_", frames.message_id, 0, kept), "name": call.name,
                     "input": {}}
            parts += [_block_start(index, block),
                      sse.typed_frame("content_block_delta", {
                          "type": "content_block_delta", "index": index,
                          "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
                      _block_stop(index)]
            index, kept = index + 1, kept + 1
        if out.finish_reason is not None:
            if text_open or thinking_open:
                parts.append(_block_stop(index))
            parts.append(frames.end(out, kept > 0))
        return b"".join(parts)

    return event
