"""The engine process: an AsyncEngine (scheduler actor + worker) driven by commands from the API process.

`main` is what `actors.engine_process.ProcessEngine` runs in a new interpreter (`ENTRY`). It loads the model,
answers `ReadyMsg` (or `StartFailedMsg`), then serves `AddMsg` / `AbortMsg` / `StatsQueryMsg` from its socket and
streams every step's outputs back through `core_outputs.OutputForwarder`. It exits when told to stop
(`StopMsg` or SIGTERM, exit code 0; a SIGTERM during the start exits at once, `EngineCore._on_sigterm`), when the
API process goes away (EOF on the socket, 0), when the engine dies
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
import functools
import logging
import multiprocessing
import os
import signal
import socket
import struct
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from actors import engine_socket
from actors.core_outputs import ForwardingStream, OutputForwarder, api_gone
from actors.engine_ipc import (AbortMsg, AddMsg, AttachMsg, EngineDiedMsg, EngineStartMsg, ListenSocket,
                               ReadyMsg, StartFailedMsg, StatsMsg, StatsQueryMsg, StopMsg, portable_error,
                               watch_readable)
from voltserve import event_loop, owned_dirs
from voltserve.config import EngineConfig
from voltserve.errors import INPUT_ERRORS, ConfigError, EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

ATTACH_DEADLINE_S = 10.0  # a connection to a shared engine's socket must send AttachMsg within this
PENDING_RECV_TIMEOUT_S = 0.5  # the longest a read of a connection that has not attached may block the loop
MAX_ATTACH_BYTES = 1 << 20


def _set_recv_timeout(fd: int, seconds: float) -> None:
    """SO_RCVTIMEO of the blocking socket `fd` (0 = none): a read that waits longer fails (BlockingIOError).
    (`struct timeval` as two C longs: Linux on 64-bit machines.)"""
    blocking = os.get_blocking(fd)  # socket.socket(fileno=) may change it (under socket.setdefaulttimeout)
    sock = socket.socket(fileno=fd)
    try:
        whole = int(seconds)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))
    finally:
        sock.detach()
        os.set_blocking(fd, blocking)


# the command line ProcessEngine runs: `python -c ENTRY FD` (no multiprocessing: a daemonic hypercorn worker may
# not start multiprocessing children, and nothing of the API process's __main__ is re-imported)
ENTRY = "from actors.engine_core import main; main()"


def main() -> None:
    """Entry point of the engine process; argv[1] is the file descriptor of its socket to the API process.

    Reads the API process's sys.path and an `EngineStartMsg`, then serves until stopped; the exit code says how
    it ended (0: stopped, by StopMsg or SIGTERM, or the API process is gone; 1: start failed or the engine died).
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
    for fd in (start.listen.fd, start.listen.lock_fd):  # inherited: keep them from anything we might start
        if fd >= 0:
            os.set_inheritable(fd, False)
    core = EngineCore(start.config, conn, start.engine_factory, start.listen)
    sys.exit(event_loop.run(core.run(), start.config.event_loop))


class ApiClient:
    """One API process on the engine's side: its socket (and that socket's descriptor, the key in
    `EngineCore.clients`), the forwarder of its outputs (whose `open_requests` are its requests still running),
    whether it has attached yet (an attaching process first sends `AttachMsg`) and whether it was dropped."""

    def __init__(self, conn: Connection, forwarder: OutputForwarder, attached: bool):
        self.conn, self.forwarder, self.attached = conn, forwarder, attached
        self.fd = conn.fileno()
        self.dropped = False


def _shown(name: str, value, effective: int = 0) -> str:
    """A setting's value in a mismatch message: max_model_len 0 is the model's default (`effective`: what that came
    to in the engine)."""
    if name == "max_model_len" and value == 0:
        return f"{effective}, its default from the model" if effective else "0, the model's default"
    return repr(value)


