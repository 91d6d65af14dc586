"""Server-sent events: the only place SSE bytes are made.

Framing (https://html.spec.whatwg.org/multipage/server-sent-events.html): each event is `data: <json>\\n\\n`,
the OpenAI stream ends with `data: [DONE]\\n\\n`, and a line starting with `:` is a comment that clients
ignore, which is how idle streams are kept alive through proxies.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import orjson
from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def frame(event: BaseModel | dict, exclude: set[str] | None = None) -> bytes:
    """One `data: <json>\\n\\n` event; pydantic models are dumped in JSON mode (field order kept).

    Args:
        event: the payload.
        exclude: top-level fields of a model to leave out (e.g. "usage" unless the client asked for it).
    """
    payload = event.model_dump(mode="json", exclude=exclude) if isinstance(event, BaseModel) else event
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def typed_frame(event_type: str, payload: BaseModel | dict) -> bytes:
    """One named event, `event: <type>\ndata: <json>\n\n`: the framing of the Responses and Anthropic Messages
    streams, whose clients dispatch on the event name.

    Args:
        event_type: the event name (e.g. "response.output_text.delta", "content_block_delta").
        payload: the event's JSON body; pydantic models are dumped in JSON mode.
    """
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class IdleTimer:
    """Calls `on_idle()` each time `interval_s` seconds pass without a `touch()`: one timer handle per stream,
    re-armed when it fires, so a busy stream pays only `touch()` per chunk (no task, no timer per chunk).

    Args:
        interval_s: idle seconds before each call (> 0).
        on_idle: e.g. `RequestStream.interrupt`, which makes the waiting consumer write a keep-alive comment;
            returns whether it woke one.
    Attributes:
        last: loop time of the last `touch()` or call.
        fired: `on_idle()` woke the consumer (it returned True) since the last `touch()`: a consumer that then
            has nothing to write (deltas that render no text yet) still owes the keep-alive comment.
    Call `close()` when the stream ends.
    """

    __slots__ = ("last", "fired", "_interval", "_on_idle", "_loop", "_handle")

    def __init__(self, interval_s: float, on_idle: Callable[[], None]):
        self._loop = asyncio.get_running_loop()
        self._interval = interval_s
        self._on_idle = on_idle
        self.last = self._loop.time()
        self.fired = False
        self._handle = self._loop.call_at(self.last + interval_s, self._fire)

    def touch(self) -> None:
        """Something was sent: the idle time starts again."""
        self.last = self._loop.time()
        self.fired = False

    def _fire(self) -> None:
        now = self._loop.time()
        due = self.last + self._interval
        if now + _TIMER_SLACK_S >= due:  # loops may run a timer a clock tick early
            self.last = now
            self.fired = bool(self._on_idle()) or self.fired  # (a woken consumer that has not run yet still owes)
            due = now + self._interval
        self._handle = self._loop.call_at(due, self._fire)

    def close(self) -> None:
        self._handle.cancel()


_TIMER_SLACK_S = 0.001


async def with_keep_alive(events: AsyncIterator, interval_s: float, marker=KEEP_ALIVE) -> AsyncIterator:
    """Pass `events` through, adding `marker` after every `interval_s` idle seconds: the keep-alive of a source
    that cannot be interrupted (a `RequestStream` can: `IdleTimer` is much cheaper, see `drive_stream`).

    `asyncio.wait_for(events.__anext__(), t)` would cancel, and so close, the source generator on the first
    timeout; instead one `__anext__` task stays pending across timeouts and `asyncio.wait` watches it (a task
    per item: ~20 us per SSE chunk). Closing this generator (client gone) cancels the pending task and closes
    `events`, whose `finally` blocks then run (that is where handlers abort their engine request).

    Args:
        events: the source, e.g. framed SSE bytes.
        interval_s: idle seconds before each marker; 0 = pass through unchanged.
        marker: what to yield for an idle interval (the keep-alive comment by default).
    """
    if interval_s <= 0:
        try:
            async for chunk in events:
                yield chunk
        finally:
            await _aclose(events)
        return
    iterator = events.__aiter__()
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield marker
                continue
            task, pending = pending, None
            try:
                chunk = task.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await _aclose(iterator)


async def _aclose(iterator) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(RuntimeError):  # "aclose(): asynchronous generator is already running"
            await aclose()
