"""Logging for voltserve's processes: one stderr handler on the root logger, unless the host set one up.

`voltserve serve` calls `configure_logging(--log-level)`; `hypercorn api:app` (api/__init__.py's app, when
serving starts, not at import) calls it with `VOLTSERVE_LOG_LEVEL` (default info). Without it a bare hypercorn
server dropped every voltserve INFO line (engine ready, KV pool size, `--gpu-busy-log-interval` windows):
Python's root logger defaults to WARNING and hypercorn configures only its own loggers. The engine process
copies the API process's root level.

The root handler skips a record that a handler of its own logger already wrote to stderr: hypercorn gives
`hypercorn.error` a stderr handler of its own (`--error-logfile -`, its default) and lets its records propagate, so
under a bare `hypercorn api:app` each of its lines (`Running on ...`, an error's traceback) came out twice.
"""

from __future__ import annotations

import logging
import os

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _NotWrittenBelow(logging.Filter):
    """The root handler's filter: False for a record that a handler of its logger (or of one between it and the
    root) writes to `stream` too, the root handler's own stream. Looked up per record: hypercorn adds its handler
    only once it serves, after the app set up logging."""

    def __init__(self, stream) -> None:
        super().__init__()
        self._stream = stream

    def filter(self, record: logging.LogRecord) -> bool:
        logger = logging.Logger.manager.loggerDict.get(record.name)  # a PlaceHolder or None: nothing below
        while isinstance(logger, logging.Logger) and logger is not logging.root:
            if any(isinstance(h, logging.StreamHandler) and h.stream is self._stream and record.levelno >= h.level
                   for h in logger.handlers):
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        return True


def level_to_set(level: str | None = None) -> str | None:
    """The level `configure_logging(level)` sets: None where the root logger already has a handler (then neither
    `level` nor VOLTSERVE_LOG_LEVEL is read: `voltserve serve --log-level` wins over the variable), else `level`,
    else VOLTSERVE_LOG_LEVEL, else "info", lower-cased.

    Raises:
        ValueError: an unknown level name.
    """
    if logging.getLogger().handlers:
        return None
    name = (level if level is not None else os.environ.get("VOLTSERVE_LOG_LEVEL", "info")).strip().lower()
    if name not in LEVELS:
        raise ValueError(f"log level {name!r}: expected one of {', '.join(LEVELS)} (VOLTSERVE_LOG_LEVEL)")
    return name


def configure_logging(level: str | None = None) -> None:
    """Send log records of `level` and above to stderr, once each (not those a logger's own handler writes
    there), unless the root logger already has a handler (a host application or a logging config owns it then;
    this leaves it alone).

    Args:
        level: one of LEVELS, case-insensitive; None reads VOLTSERVE_LOG_LEVEL (default "info").
    Raises:
        ValueError: an unknown level name (`level_to_set`).
    """
    name = level_to_set(level)
    if name is None:
        return
    logging.basicConfig(level=name.upper(), format=FORMAT)
    handler = logging.getLogger().handlers[0]
    handler.addFilter(_NotWrittenBelow(handler.stream))
