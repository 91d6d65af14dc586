"""RequestStream: the per-request mailbox between the scheduler actor and whoever consumes the outputs.

`put` never blocks; when the consumer falls behind, consecutive deltas of one sequence merge into one. With a
stream interval N > 1 (`EngineConfig.stream_interval`) the consumer gets the first delta at once, then is woken
only once N tokens wait (all sequences together), or a sequence finished, so it writes about one chunk per N
tokens.
A producer that puts into many streams at once can defer the consumers' wake-up (`put(out, wake=False)`, then
`wake()`), e.g. until it has handed the next model step to the worker thread. `interrupt()` wakes a waiting
consumer with no delta (None), which is how an SSE response notices an idle stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from voltserve.errors import EngineDeadError, VoltError
from voltserve.request import RequestOutput

_INTERRUPTED = object()  # a waiter's result when `interrupt()` woke it


def _merge(into: RequestOutput, new: RequestOutput) -> None:
    into.token_ids.extend(new.token_ids)
    into.text += new.text
    if new.logprobs is not None:
        into.logprobs = (into.logprobs or []) + new.logprobs
    into.finish_reason = new.finish_reason
    into.stop_reason = new.stop_reason
    into.num_cached_tokens = new.num_cached_tokens
    into.num_output_tokens = new.num_output_tokens


class RequestStream:
    """Async iterator of RequestOutput deltas for all `num_seqs` sequences of one request.

    Args:
        request_id: the request's id.
        num_seqs: sequences (n) the request generates; iteration ends when all have finished.
        abort: callback that aborts the request in the engine.
        interval: tokens the pending deltas gather before the consumer is woken, after the first delta (which,
            like a finished sequence, an error or `interrupt()`, wakes it at once); 1 = every delta.
    Raises (from iteration):
        EngineDeadError: the engine died or stopped before the request finished.
        StepFailedError: a step running this request raised (the engine goes on).
    """

    def __init__(self, request_id: str, num_seqs: int, abort: Callable[[str], None], interval: int = 1):
        self.request_id = request_id
        self._interval = interval
        self._started = False  # a delta was handed over: from then on, deltas wait for the interval
        self._abort = abort
        self._pending: list[RequestOutput] = []
        self._waiter: asyncio.Future | None = None  # the consumer's wait for the next put (an Event, leaner)
        self._unfinished = set(range(num_seqs))
        self._error: BaseException | None = None
        self._aborted = False

    @property
    def finished(self) -> bool:
        return not self._unfinished and not self._pending

    @property
    def done(self) -> bool:
        """Nothing more will reach the consumer: every delta taken, the stream failed, or it was aborted."""
        return self._aborted or self._error is not None or self.finished

    @property
    def settled(self) -> bool:
        """Every final delta put, failed, or aborted: its id may be reused (after an abort the scheduler still holds
        the request until the abort message, which its mailbox takes before the new request's)."""
        return self._aborted or self._error is not None or not self._unfinished

    @property
    def all_seqs_finished(self) -> bool:
        """True once every sequence's final delta was put (nothing more will be put), consumed or not."""
        return not self._unfinished

    def put(self, out: RequestOutput, wake: bool = True) -> None:
        """Deliver one delta (called on the event loop by the scheduler actor).

        Args:
            out: the delta; it is merged into a pending delta of the same sequence if the consumer has not taken
                that one yet.
            wake: wake the waiting consumer now; False leaves that to a later `wake()` (which must follow).
        A failed stream takes nothing more (the abort's final delta must not end it as a normal finish).
        """
        if self._error is not None:
            return
        pending = self._pending
        if pending:
            for prev in reversed(pending):
                if prev.index == out.index:
                    if prev.finish_reason is None:
                        _merge(prev, out)
                        break
                    return  # nothing follows a finished sequence
            else:
                pending.append(out)
        else:  # the per-token case: the consumer took the last delta already
            pending.append(out)
        if out.finish_reason is not None:
            self._unfinished.discard(out.index)
        if wake and self._waiter is not None:
            self.wake()

    def _ready(self) -> bool:
        """Whether the pending deltas go to the consumer now: any at interval 1 or before the first was handed
        over (the time to first token does not wait for the interval), else `interval` tokens, or a finished
        sequence among them."""
        pending = self._pending
        if not pending:
            return False
        if self._interval <= 1 or not self._started:
            return True
        return any(o.finish_reason is not None for o in pending) or \
            sum(len(o.token_ids) for o in pending) >= self._interval

    def wake(self) -> None:
        """Wake the consumer if it waits; with deltas pending, only once they are due (`_ready`)."""
        if not self._pending or self._ready():
            self._wake_now()

    def _wake_now(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def interrupt(self) -> bool:
        """If the consumer waits for a delta, its `__anext__` returns what is pending, or None when nothing is,
        instead of waiting on (nothing is lost: deltas put later come with the next call); a no-op otherwise.
        The SSE keep-alive uses it to write a comment on an idle stream without a task or a timer per delta
        (`api.sse.IdleTimer`). Returns whether it woke the consumer."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_result(_INTERRUPTED)
            return True
        return False

    def fail(self, exc: BaseException) -> None:
        """End the stream with an error: a VoltError is raised to the consumer as is, anything else as
        EngineDeadError. The stream is settled then (the engine ended the request): a consumer that ends a request
        itself calls `abort()` before this."""
        if self._error is None and self._unfinished:
            self._error = exc
            self._wake_now()

    def abort(self) -> None:
        """Stop the request: the engine aborts it unless it has settled already (then the engine is done with it,
        and its id may belong to a later request, which an abort by id would end)."""
        settled = self.settled
        self._aborted = True
        if not settled:
            self._abort(self.request_id)

    def pop_ready(self) -> RequestOutput | None:
        """The next delta if one is already here, else None, without waiting (errors and the end of the stream
        are `__anext__`'s to report): lets a consumer put every delta of a wake-up into one write."""
        pending = self._pending
        return self._take() if pending else None

    def _take(self) -> RequestOutput:
        self._started = True
        return self._pending.pop(0)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput | None:
        """The next delta (deltas of one sequence merged while they waited) once due (`_ready`; a failed stream
        hands over what it holds first); after `interrupt()`, what is pending, or None."""
        pending = self._pending
        while True:
            if pending and (self._error is not None or self._ready()):
                return self._take()
            if self._error is not None:
                if isinstance(self._error, VoltError):
                    raise self._error
                raise EngineDeadError(str(self._error)) from self._error
            if not self._unfinished and not pending:
                raise StopAsyncIteration
            waiter = self._waiter
            if waiter is None or waiter.done():  # done: a cancelled wait of an earlier call
                waiter = self._waiter = asyncio.get_running_loop().create_future()
            if await waiter is _INTERRUPTED:
                return self._take() if pending else None


async def generate_outputs(engine, prompt_token_ids: list[int], params, request_id: str | None = None
                           ) -> AsyncIterator[RequestOutput]:
    """`engine.add_request(...)` and iterate its outputs; closing or cancelling the iterator before the request
    finished aborts it. The body of every engine facade's `generate()`.

    Args:
        engine: anything with `add_request(prompt_token_ids, params, request_id) -> RequestStream`.
        prompt_token_ids / params / request_id: passed on to it.
    Raises:
        InvalidRequestError, ContextLengthError, EngineDeadError: from add_request (at the first iteration).
        EngineDeadError, StepFailedError: as iterating the stream does.
    """
    stream = engine.add_request(prompt_token_ids, params, request_id)
    try:
        async for out in stream:
            yield out
    finally:
        if not stream.finished:
            stream.abort()
