"""The engine process's output path: RequestOutputs of one step -> one message to the API process.

`ForwardingStream` stands in for `RequestStream` inside the engine process (the scheduler actor only uses the
producer side: put, wake, fail). `OutputForwarder` collects what a step put and, at the scheduler's deferred
wake-up (which runs after the next step has been handed to the worker thread, see `SchedulerActor._emit`),
queues it as one `StepOutputsMsg` for a sender thread. The thread pickles and writes, so the engine's loop never
blocks on the socket; messages that queue up while the API process lags are coalesced into one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from actors.engine_ipc import StepOutputsMsg, output_to_tuple, portable_error
from voltserve.request import RequestOutput

logger = logging.getLogger(__name__)

_CLOSE = object()


class ForwardingStream:
    """RequestStream's producer side for one request; its outputs go to the API process.

    Args:
        request_id: the request's id.
        forwarder: collects the outputs of the current step; its `open_requests` counts this request's
            sequences that have not finished.
    """

    __slots__ = ("request_id", "_forwarder")

    def __init__(self, request_id: str, forwarder: "OutputForwarder"):
        self.request_id = request_id
        self._forwarder = forwarder

    def put(self, out: RequestOutput, wake: bool = True) -> None:
        forwarder = self._forwarder
        forwarder.outputs.append(output_to_tuple(out))
        if out.finish_reason is not None:
            forwarder.sequence_finished(self.request_id)
        if wake:
            forwarder.flush_soon()

    def wake(self) -> None:
        self._forwarder.flush_soon()

    def fail(self, exc: BaseException) -> None:
        self._forwarder.open_requests.pop(self.request_id, None)
        self._forwarder.refuse(self.request_id, exc)


class OutputForwarder:
    """Batches outputs per step and sends them, in order with other messages, on a sender thread.

    Args:
        send: writes one message to the API process (multiprocessing Connection.send); called on the sender
            thread only.
        kv_stats: -> the engine's current kv_stats(), attached to every StepOutputsMsg.
        on_send_error: called (on the sender thread) with the exception when a write fails, after which nothing
            more is sent: the API process is gone (EOFError, BrokenPipeError, ConnectionResetError; see
            `api_gone`), or a message could not be pickled or written. The engine process must then exit, or
            the API process would wait forever for outputs that never come.
    """

    def __init__(self, send: Callable[[object], None], kv_stats: Callable[[], dict],
                 on_send_error: Callable[[BaseException], None] | None = None):
        self._send = send
        self._kv_stats = kv_stats
        self._on_send_error = on_send_error
        self.outputs: list[tuple] = []
        self.failures: list[tuple[str, BaseException]] = []
        self.open_requests: dict[str, int] = {}  # request id -> its sequences still running
        self._closed = False
        self._flush_scheduled = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_loop, name="engine-output-sender", daemon=True)
        self._thread.start()

    def stream(self, request_id: str, num_seqs: int = 1) -> ForwardingStream:
        """The producer side of a new request of `num_seqs` sequences, counted (`track`)."""
        self.track(request_id, num_seqs)
        return ForwardingStream(request_id, self)

    def track(self, request_id: str, num_seqs: int) -> None:
        """Count the request in `open_requests` until each of its `num_seqs` sequences has put its final delta or
        the request failed."""
        self.open_requests[request_id] = num_seqs

    def refuse(self, request_id: str, exc: BaseException) -> None:
        """Send the API process `exc` as the failure of its request `request_id` (without touching
        `open_requests`: a refused duplicate id leaves the request in flight under it counted)."""
        self.failures.append((request_id, portable_error(exc)))
        self.flush_soon()

    def sequence_finished(self, request_id: str) -> None:
        left = self.open_requests.get(request_id, 0) - 1
        if left > 0:
            self.open_requests[request_id] = left
        else:
            self.open_requests.pop(request_id, None)

    def flush_soon(self) -> None:
        """Flush at the end of this event-loop turn (once, however many streams ask)."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Queue what was collected since the last flush as one StepOutputsMsg."""
        self._flush_scheduled = False
        if self._closed:  # the API process is gone: nobody reads these
            self.outputs, self.failures = [], []
        elif self.outputs or self.failures:
            msg = StepOutputsMsg(self.outputs, self.failures, self._kv_stats())
            self.outputs, self.failures = [], []
            self._queue.put(msg)

    def send(self, msg: object) -> None:
        """Queue any other message, after the outputs collected so far."""
        self.flush()
        self._queue.put(msg)

    def close(self) -> None:
        """Send everything queued, then stop the sender thread (blocks until it has; a write to an API process
        that has gone fails at once). Later outputs are dropped."""
        self.flush()
        self._closed = True
        self._queue.put(_CLOSE)
        self._thread.join()

    def _send_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # what queued up while the last write ran goes out together
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for msg in _coalesce(batch):
                if msg is _CLOSE:
                    return
                try:
                    self._send(msg)
                except Exception as exc:
                    if api_gone(exc):
                        logger.warning("the API process is gone; dropping engine outputs")
                    else:
                        logger.exception("sending engine outputs to the API process failed")
                    if self._on_send_error is not None:
                        self._on_send_error(exc)
                    return


def api_gone(exc: BaseException) -> bool:
    """Whether a failed write to the API process means that process has closed its end (not our fault)."""
    return isinstance(exc, (EOFError, BrokenPipeError, ConnectionResetError))


def _coalesce(batch: list) -> list:
    """Merge runs of StepOutputsMsg into one (outputs and failures in order, the newest kv_stats)."""
    out: list = []
    for msg in batch:
        prev = out[-1] if out else None
        if isinstance(msg, StepOutputsMsg) and isinstance(prev, StepOutputsMsg):
            out[-1] = StepOutputsMsg(prev.outputs + msg.outputs, prev.failures + msg.failures, msg.kv_stats)
        else:
            out.append(msg)
    return out
