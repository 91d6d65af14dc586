"""`AsyncEngine.start`'s build (the model's load, minutes for a large one) on a thread that a cancelled start can
leave behind.

Why not `asyncio.to_thread`: a thread of asyncio's executor is joined when the interpreter exits, so a server asked to
stop during the load (`api.state.ServerState.cancel_start`) would still wait for the whole load before it could exit.
A daemon thread is not waited for. A build that finishes after its start was cancelled (the process did not exit
meanwhile: e.g. an embedding program) stops the tensor-parallel rank processes it started, as a failed build does.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from actors.build import BuiltEngine, build_runner
from voltserve.config import EngineConfig

logger = logging.getLogger(__name__)


def _abandon(built: BuiltEngine) -> None:
    """Let go of a build nobody waits for any more: its rank processes are stopped (the rest is garbage)."""
    if built.tp_ranks is not None:
        built.tp_ranks.stop()


async def build_off_loop(config: EngineConfig, loaded=None, spare_cores: int = 0) -> BuiltEngine:
    """`actors.build.build_runner(config, loaded, spare_cores)` on a daemon thread; returns what it returns.

    Raises:
        what `build_runner` raises; CancelledError at once when the caller is cancelled (the build goes on, and is
        let go of when it ends).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def deliver(built: BuiltEngine | None, error: BaseException | None) -> None:
        if done.done():  # the start was cancelled meanwhile
            if built is not None:
                threading.Thread(target=_abandon, args=(built,), name="engine-build-abandon", daemon=True).start()
        elif error is not None:
            done.set_exception(error)
        else:
            done.set_result(built)

    def run() -> None:
        built, error = None, None
        try:
            built = build_runner(config, loaded, spare_cores)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting start, which raises it
            error = exc
        try:
            loop.call_soon_threadsafe(deliver, built, error)
        except RuntimeError:  # the loop is closed: nobody waits
            if built is not None:
                _abandon(built)

    threading.Thread(target=run, name="engine-build", daemon=True).start()
    return await done
