"""voltserve: an LLM inference server, V100 first, that also runs on newer NVIDIA GPUs and the CPU.

The engine core (this package) holds pure logic and backends; `actors.engine.AsyncEngine` runs it
from asyncio, `api:app` serves it over HTTP.
"""

from voltserve.request import FinishReason, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = ["FinishReason", "RequestOutput", "SamplingParams", "__version__"]
