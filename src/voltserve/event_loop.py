"""Which asyncio event loop voltserve's processes run on: uvloop's when it is installed, else asyncio's own.

Why: the API process spends most of its CPU per streamed token in Python code of the HTTP stack and of the
event loop itself (scheduling callbacks, socket writes); uvloop runs the loop and its transports in C
(`tools/bench_http_overhead.py --loop uvloop`). `voltserve serve` and the engine process use `run()`;
`hypercorn api:app` picks its loop with `-k uvloop` / `-k asyncio`.

Kinds (`--event-loop` / `VOLTSERVE_EVENT_LOOP`): "auto" = uvloop when importable (it does not exist on Windows),
else asyncio; "uvloop" = uvloop or an error; "asyncio" = the standard library's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from voltserve.errors import ConfigError

KINDS = ("auto", "uvloop", "asyncio")


def check_kind(kind: str) -> None:
    """Raises ConfigError unless `kind` is one of KINDS (whether uvloop is installed is not checked here)."""
    if kind not in KINDS:
        raise ConfigError(f"event_loop must be one of {', '.join(KINDS)}, not {kind!r}")


def loop_factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The `loop_factory` for `asyncio.Runner` of an event-loop kind; None means asyncio's default loop.

    Raises:
        ConfigError: an unknown kind, or "uvloop" when uvloop is not installed.
    """
    check_kind(kind)
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if kind == "uvloop":
            raise ConfigError("event_loop=uvloop, but uvloop is not installed (pip install uvloop)") from exc
        return None
    return uvloop.new_event_loop


def resolve(kind: str = "auto") -> str:
    """The loop `kind` runs on: "uvloop" or "asyncio". Raises ConfigError as `loop_factory` does."""
    return "asyncio" if loop_factory(kind) is None else "uvloop"


def run(main: Coroutine[Any, Any, Any], kind: str = "auto") -> Any:
    """`asyncio.run(main)` on the event loop of `kind`; returns what `main` returns."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)
