"""The engine process: an AsyncEngine (scheduler actor + worker) driven by commands from the API process.

`main` is what `actors.engine_process.ProcessEngine` runs in a new interpreter (`ENTRY`). It loads the model,
answers `ReadyMsg` (or `StartFailedMsg`), then serves `AddMsg` / `AbortMsg` from its socket and streams every
step's outputs back through `core_outputs.OutputForwarder`. It exits when told to stop
(`StopMsg`, exit code 0), when the API process goes away (EOF on the socket, 0), when the engine dies
(`EngineDiedMsg`, then exit code 1) or when writing outputs to the API process fails for another reason (1:
the API process sees the exit and fails its streams instead of waiting for outputs that never come).
Detokenization and stop strings run here, in the scheduler actor.

Shared engine (`EngineConfig.engine_socket`): the engine also listens on that Unix socket, and further API
processes (e.g. the workers of `hypercorn -w N api:app`) attach with `AttachMsg`. Each API process gets its own
forwarder; the outputs of a request go to the process that sent it. An API process that goes away has its
requests aborted; the engine exits once the last one has gone (or on StopMsg, which only the spawning process
sends when the engine is not shared).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

from actors.core_outputs import OutputForwarder, api_gone
from actors.engine_ipc import (AbortMsg, AddMsg, AttachMsg, EngineDiedMsg, EngineStartMsg, ReadyMsg,
                               StartFailedMsg, StopMsg, portable_error, watch_readable)
from voltserve import event_loop
from voltserve.config import EngineConfig
from voltserve.errors import ConfigError, EngineDeadError

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
    core = EngineCore(start.config, conn, start.engine_factory, start.listen_path)
    sys.exit(event_loop.run(core.run(), start.config.event_loop))


class ApiClient:
    """One API process on the engine's side: its socket, the forwarder of its outputs (whose `open_requests`
    are its requests still running) and whether it has attached yet (an attaching process first sends
    `AttachMsg`)."""

    def __init__(self, conn: Connection, forwarder: OutputForwarder, attached: bool):
        self.conn, self.forwarder, self.attached = conn, forwarder, attached


class EngineCore:
    """Args: config: engine settings; conn: the socket to the API process that started it; engine_factory: see
    EngineStartMsg; listen_path: where further API processes attach (a Unix socket path; "" = nobody else)."""

    def __init__(self, config: EngineConfig, conn: Connection, engine_factory: Callable | None = None,
                 listen_path: str = ""):
        if engine_factory is None:
            from actors.engine import AsyncEngine  # torch: only in the engine process

            engine_factory = AsyncEngine
        self.engine = engine_factory(config, on_death=self._on_death)
        self.config = config
        self.conn = conn
        self.listen_path = listen_path
        self.clients: dict[int, ApiClient] = {}  # by socket file descriptor
        self._listener: socket.socket | None = None
        self._done: asyncio.Future | None = None

    async def run(self) -> int:
        """Start the engine, serve commands until done. Returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        try:
            await self.engine.start()
            if self.listen_path:
                self._listen(loop)
        except Exception as exc:
            logger.error("engine start failed: %r", exc)
            self.conn.send(StartFailedMsg(portable_error(exc)))
            await self.engine.stop()
            return 1
        self._add_client(loop, self.conn, attached=True)
        try:
            return await self._done
        finally:
            if self._listener is not None:
                loop.remove_reader(self._listener.fileno())
                self._listener.close()
                with contextlib.suppress(OSError):
                    os.unlink(self.listen_path)
            for client in self.clients.values():
                loop.remove_reader(client.conn.fileno())
            await self.engine.stop()  # aborts what is still running; the abort deltas still go out
            for client in list(self.clients.values()):
                client.forwarder.close()
                client.conn.close()

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """Listen at `listen_path` for API processes that attach (a stale file of a dead engine is replaced:
        the process that started this one found nobody listening there)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.listen_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.listen_path)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        loop.add_reader(listener.fileno(), self._accept)
        logger.info("shared engine: API processes attach at %s", self.listen_path)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(True)
        self._add_client(asyncio.get_running_loop(), Connection(sock.detach()), attached=False)

    def _add_client(self, loop: asyncio.AbstractEventLoop, conn: Connection, attached: bool) -> None:
        """Serve one API process; the one that started the engine (`attached`) gets ReadyMsg at once."""
        client: ApiClient

        def on_send_error(exc: BaseException) -> None:  # on the client's sender thread
            if api_gone(exc):
                loop.call_soon_threadsafe(self._drop_client, client)
            else:  # its outputs cannot be written: exit, so that it fails its streams instead of waiting
                loop.call_soon_threadsafe(self._finish, 1)

        # before the sender thread writes anything: no write may meet the socket while add_reader flips its mode
        watch_readable(loop, conn, lambda: self._on_readable(client))
        client = ApiClient(conn, OutputForwarder(conn.send, self.engine.kv_stats, on_send_error), attached)
        self.clients[conn.fileno()] = client
        if attached:
            self._send_ready(client)

    def _send_ready(self, client: ApiClient) -> None:
        engine = self.engine
        client.forwarder.send(ReadyMsg(engine.model_config, engine.tokenizer, engine.chat_template,
                                       engine.max_model_len, engine.kv_stats()))

    def _drop_client(self, client: ApiClient) -> None:
        """An API process went away: abort its requests (their KV blocks return to the pool); the engine stops
        with the last one."""
        if self.clients.pop(client.conn.fileno(), None) is not client:
            return
        asyncio.get_running_loop().remove_reader(client.conn.fileno())
        requests = list(client.forwarder.open_requests)
        client.forwarder.close()  # after a StartFailedMsg queued for it
        client.conn.close()
        for request_id in requests:
            self.engine.abort(request_id)
        if requests:
            logger.warning("an API process went away; aborted its %d request(s)", len(requests))
        if not self.clients:
            logger.warning("the API process is gone; stopping the engine")
            self._finish(0)

    def _on_readable(self, client: ApiClient) -> None:
        try:
            while client.conn.poll():
                for cmd in client.conn.recv():
                    self._handle(client, cmd)
        except (EOFError, OSError):
            self._drop_client(client)

    def _handle(self, client: ApiClient, cmd) -> None:
        if not client.attached:
            self._attach(client, cmd)
        elif isinstance(cmd, AddMsg):
            stream = client.forwarder.stream(cmd.request_id, cmd.params.n)
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

    def _attach(self, client: ApiClient, cmd) -> None:
        """The first command of an attaching API process: its config must ask for this engine."""
        if not isinstance(cmd, AttachMsg):
            raise TypeError(f"engine process: expected AttachMsg from an attaching API process, got {cmd!r}")
        theirs, ours = cmd.config.engine_settings(), self.config.engine_settings()
        if theirs != ours:
            differ = ", ".join(f"{k}={theirs[k]!r} (engine: {ours[k]!r})" for k in ours if theirs[k] != ours[k])
            client.forwarder.send(StartFailedMsg(ConfigError(
                f"the engine at {self.listen_path} runs other settings: {differ}")))
            self._drop_client(client)
            return
        client.attached = True
        self._send_ready(client)
        logger.info("an API process attached (%d now)", len(self.clients))

    def _on_death(self, exc: BaseException) -> None:
        """AsyncEngine's death hook: its open streams have failed; tell every API process and exit."""
        for client in self.clients.values():
            client.forwarder.send(EngineDiedMsg(portable_error(exc)))
        self._finish(1)

    def _finish(self, code: int) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(code)
