"""The events of a streamed /v1/responses answer (`ResponseEvents`) and the logprobs they carry (`PendingLogprobs`);
the event order is api/openai/responses.py's docstring.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

import orjson

from api import sse
from api.errors import ErrorKind
from api.openai.common import NewTokens, logprob_entries
from api.openai.protocol import ChatTokenLogprob
from api.openai.responses_protocol import (
    ContentPartEvent, ErrorEvent, EventLogprob, FunctionCallArgumentsDeltaEvent, FunctionCallArgumentsDoneEvent,
    FunctionCallItem, IncompleteDetails, OutputItemEvent, OutputMessage, OutputText, OutputTextDeltaEvent,
    OutputTextDoneEvent, OutputTokensDetails, ReasoningItem, ReasoningText, ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent, ResponseError, ResponseEvent, ResponsesResponse, ResponseUsage,
)
from api.tool_calls import ToolCall, call_id
from voltserve.parsers.output import Reasoning
from voltserve.request import RequestOutput, TokenLogprob


def response_outcome(finish_reason: str | None) -> dict:
    """The response fields set when the output ended: status "completed" on a stop, else "incomplete" (a length
    finish is max_output_tokens', or the context window's)."""
    if finish_reason == "stop":
        return {"status": "completed", "incomplete_details": None}
    return {"status": "incomplete",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens" if finish_reason == "length" else None)}


class ResponseEvents:
    """The framed events of one streamed response, numbered (`sequence_number`) in the order they are made.

    Args:
        started: the response object before any output (api/openai/responses.py `_started`).
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
        end = response_outcome(finish_reason)
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
        """The events of an error after the stream began: the items still open end "incomplete" (their done
        events, with the text sent so far), then the in-band `error` event, then `response.failed` (status
        "failed", the error as a "server_error", every item the stream added in `output`), the lifecycle event
        that ends the stream. Text the output parser still holds back is not sent."""
        frames = self._close_reasoning("incomplete")
        if self._open is not None:
            frames += self._close_message("incomplete")
        failed = self._started.model_copy(update={"status": "failed", "error": ResponseError(message=message),
                                                  "output": self._items})
        return b"".join(frames) + self._event(ErrorEvent, code=kind.reason, message=message, param=param) + \
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
