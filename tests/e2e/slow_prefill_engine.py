"""An engine factory for ProcessEngine tests that need to look at the engine during a prefill: a real AsyncEngine
whose steps with a prompt chunk take `delay_s` seconds longer on its compute thread, as a long prompt's prefill
does on the CPU (a 2,518-token prompt took 13 s with the default model). Decode steps run at their own speed."""

from __future__ import annotations

import time

from actors.engine import AsyncEngine


def make(delay_s: float, config, on_death) -> AsyncEngine:
    """The engine factory, by a module-level name the engine process can import (pass a functools.partial)."""
    engine = AsyncEngine(config, on_death=on_death, spare_cores=1)  # as EngineCore builds its default engine
    start = engine.start

    async def start_then_slow_down() -> None:
        await start()
        runner = engine._worker.runner
        launch = runner.launch

        def slow_launch(plan, feed=None):  # on the compute thread: the engine's event loop stays free
            if not plan.is_decode_only:
                time.sleep(delay_s)
            return launch(plan, feed)

        runner.launch = slow_launch

    engine.start = start_then_slow_down
    return engine
