"""WorkerActor: owns one device's ModelRunner and runs its steps on a dedicated thread.

The compute thread keeps the event loop free to stream tokens while a step runs; a single thread also keeps a
CUDA context current for every call (DESIGN.md section 9: a new thread has none).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from actors.base import Actor
from voltserve.runner import ModelRunner, StepHandle
from voltserve.scheduler import StepPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMsg:
    """Asynchronous scheduling in one trip to the compute thread: launch `launch` (fed from `feed`, see
    ModelRunner.launch), then collect `collect`. The answer is (the new StepHandle or None, collect's
    (seq_id -> token, seq_id -> TokenLogprob) or None)."""

    launch: StepPlan | None = None
    feed: StepHandle | None = None
    collect: StepHandle | None = None


@dataclass(frozen=True)
class DraftMsg:
    """Run a draft model's `prepare(wanted)` (`voltserve.spec.draft_model.DraftModelDrafter`) on the compute
    thread, before the scheduler plans the step that verifies those drafts (`Scheduler.draft_work`)."""

    drafter: object
    wanted: list


class WorkerActor(Actor):
    """Args: runner: the ModelRunner; thread_init: run once on the compute thread first (e.g. set the device)."""

    def __init__(self, runner: ModelRunner, name: str = "worker-0", thread_init=None, on_crash=None):
        super().__init__(name, on_crash)
        self.runner = runner
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                            initializer=thread_init)

    def ask_nowait(self, msg) -> asyncio.Future:
        """Hand a StepMsg / DraftMsg to the compute thread at once, not through the mailbox; the future gets the
        answer straight from the thread's completion. A synchronous step (speculative verify, the CPU) waits on
        this round trip: the mailbox's task added an event-loop turn each way.

        Raises:
            EngineDeadError: the worker stopped.
        """
        self._check_alive()
        return asyncio.get_running_loop().run_in_executor(self._executor, self._call_for(msg), msg)

    async def handle(self, msg):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call_for(msg), msg)

    def _call_for(self, msg):
        """The compute-thread function that answers msg."""
        if isinstance(msg, StepMsg):
            return self._step
        if isinstance(msg, DraftMsg):
            return _prepare_drafts
        raise TypeError(f"{self.name}: unknown message {msg!r}")

    def _step(self, msg: StepMsg):
        runner = self.runner
        try:
            launched = runner.launch(msg.launch, msg.feed) if msg.launch is not None else None
        except Exception:
            # the step in flight still runs on the device: wait for it before the failure is handled, since the
            # scheduler then frees its sequences' KV blocks and the next launch refills the pinned input mirror
            # it uploads from (ModelRunner.launch can raise after its own replay, e.g. in the device sampler)
            if msg.collect is not None:
                try:
                    runner.collect(msg.collect)
                except Exception:
                    logger.exception("%s: collecting the step in flight after a failed launch", self.name)
            raise
        return launched, runner.collect(msg.collect) if msg.collect is not None else None

    async def stop(self) -> None:
        """Stop, then drop the runner (the model, its KV cache and graphs): their device memory goes back at once,
        even while the engine object is kept."""
        await super().stop()
        self._executor.shutdown(wait=True)
        self.runner = None


def _prepare_drafts(msg: DraftMsg):
    """A DraftMsg's work on the compute thread."""
    return msg.drafter.prepare(msg.wanted)
