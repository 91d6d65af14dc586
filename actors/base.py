"""Actor base: a mailbox drained by one asyncio task, `tell` / `ask`, and crash supervision.

An actor whose handler raises is dead: its pending and future asks fail with EngineDeadError, and its
supervisor callback runs once so the engine can fail every open stream instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from voltserve.errors import EngineDeadError

logger = logging.getLogger(__name__)


class _Stop:
    pass


class Actor:
    """Subclasses implement `async handle(msg)`; its return value answers an `ask`.

    Args:
        name: for logs and errors.
        on_crash: called once with the exception when the actor dies.
    """

    def __init__(self, name: str, on_crash: Callable[[BaseException], None] | None = None):
        self.name = name
        self._on_crash = on_crash
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._current: asyncio.Future | None = None  # the ask being handled
        self.error: BaseException | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Finish the message in hand, then stop. Later asks fail with EngineDeadError. A stopped actor drops its
        on_crash callback: the owner usually passes a bound method of its own, and that cycle would keep both,
        and whatever they hold (a model, a KV cache on the GPU), alive until the cyclic garbage collector runs."""
        if self._task is None or self._task.done():
            self._on_crash = None
            return
        self._inbox.put_nowait((_Stop(), None))
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._on_crash = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def tell(self, msg: Any) -> None:
        """Queue a message; never blocks. Raises EngineDeadError when the actor is dead."""
        self._check_alive()
        self._inbox.put_nowait((msg, None))

    async def ask(self, msg: Any) -> Any:
        """Queue a message and wait for the handler's answer (its exception is re-raised here)."""
        return await self.ask_nowait(msg)

    def ask_nowait(self, msg: Any) -> asyncio.Future:
        """Queue a message now; the returned future gets the handler's answer. Lets the caller do other work on
        the loop after the actor has been woken and before awaiting the answer.

        Raises:
            EngineDeadError: the actor is dead.
        """
        self._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait((msg, fut))
        return fut

    def _check_alive(self) -> None:
        if self.error is not None or (self._task is not None and self._task.done()):
            raise EngineDeadError(f"{self.name} is not running" + (f": {self.error!r}" if self.error else ""))

    def pending(self) -> list[Any]:
        """Take every queued message without waiting (for actors that batch their inbox)."""
        out = []
        while not self._inbox.empty():
            out.append(self._inbox.get_nowait())
        return out

    async def next_message(self) -> tuple[Any, asyncio.Future | None]:
        return await self._inbox.get()

    async def handle(self, msg: Any) -> Any:
        raise NotImplementedError

    async def run_loop(self) -> None:
        """Default loop: one message at a time. Subclasses with their own rhythm override this."""
        while True:
            msg, fut = await self.next_message()
            if isinstance(msg, _Stop):
                return
            await self.dispatch(msg, fut)

    async def dispatch(self, msg: Any, fut: asyncio.Future | None) -> None:
        """Run the handler for one message and answer its ask. A handler error fails the ask, not the actor."""
        self._current = fut
        try:
            result = await self.handle(msg)
        except Exception as exc:
            if fut is None:
                raise
            if not fut.done():
                fut.set_exception(exc)
            return
        if fut is not None and not fut.done():
            fut.set_result(result)

    async def _run(self) -> None:
        try:
            await self.run_loop()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.error = exc
            logger.exception("actor %s died", self.name)
            self._fail_pending(exc)
            if self._on_crash is not None:
                self._on_crash(exc)
        finally:
            stopped = EngineDeadError(f"{self.name} stopped")
            if self._current is not None and not self._current.done():
                self._current.set_exception(stopped)  # the ask in hand when the actor died or was cancelled
            self._fail_pending(stopped)

    def _fail_pending(self, exc: BaseException) -> None:
        while not self._inbox.empty():
            _, fut = self._inbox.get_nowait()
            if fut is not None and not fut.done():
                fut.set_exception(EngineDeadError(f"{self.name} died: {exc!r}"))
