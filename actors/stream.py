"""RequestStream: the per-request mailbox between the scheduler actor and whoever consumes the outputs.

`put` never blocks; when the consumer falls behind, consecutive deltas of one sequence merge into one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from voltserve.errors import EngineDeadError, VoltError
from voltserve.request import RequestOutput


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
    Raises (from iteration):
        EngineDeadError: the engine died or stopped before the request finished.
        StepFailedError: a step running this request raised (the engine goes on).
    """

    def __init__(self, request_id: str, num_seqs: int, abort: Callable[[str], None]):
        self.request_id = request_id
        self._abort = abort
        self._pending: list[RequestOutput] = []
        self._waiter: asyncio.Future | None = None  # the consumer's wait for the next put (an Event, leaner)
        self._unfinished = set(range(num_seqs))
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return not self._unfinished and not self._pending

    def put(self, out: RequestOutput) -> None:
        """Deliver one delta (called on the event loop by the scheduler actor)."""
        for prev in reversed(self._pending):
            if prev.index == out.index:
                if not prev.finished:
                    _merge(prev, out)
                    break
                return  # nothing follows a finished sequence
        else:
            self._pending.append(out)
        if out.finished:
            self._unfinished.discard(out.index)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """End the stream with an error: a VoltError is raised to the consumer as is, anything else as
        EngineDeadError."""
        if self._error is None and self._unfinished:
            self._error = exc
            self._wake()

    def abort(self) -> None:
        self._abort(self.request_id)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._pending:
            if self._error is not None:
                if isinstance(self._error, VoltError):
                    raise self._error
                raise EngineDeadError(str(self._error)) from self._error
            if not self._unfinished:
                raise StopAsyncIteration
            waiter = self._waiter
            if waiter is None or waiter.done():  # done: a cancelled wait of an earlier call
                waiter = self._waiter = asyncio.get_running_loop().create_future()
            await waiter
        return self._pending.pop(0)