class EngineCore:
    """Args: config: engine settings; conn: the socket to the API process that started it; engine_factory: see
    EngineStartMsg; listen: the shared engine's listening socket (`ListenSocket()`: nobody else attaches)."""

    def __init__(self, config: EngineConfig, conn: Connection, engine_factory: Callable | None = None,
                 listen: ListenSocket = ListenSocket()):
        if engine_factory is None:
            from actors.engine import AsyncEngine  # torch: only in the engine process

            # a core left to the API process(es) on the CPU backend (`actors.build.cpu_threads`)
            engine_factory = functools.partial(AsyncEngine, spare_cores=1)
        self.engine = engine_factory(config, on_death=self._on_death)
        self.config = config
        self.conn = conn
        self.listen_path = listen.path
        self.clients: dict[int, ApiClient] = {}  # by socket file descriptor
        # bound by the API process that started us, before we existed: later ones queue there meanwhile
        self._listener = socket.socket(fileno=listen.fd) if listen.fd >= 0 else None
        self._listen_inode = listen.inode
        self._done: asyncio.Future | None = None
        self._serving = False  # the engine has started

    async def run(self) -> int:
        """Start the engine, serve commands until done. Returns the process exit code."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, self._on_sigterm)
        try:
            await self.engine.start()
        except Exception as exc:
            if self.listen_path:  # the API processes waiting for this start fail with its error, not load again
                engine_socket.record_failure(self.listen_path, exc)
            try:
                self.conn.send(StartFailedMsg(portable_error(exc)))
                told = True
            except OSError:  # the API process that started us is gone
                told = False
            if told and isinstance(exc, INPUT_ERRORS):  # a bad setting or model file: the API process reports it
                logger.debug("engine start failed: %r", exc)
            else:
                logger.error("engine start failed: %r", exc)
            self._close_listener()
            await self.engine.stop()
            return 1
        self._serving = True
        if self.listen_path:
            engine_socket.clear_failure(self.listen_path)
        if self._listener is not None:
            self._listener.setblocking(False)
            loop.add_reader(self._listener.fileno(), self._accept)
            logger.info("shared engine: API processes attach at %s", self.listen_path)
        self._add_client(loop, self.conn, attached=True)
        try:
            return await self._done
        finally:
            if self._listener is not None:
                loop.remove_reader(self._listener.fileno())
                # refuse new connections, but keep the socket (and its file's inode) until the file is removed
                with contextlib.suppress(OSError):
                    self._listener.shutdown(socket.SHUT_RDWR)
            for client in self.clients.values():
                loop.remove_reader(client.fd)
            await self.engine.stop()  # aborts what is still running; the abort deltas still go out
            for client in list(self.clients.values()):
                client.forwarder.close()
                client.conn.close()
            self._close_listener()  # last (the engine lock goes with the process's exit)

    def _on_sigterm(self) -> None:
        """SIGTERM: once the engine serves, a clean stop (as StopMsg). While it starts (the model loads on a thread,
        which nothing interrupts: ProcessEngine terminates a start it gave up on, e.g. `voltserve serve` stopped
        during the load), exit at once: its tensor-parallel rank processes (`actors.tp`, still loading) are killed
        and its temporary folders removed first, so that nothing of it stays behind."""
        if self._serving:
            logger.info("SIGTERM: stopping the engine")
            self._finish(0)
            return
        logger.warning("SIGTERM while the engine starts: exiting without finishing the start")
        ranks = multiprocessing.active_children()
        for rank in ranks:
            rank.kill()
        for rank in ranks:
            rank.join(1.0)
        owned_dirs.remove_mine()
        self._close_listener()
        logging.shutdown()  # os._exit flushes nothing
        os._exit(0)

    def _close_listener(self) -> None:
        """Remove the socket file (if it is still the one bound for us), then close the listener."""
        if self._listener is not None:
            engine_socket.remove_if_same(self.listen_path, self._listen_inode)
            self._listener.close()
            self._listener = None

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(True)
        # until it has attached, a read that stalls mid-message ends in an error instead of holding the loop
        _set_recv_timeout(sock.fileno(), PENDING_RECV_TIMEOUT_S)
        loop = asyncio.get_running_loop()
        client = self._add_client(loop, Connection(sock.detach()), attached=False)
        loop.call_later(ATTACH_DEADLINE_S, self._expire, client)

    def _expire(self, client: ApiClient) -> None:
        """A connection that has not attached in time is dropped (it would keep the engine running)."""
        if not client.attached and not client.dropped:
            logger.warning("a connection to %s sent no AttachMsg in %g s; closed", self.listen_path,
                           ATTACH_DEADLINE_S)
            self._drop_client(client)

    def _add_client(self, loop: asyncio.AbstractEventLoop, conn: Connection, attached: bool) -> ApiClient:
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
        self.clients[client.fd] = client
        if attached:
            self._send_ready(client)
        return client

    def _send_ready(self, client: ApiClient) -> None:
        engine = self.engine
        client.forwarder.send(ReadyMsg(engine.model_config, engine.tokenizer, engine.chat_template,
                                       engine.max_model_len, engine.kv_stats()))

    def _drop_client(self, client: ApiClient) -> None:
        """An API process went away: abort its requests (their KV blocks return to the pool); the engine stops
        once no API process is left, attached or attaching (one that connected while the last attached one
        left keeps it). Runs once per client (its reader and its sender may both report it)."""
        if client.dropped:
            return
        client.dropped = True
        del self.clients[client.fd]
        asyncio.get_running_loop().remove_reader(client.fd)
        requests = list(client.forwarder.open_requests)
        client.forwarder.close()  # after a StartFailedMsg queued for it
        client.conn.close()
        for request_id in requests:
            self.engine.abort(request_id)
        if requests:
            logger.warning("an API process went away; aborted its %d request(s)", len(requests))
        if not self.clients:
            if self.listen_path:  # API processes of a shared engine leave this way when they stop cleanly too
                logger.info("no API process left; stopping the engine")
            else:
                logger.warning("the API process is gone; stopping the engine")
            self._finish(0)

    def _on_readable(self, client: ApiClient) -> None:
        try:
            while not client.dropped and client.conn.poll():
                if client.attached:
                    commands = client.conn.recv()
                else:  # an AttachMsg is small: a longer message is not one (e.g. an HTTP request)
                    commands = ForkingPickler.loads(client.conn.recv_bytes(MAX_ATTACH_BYTES))
                for cmd in commands:
                    self._handle(client, cmd)
        except (EOFError, OSError):
            self._drop_client(client)
        except Exception as exc:
            if client.attached:
                raise
            # an attach that cannot be read or answered: refuse it, never leave it waiting
            logger.error("an API process could not attach: %r", exc)
            client.forwarder.send(StartFailedMsg(portable_error(exc)))
            self._drop_client(client)

    def _handle(self, client: ApiClient, cmd) -> None:
        if not client.attached:
            self._attach(client, cmd)
        elif isinstance(cmd, AddMsg):
            self._add(client, cmd)
        elif isinstance(cmd, AbortMsg):
            # only a request of this API process's that it has not aborted yet: once an abort (or its end) freed
            # the id, another API process's request may hold it (`actors.request_ids`)
            if client.forwarder.open_requests.pop(cmd.request_id, None) is not None:
                self.engine.abort(cmd.request_id)
        elif isinstance(cmd, StatsQueryMsg):  # read on this loop, which a running step (a thread's) leaves free
            client.forwarder.send(StatsMsg(self.engine.kv_stats()))
        elif isinstance(cmd, StopMsg):
            self._finish(0)
        else:
            raise TypeError(f"engine process: unknown command {cmd!r}")

    def _add(self, client: ApiClient, cmd: AddMsg) -> None:
        """Submit an API process's request; the engine refuses an id in flight (this API process's or another's
        of a shared engine) or a dead engine's request: that process's stream of it fails, nothing else changes."""
        forwarder = client.forwarder
        stream = ForwardingStream(cmd.request_id, forwarder)
        try:
            self.engine.submit(cmd.prompt_token_ids, cmd.params, cmd.max_tokens, stream)
        except (InvalidRequestError, EngineDeadError) as exc:
            forwarder.refuse(cmd.request_id, exc)
            return
        # counted once accepted (its outputs come on a later loop turn): a refused duplicate must not touch the
        # entry of the request in flight under its id
        forwarder.track(cmd.request_id, cmd.params.n)

    def _attach(self, client: ApiClient, cmd) -> None:
        """The first command of an attaching API process: its config must ask for this engine.

        Raises:
            TypeError: not an AttachMsg; ConfigError: other engine settings (`_on_readable` refuses the attach).
        """
        if not isinstance(cmd, AttachMsg):
            raise TypeError(f"engine process: expected AttachMsg from an attaching API process, got {cmd!r}")
        theirs, ours = cmd.config.engine_settings(), self.config.engine_settings()
        if theirs != ours:
            differ = ", ".join(f"{k}={_shown(k, theirs[k])} (engine: {_shown(k, ours[k], self.engine.max_model_len)})"
                               for k in ours if theirs[k] != ours[k])
            raise ConfigError(f"the engine at {self.listen_path} runs other settings: {differ}")
        client.attached = True
        _set_recv_timeout(client.fd, 0.0)  # its reads block as the others' do
        self._send_ready(client)
        logger.info("an API process attached (%d now)", sum(c.attached for c in self.clients.values()))

    def _on_death(self, exc: BaseException) -> None:
        """AsyncEngine's death hook: its open streams have failed; tell every attached API process and exit
        (those attaching see the exit)."""
        msg = EngineDiedMsg(portable_error(exc))
        for client in self.clients.values():
            if client.attached:
                client.forwarder.send(msg)
        self._finish(1)

    def _finish(self, code: int) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(code)
