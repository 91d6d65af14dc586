"""Server-sent events: the only place SSE bytes are made.

Framing (https://html.spec.whatwg.org/multipage/server-sent-events.html): each event is `data: <json>\\n\\n`,
the OpenAI stream ends with `data: [DONE]\\n\\n`, and a line starting with `:` is a comment that clients
ignore, which is how idle streams are kept alive through proxies.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

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


async def with_keep_alive(events: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """Pass `events` through, adding a keep-alive comment after every `interval_s` idle seconds.

    `asyncio.wait_for(events.__anext__(), t)` would cancel, and so close, the source generator on the first
    timeout; instead one `__anext__` task stays pending across timeouts and `asyncio.wait` watches it.
    Closing this generator (client gone) cancels the pending task and closes `events`, whose `finally`
    blocks then run (that is where handlers abort their engine request).

    Args:
        events: framed SSE bytes.
        interval_s: idle seconds before each comment; 0 = pass through unchanged.
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
                yield KEEP_ALIVE
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
