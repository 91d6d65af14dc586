"""voltserve: an LLM inference server, V100 first, that also runs on newer NVIDIA GPUs and the CPU.

The engine core (this package) holds pure logic and backends; `actors.engine.AsyncEngine` runs it
from asyncio, `api:app` serves it over HTTP.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

__all__ = ["FinishReason", "RequestOutput", "SamplingParams", "__version__"]
_LAZY = {"FinishReason": "voltserve.request", "RequestOutput": "voltserve.request",
         "SamplingParams": "voltserve.request"}


def __getattr__(name: str):
    """The public classes, imported on first use (PEP 562): `import voltserve` itself imports nothing, so that the
    console script (`voltserve.console`) takes SIGINT and SIGTERM over before any module of weight loads."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'voltserve' has no attribute {name!r}")
