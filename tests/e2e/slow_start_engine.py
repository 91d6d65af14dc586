"""Engine doubles for ProcessEngine's process tests: no model, no requests; a start that takes `delay_s` seconds
(a model load), a stop that takes `stop_delay_s`, a start that fails, or a process that exits soon after its start. Each reports its
process id in `kv_stats` (which engine process a ProcessEngine talks to) and, when the environment names a file
in LOG_ENV, appends "<event> <pid> <time.monotonic()>" lines to it at the start of its start ("start") and at
the end of its stop ("exit")."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from voltserve.errors import LoaderError

LOG_ENV = "VOLTSERVE_TEST_ENGINE_LOG"


def _log(event: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{event} {os.getpid()} {time.monotonic()}\n")


def read_log(path: str) -> list[tuple[str, int, float]]:
    """The (event, pid, time) lines of a LOG_ENV file."""
    with open(path) as f:
        return [(e, int(p), float(t)) for e, p, t in (line.split() for line in f)]


class SlowStartEngine:
    """What `actors.engine_core.EngineCore` needs of an AsyncEngine, with a slow start (and stop)."""

    model_config = tokenizer = chat_template = None
    max_model_len = 16

    def __init__(self, config, on_death, delay_s: float = 0.0, stop_delay_s: float = 0.0):
        self.delay_s, self.stop_delay_s = delay_s, stop_delay_s

    async def start(self) -> None:
        _log("start")
        await asyncio.sleep(self.delay_s)

    async def stop(self) -> None:
        await asyncio.sleep(self.stop_delay_s)
        _log("exit")

    def kv_stats(self) -> dict:
        return {"num_blocks": 1, "pid": os.getpid()}

    def submit(self, prompt_token_ids, params, max_tokens, stream) -> None:
        raise NotImplementedError("SlowStartEngine takes no requests")

    def abort(self, request_id: str) -> None:
        pass


class ExitingEngine(SlowStartEngine):
    """Starts, then its process exits `delay_s` seconds later (a crash right after the engine said ready)."""

    async def start(self) -> None:
        threading.Thread(target=lambda: (time.sleep(self.delay_s), os._exit(0)), daemon=True).start()


class FailingEngine(SlowStartEngine):
    """A start that fails after `delay_s` seconds (a model that does not load)."""

    async def start(self) -> None:
        await super().start()
        raise LoaderError("cannot read GGUF /models/bad.gguf: GGUF magic invalid")


def make(delay_s: float, config, on_death) -> SlowStartEngine:
    """The engine factory, by a module-level name the engine process can import (pass a functools.partial)."""
    return SlowStartEngine(config, on_death, delay_s)


def make_slow_stop(stop_delay_s: float, config, on_death) -> SlowStartEngine:
    return SlowStartEngine(config, on_death, 0.0, stop_delay_s)


def make_exiting(after_s: float, config, on_death) -> ExitingEngine:
    return ExitingEngine(config, on_death, after_s)


def make_failing(delay_s: float, config, on_death) -> FailingEngine:
    return FailingEngine(config, on_death, delay_s)
