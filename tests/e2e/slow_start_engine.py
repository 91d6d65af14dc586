"""Engine doubles for ProcessEngine's process tests: nothing but a start that takes `delay_s` seconds (a model
load), or a process that exits soon after its start, and the process id in `kv_stats` (which engine process a
ProcessEngine talks to)."""

from __future__ import annotations

import asyncio
import os
import threading
import time


class SlowStartEngine:
    """What `actors.engine_core.EngineCore` needs of an AsyncEngine, with a slow start and no requests."""

    model_config = tokenizer = chat_template = None
    max_model_len = 16

    def __init__(self, config, on_death, delay_s: float = 0.0):
        self.delay_s = delay_s

    async def start(self) -> None:
        await asyncio.sleep(self.delay_s)

    async def stop(self) -> None:
        pass

    def kv_stats(self) -> dict:
        return {"num_blocks": 1, "pid": os.getpid()}

    def submit(self, prompt_token_ids, params, max_tokens, stream) -> None:
        raise NotImplementedError("SlowStartEngine takes no requests")

    def abort(self, request_id: str) -> None:
        pass


def make(delay_s: float, config, on_death) -> SlowStartEngine:
    """The engine factory, by a module-level name the engine process can import (pass a functools.partial)."""
    return SlowStartEngine(config, on_death, delay_s)


class ExitingEngine(SlowStartEngine):
    """Starts, then its process exits `after_s` seconds later (a crash right after the engine said ready)."""

    async def start(self) -> None:
        threading.Thread(target=lambda: (time.sleep(self.delay_s), os._exit(0)), daemon=True).start()


def make_exiting(after_s: float, config, on_death) -> ExitingEngine:
    return ExitingEngine(config, on_death, after_s)
