"""The engine process: an AsyncEngine (scheduler actor + worker) driven by commands from the API process.

`main` is what `actors.engine_process.ProcessEngine` runs in a new interpreter (`ENTRY`). It loads the model,
answers `ReadyMsg` (or `StartFailedMsg`), then serves `AddMsg` / `AbortMsg` from its socket and streams every
step's outputs back through `core_outputs.OutputForwarder`. It exits when told to stop
(`StopMsg`, exit code 0), when the API process goes away (EOF on the socket, 0), when the engine dies
(`EngineDiedMsg`, then exit code 1) or when writing outputs to the API process fails for another reason (1:
the API process sees the exit and fails its streams instead of waiting for outputs that never come).
Detokenization and stop strings run here, in the scheduler actor.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

from actors.core_outputs import OutputForwarder, api_gone
from actors.engine_ipc import (AbortMsg, AddMsg, EngineDiedMsg, EngineStartMsg, ReadyMsg, StartFailedMsg,
                               StopMsg, portable_error, watch_readable)
from voltserve import event_loop
from voltserve.config import EngineConfig
from voltserve.errors import EngineDeadError

logger = logging.getLogger(__name__)


# the command line ProcessEngine runs: `python -c ENTRY FD` (no multiprocessing: a daemonic hypercorn worker may
# not start multiprocessing children, and nothing of the API process's __main__ is re-imported)
ENTRY = "from actors.engine_core import main; main()"


def main() -> None:
    """Entry point of the engine process; argv[1] is the file descriptor of its socket to the API process.

    Reads the API process's sys.path and an `EngineStartMsg`, then serves until stopped; the exit code says how
    it ended (0: stopped or the API process is gone; 1: start failed or the engine died).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle; it stops us
    conn = Connection(int(sys.argv[1]))
    try:
        sys.path[:0] = [p for p in conn.recv() if p not in sys.path]  # before unpickling what may need it
        start: EngineStartMsg = conn.recv()
        event_loop.resolve(start.config.event_loop)  # "uvloop" without uvloop: a start error, reported
    except EOFError:  # the API process went away before it sent the start message
        sys.exit(0)
    except Exception as exc:  # e.g. an engine_factory that does not unpickle here
        conn.send(StartFailedMsg(portable_error(exc)))
        sys.exit(1)
    logging.basicConfig(level=start.log_level,
                        format="%(asctime)s %(levelname)s %(name)s [engine process]: %(message)s")
    sys.exit(event_loop.run(EngineCore(start.config, conn, start.engine_factory).run(), start.config.event_loop))


class EngineCore:
    """Args: config: engine settings; conn: the socket to the API process; engine_factory: see EngineStartMsg."""

    def __init__(self, config: EngineConfig, conn: Connection, engine_factory: Callable | None = None):
        if engine_factory is None:
            from actors.engine import AsyncEngine  # torch: only in the engine process

            engine_factory = AsyncEngine
        self.engine = engine_factory(config, on_death=self._on_death)
        self.conn = conn
        self.forwarder: OutputForwarder | None = None
        self._done: asyncio.Future | None = None

    async def run(self) -> int:
        """Start the engine, serve commands until done. Returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        try:
            await self.engine.start()
        except Exception as exc:
            logger.error("engine start failed: %r", exc)
            self.conn.send(StartFailedMsg(portable_error(exc)))
            await self.engine.stop()
            return 1
        engine = self.engine
        # before the sender thread writes anything: no write may meet the socket while add_reader flips its mode
        watch_readable(loop, self.conn, self._on_readable)
        self.forwarder = OutputForwarder(
            self.conn.send, engine.kv_stats,
            on_send_error=lambda exc: loop.call_soon_threadsafe(self._finish, 0 if api_gone(exc) else 1))
        self.forwarder.send(ReadyMsg(engine.model_config, engine.tokenizer, engine.chat_template,
                                     engine.max_model_len, engine.kv_stats()))
        try:
            return await self._done
        finally:
            loop.remove_reader(self.conn.fileno())
            await engine.stop()  # aborts what is still running; the abort deltas still go out
            self.forwarder.close()
            self.conn.close()

    def _on_readable(self) -> None:
        try:
            while self.conn.poll():
                for cmd in self.conn.recv():
                    self._handle(cmd)
        except (EOFError, OSError):
            logger.warning("the API process is gone; stopping the engine")
            self._finish(0)

    def _handle(self, cmd) -> None:
        if isinstance(cmd, AddMsg):
            stream = self.forwarder.stream(cmd.request_id)
            try:
                self.engine.submit(cmd.prompt_token_ids, cmd.params, cmd.max_tokens, stream)
            except EngineDeadError as exc:
                stream.fail(exc)
        elif isinstance(cmd, AbortMsg):
            self.engine.abort(cmd.request_id)
        elif isinstance(cmd, StopMsg):
            self._finish(0)
        else:
            raise TypeError(f"engine process: unknown command {cmd!r}")

    def _on_death(self, exc: BaseException) -> None:
        """AsyncEngine's death hook: its open streams have failed; tell the API process and exit."""
        if self.forwarder is not None:
            self.forwarder.send(EngineDiedMsg(portable_error(exc)))
        self._finish(1)

    def _finish(self, code: int) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(code)
