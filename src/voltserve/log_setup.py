"""Logging for voltserve's processes: one stderr handler on the root logger, unless the host set one up.

`voltserve serve` calls `configure_logging(--log-level)`; `hypercorn api:app` (api/__init__.py's app, when
serving starts, not at import) calls it with `VOLTSERVE_LOG_LEVEL` (default info). Without it a bare hypercorn
server dropped every voltserve INFO line (engine ready, KV pool size, `--gpu-busy-log-interval` windows):
Python's root logger defaults to WARNING and hypercorn configures only its own loggers. The engine process
copies the API process's root level.
"""

from __future__ import annotations

import logging
import os

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | None = None) -> None:
    """Send log records of `level` and above to stderr, unless the root logger already has a handler (a host
    application or a logging config owns it then; this leaves it alone).

    Args:
        level: one of LEVELS, case-insensitive; None reads VOLTSERVE_LOG_LEVEL (default "info").
    Raises:
        ValueError: an unknown level name.
    """
    name = (level if level is not None else os.environ.get("VOLTSERVE_LOG_LEVEL", "info")).strip().lower()
    if name not in LEVELS:
        raise ValueError(f"log level {name!r}: expected one of {', '.join(LEVELS)} (VOLTSERVE_LOG_LEVEL)")
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=name.upper(), format=FORMAT)
