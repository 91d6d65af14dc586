"""What every route needs from the app: the engine, the config, id and clock sources, and the graceful drain."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quart import current_app, g

from voltserve.config import EngineConfig
from voltserve.errors import EngineDeadError, InvalidRequestError, ModelNotFoundError, ServerShuttingDownError

EXTENSION_KEY = "voltserve"
logger = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05


def random_id(prefix: str) -> str:
    """`prefix` + 32 random hex digits, e.g. "chatcmpl-3f2a..."."""
    return prefix + uuid.uuid4().hex


def unix_time_s() -> int:
    """Seconds since the epoch, the OpenAI `created` field."""
    return int(time.time())


@dataclass
class ServerState:
    """Shared by all routes of one app (stored in `app.extensions["voltserve"]`).

    Attributes:
        engine: an `actors.engine.AsyncEngine` (or a test double with the same interface); None until started.
        config: the engine config the app was made with.
        new_id: prefix -> unique response id; injectable so tests can compare exact bytes.
        clock: -> unix seconds for `created`; injectable for the same reason.
        started_s: when the app was created (the model card's `created`).
        metrics: the app's Prometheus metrics (`api.metrics`; made in `create_app`).
        draining: set by `drain`: the server is shutting down and takes no new requests.
        streams: the engine streams of the requests in flight (`track`), weakly held.
        start_error: the bad setting or model file (`voltserve.errors.INPUT_ERRORS`) the engine's start failed on,
            if it did (`voltserve serve` exits 2 on it).
        start_cancelled: a stop (SIGINT / SIGTERM) came before or while the engine started, and cancelled its start
            (`cancel_start`): the server shuts down without serving.
    """

    engine: Any
    config: EngineConfig
    new_id: Callable[[str], str] = random_id
    clock: Callable[[], int] = unix_time_s
    started_s: int = field(default_factory=unix_time_s)
    metrics: Any = None
    draining: bool = False
    streams: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    start_error: BaseException | None = None
    start_cancelled: bool = False
    _starting: asyncio.Task | None = field(default=None, init=False, repr=False)
    _stop_asked: str = field(default="", init=False, repr=False)  # why `cancel_start` was called, if it was

    async def start_engine(self) -> bool:
        """`engine.start()`, which `cancel_start` may cut short (a model's load takes minutes; a stop should not
        wait for it), or skip (called before). Returns whether the engine started: False when cancelled so.

        Raises:
            what the engine's start raises; CancelledError when the caller is cancelled.
        """
        if self._stop_asked:  # e.g. a signal while the engine's modules were imported
            self.start_cancelled = True
            logger.warning("%s before the engine started: the server exits without serving", self._stop_asked)
            return False
        self._starting = asyncio.ensure_future(self.engine.start())
        try:
            await self._starting
        except asyncio.CancelledError:
            if not self.start_cancelled:
                raise
            return False
        finally:
            self._starting = None
        return True

    def cancel_start(self, why: str) -> None:
        """Cancel the engine's start if it is under way (`start_engine`; or keep it from beginning): the engine
        stops what it started (the engine process and its tensor-parallel ranks) and the server shuts down without
        serving. `why` names the cause in the log line. No effect on an engine that has started."""
        self._stop_asked = self._stop_asked or why
        if self._starting is not None and not self._starting.done():
            self.start_cancelled = True
            logger.warning("%s while the engine starts: stopping its start; the server exits without serving", why)
            self._starting.cancel()

    def ready_engine(self) -> Any:
        """The engine, when it can take requests.

        Raises:
            ServerShuttingDownError: `drain` began (503: clients retry elsewhere).
            EngineDeadError: not started yet, stopped, or an actor died.
        """
        if self.draining:
            raise ServerShuttingDownError("the server is shutting down")
        if self.engine is None or not self.engine.is_healthy:
            raise EngineDeadError("the engine is not running")
        return self.engine

    def track(self, stream: Any) -> Any:
        """Note a request's engine stream as in flight (for `drain`); returns it. Call it right after
        `add_request`, with no await in between (so a drain cannot miss it).

        Raises:
            ServerShuttingDownError: `drain` began while the handler awaited (tokenization): the request is
                aborted at once, and answers 503 like one that arrived during the drain.
        """
        if self.draining:
            stream.abort()
            raise ServerShuttingDownError("the server is shutting down")
        self.streams.add(stream)
        return stream

    def open_streams(self) -> list[Any]:
        """The tracked streams whose consumer may still get something (`RequestStream.done` false)."""
        return [s for s in list(self.streams) if not s.done]

    async def drain(self, timeout_s: float, hurry: asyncio.Event | None = None) -> int:
        """Graceful shutdown: stop taking requests (`ready_engine` raises, so new ones and /health get 503), let
        the ones in flight finish for up to `timeout_s` seconds, then end the rest with ServerShuttingDownError
        (a stream sends it as an in-band error event, then `[DONE]` on OpenAI's chunk streams or `response.failed`
        on a Responses stream; a non-streamed request answers 503) and abort
        them in the engine (their KV blocks freed). The server's own shutdown follows (`voltserve serve`).
        `hurry` set (a second signal) ends the wait at once.

        Returns:
            how many requests were ended early.
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + max(0.0, timeout_s)
        open_ = self.open_streams()
        if open_:
            logger.info("shutting down: %d request(s) in flight get up to %g s to finish", len(open_), timeout_s)
        else:
            logger.info("shutting down: no requests in flight")
        while open_ and loop.time() < deadline and not (hurry is not None and hurry.is_set()):
            await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - loop.time())))
            open_ = self.open_streams()
        for stream in open_:
            stream.abort()  # first: a failed stream is settled, and its abort() would not reach the engine
            stream.fail(ServerShuttingDownError("the server is shutting down"))
        if open_:
            logger.warning("shutting down: ended %d request(s) still running after %.1f s", len(open_),
                           loop.time() - start)
        return len(open_)

    def request_stats(self) -> Any:
        """A started `api.metrics.RequestStats` for the request being handled, kept on `quart.g` so that the
        app's handler of unexpected errors counts a 500 against it (`count_internal_error`)."""
        g.voltserve_stats = self.metrics.request()
        return g.voltserve_stats

    def count_internal_error(self) -> None:
        """Count the request being handled as failed with `internal_error` (a no-op when its stats already
        counted it, a failure or, for an error raised after its output was complete, a success; a route without
        stats counts it here)."""
        stats = g.get("voltserve_stats") or self.metrics.request()
        stats.failed("internal_error")

    def check_model(self, name: str) -> None:
        """Raises ModelNotFoundError (404) unless `name` is the served model name (empty -> 400)."""
        if not name:
            raise InvalidRequestError("'model' must name the served model", param="model")
        if name != self.config.served_model_name:
            raise ModelNotFoundError(f"The model `{name}` does not exist (this server serves "
                                     f"`{self.config.served_model_name}`).")


def get_state() -> ServerState:
    """The ServerState of the app handling the current request."""
    return current_app.extensions[EXTENSION_KEY]
