"""`voltserve serve --api-processes N`: N API processes on one listening socket and one shared engine process.

One API process does all the HTTP work of its requests on one core (parsing, prompt tokenization, a write per SSE
chunk); at many concurrent streams that core, not the GPU, bounds tokens/s and time to first token. Here a
supervisor (this module, the process `voltserve serve` started as) opens the listening socket, then starts N
children, each a plain `voltserve serve` that serves that socket (hypercorn `fd://` bind) and uses one engine
through `EngineConfig.engine_socket` (the first child to start launches it, the others attach).

Signals: SIGINT / SIGTERM to the supervisor are passed to every child, whose own handling drains its requests
(`api.app.SignalDrain`; a second signal ends them at once). A child that exits while the others serve (its
engine died: exit 1) stops the rest, and the supervisor exits with its status, so systemd restarts the whole.
If the supervisor itself is killed, the children notice (EOF on a pipe it holds) and shut down as on SIGTERM.
After a clean stop it waits (up to ENGINE_STOP_WAIT_S, or until a further signal) for the engine process to exit
(its engine lock is free then), so that a service manager that kills what remains once the main process exits does
not cut the engine's own stop short. The children count `/metrics` in prometheus-client's multiprocess files in
the supervisor's private folder (unless PROMETHEUS_MULTIPROC_DIR is set), so any child's scrape covers all. An
engine that fails to start fails the API processes that waited for its start with its error, without loading the
model again (`actors.engine_socket`, PATH.failed; before session 27 each retried it in turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time

from actors.engine_socket import ENGINE_LOCK_SUFFIX, remove_if_same, try_flock
from voltserve import console, owned_dirs
from voltserve.config import PROMETHEUS_DIR_VARIABLES, EngineConfig, socket_path_fits
from voltserve.preflight import address
from voltserve.start_report import START_REPORT_ENV

logger = logging.getLogger(__name__)

LISTEN_FD_ENV = "VOLTSERVE_LISTEN_FD"  # a child's inherited listening socket (set by the supervisor only)
PARENT_FD_ENV = "VOLTSERVE_PARENT_FD"  # a child's read end of a pipe: EOF = the supervisor is gone
POLL_S = 0.1
ENGINE_STOP_WAIT_S = 40.0  # the engine's stop after its last API process (a step in hand, then the actors)
FOLDER_PREFIX = "voltserve-api-"  # the supervisor's private folder, in the temporary folder
ENGINE_SOCKET_NAME = "engine.sock"  # the private engine socket, in that folder
# where that folder goes when TMPDIR is too long for the engine socket's path (its 107 bytes): short and, as the
# default TMPDIR, writable by every user (mkdtemp's folder there is the user's alone)
FALLBACK_PARENT = "/tmp"
UDS_LOCK_SUFFIX = ".lock"  # `lock_uds`: PATH.lock beside the --uds socket PATH
_uds_locks: dict[str, int] = {}  # --uds path -> the fd of its lock file this process holds (`lock_uds`)
# as the console script: a SIGTERM passed on while a child imports is a clean stop with its line (`voltserve.console`)
CHILD = "from voltserve.console import main; import sys; sys.exit(main(['serve']))"


def listen_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A TCP socket listening on host:port (IPv6 when the host has a ':'), TCP_NODELAY set for the connections it
    accepts (SSE chunks are small writes that must not wait for Nagle's algorithm), inheritable by children.

    Raises:
        OSError: the address is in use or not available.
    """
    # as hypercorn binds (`hypercorn.config.Config._create_sockets`): IPV6_V6ONLY left at the system's default,
    # so that "::" takes IPv4 too where the system does
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listen_unix(path: str, backlog: int = 1024) -> tuple[socket.socket, int]:
    """A Unix stream socket listening at `path` (`EngineConfig.uds`), inheritable by children, its file made with
    this process's umask (a proxy such as nginx needs write access to connect: e.g. systemd's UMask=0007 and its
    user in the group). A socket file that nothing accepts on any more (a server that was killed) is replaced,
    under the lock `lock_uds` takes first: of two servers that start at once on it, one replaces it and serves.

    Returns:
        the socket and its file's inode (`release_uds` removes it at exit, if still ours, and frees the lock).

    Raises:
        ConfigError: another voltserve holds `path`'s lock, something other than a socket is at `path` (never
            removed), or a server accepts there.
        OSError: the socket or its lock file cannot be made there (e.g. no write access to the folder).
    """
    took_lock, sock = lock_uds(path), None
    try:
        if _stale_socket(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        inode = os.stat(path).st_ino
        sock.listen(backlog)
    except BaseException:
        if sock is not None:
            sock.close()
        if took_lock:
            unlock_uds(path)
        raise
    sock.set_inheritable(True)
    return sock, inode


def _stale_socket(path: str) -> bool:
    """Whether a socket file that nothing accepts on is at `path` (False: no file there).

    Raises:
        ConfigError: something other than a socket is there, or a server accepts (or has a full backlog) there.
    """
    from voltserve.errors import ConfigError

    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ConfigError(f"uds {path!r} exists and is not a socket (not removed)")
    except FileNotFoundError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)  # a live server with a full backlog does not answer at once
        try:
            probe.connect(path)
        except ConnectionRefusedError:  # stale: its server is gone
            return True
        except FileNotFoundError:  # removed meanwhile
            return False
        except TimeoutError:
            pass
    raise ConfigError(f"uds {path!r}: a server listens there already")


def lock_uds(path: str) -> bool:
    """Take the exclusive flock on `PATH.lock` (made with this process's umask if missing, and left in place, as
    the engine socket's lock) that says this process serves on the Unix socket `path`: held until `unlock_uds` or
    this process's exit (kill -9 included). Without it two servers starting at once on a stale socket file both
    found it stale, and the second one's unlink took the path from the first, whose clients then reached the other
    or nobody. Returns whether it took the lock now (False: this process holds it already, e.g. the supervisor of
    `--api-processes`, which opens the socket again).

    Raises:
        ConfigError: another process holds it: another voltserve serves on `path`, or is starting to; or the
            lock file is there and cannot be opened (another user's, mode 0600).
        OSError: the lock file cannot be made (e.g. no write access to the folder).
    """
    from voltserve.errors import ConfigError

    if path in _uds_locks:
        return False
    lock_path = path + UDS_LOCK_SUFFIX
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)  # flock needs no write access
    except OSError as exc:  # named: PATH itself may be free to bind (e.g. a 0600 lock file left by root)
        if not os.path.lexists(lock_path):  # no write access to the folder: PATH's own error
            raise
        raise ConfigError(f"uds {path!r}: cannot open its lock file {lock_path!r}: {exc.strerror or exc} "
                          "(remove it if no voltserve serves there)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"uds {path!r}: another voltserve serves there or is starting to "
                          f"(it holds {lock_path!r})") from None
    except BaseException:
        os.close(fd)
        raise
    _uds_locks[path] = fd
    return True


def unlock_uds(path: str) -> None:
    """Free the lock `lock_uds` took on `path` (a no-op when this process does not hold it)."""
    fd = _uds_locks.pop(path, None)
    if fd is not None:
        os.close(fd)


def release_uds(path: str, inode: int) -> None:
    """At the server's exit: remove its socket file at `path` if it is still the one of `inode`, then free the
    lock (in that order: a server that starts next on `path` finds no file of ours there)."""
    remove_if_same(path, inode)
    unlock_uds(path)


def open_listener(config: EngineConfig) -> tuple[socket.socket, int]:
    """The server's listening socket, inheritable: on `config.uds` (`listen_unix`), else on host:port
    (`listen_socket`). Returns it and, for a Unix socket, its file's inode (else 0).

    Raises:
        ConfigError, OSError: as `listen_unix` and `listen_socket` do.
    """
    if config.uds:
        return listen_unix(config.uds)
    return listen_socket(config.host.replace("[", "").replace("]", ""), config.port), 0  # "[::1]" as hypercorn


def endpoint(config: EngineConfig, port: int) -> str:
    """Where the server listens, for log lines (as hypercorn writes it): `unix:PATH` or `host:port`."""
    return f"unix:{config.uds}" if config.uds else address(config.host, port)


def private_folder(for_engine_socket: bool) -> str:
    """The supervisor's private folder (`owned_dirs.make`, mode 0700, removed at exit): in the temporary folder,
    unless it is to hold the private engine socket and TMPDIR is too long for that socket's path (systemd's
    per-service or per-user folders can be): then in FALLBACK_PARENT.

    Raises:
        OSError: the folder cannot be created or written.
    """
    folder = owned_dirs.make(FOLDER_PREFIX)
    if not for_engine_socket or socket_path_fits(os.path.join(folder, ENGINE_SOCKET_NAME)):
        return folder
    owned_dirs.remove(folder)
    short = owned_dirs.make(FOLDER_PREFIX, FALLBACK_PARENT)
    logger.info("the temporary folder %s is too long for a Unix socket's path: the engine socket goes in %s",
                os.path.dirname(folder), short)
    return short


def run_api_processes(config: EngineConfig, log_level: str | None = None) -> int:
    """Run `config.api_processes` API processes until SIGINT / SIGTERM; returns the exit status: that of the
    first child that exited on its own (1 when the engine died), else 1 if a child failed while stopping, else 0.

    Raises:
        OSError: the listening address is not available.
        ConfigError: as `EngineConfig.validate` (e.g. a `--uds` path too long for a Unix socket).
    """
    # the engine socket unless one is given; the metrics' files (`owned_dirs`: those of a killed supervisor go here)
    private = private_folder(for_engine_socket=not config.engine_socket)
    try:
        engine_socket = config.engine_socket or os.path.join(private, ENGINE_SOCKET_NAME)
        dataclasses.replace(config, engine_socket=engine_socket).validate()
        sock, uds_inode = open_listener(config)
    except BaseException:
        owned_dirs.remove(private)
        raise
    read_end, write_end = os.pipe()  # the children see EOF on read_end once this process is gone
    env = {**os.environ, "VOLTSERVE_API_PROCESSES": "1", LISTEN_FD_ENV: str(sock.fileno()),
           PARENT_FD_ENV: str(read_end), "VOLTSERVE_ENGINE_SOCKET": engine_socket,
           START_REPORT_ENV: os.path.join(private, "start-failure-reported")}
    port = 0
    if not config.uds:
        port = sock.getsockname()[1]  # --port 0: the one the OS chose, which the children log too
        env["VOLTSERVE_PORT"] = str(port)
    if not any(name in env for name in PROMETHEUS_DIR_VARIABLES):  # one /metrics over all API processes
        metrics_dir = env[PROMETHEUS_DIR_VARIABLES[0]] = os.path.join(private, "metrics")
        os.mkdir(metrics_dir)
    if log_level is not None:
        env["VOLTSERVE_LOG_LEVEL"] = log_level
    children: list[subprocess.Popen] = []
    signals = {"received": 0}
    sent: dict[int, int] = {}  # child pid -> SIGTERMs passed on to it

    def pass_on() -> None:
        """Each child gets as many SIGTERMs as this process received signals (its second ends its drain)."""
        for child in children:
            while sent.get(child.pid, 0) < signals["received"] and child.poll() is None:
                sent[child.pid] = sent.get(child.pid, 0) + 1
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)

    def on_signal(signum, frame) -> None:
        signals["received"] += 1
        pass_on()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    # a SIGINT or SIGTERM noted by `voltserve serve`'s early handler since its last check: passed on as on_signal does
    if console.take_signal():  # (several noted count as one)
        signals["received"] += 1
    try:
        for _ in range(config.api_processes):
            # a session of its own: a terminal's Ctrl-C reaches the supervisor only, which passes it on once
            children.append(subprocess.Popen([sys.executable, "-c", CHILD], env=env,
                                             pass_fds=(sock.fileno(), read_end), start_new_session=True))
            pass_on()  # a signal that came while it started
        os.close(read_end)
        read_end = -1
        logger.info("%d API processes (pids %s) on http://%s, one engine at %s", len(children),
                    " ".join(str(c.pid) for c in children), endpoint(config, port), env["VOLTSERVE_ENGINE_SOCKET"])
        status = _wait(children, lambda: signals["received"] > 0)
        if not config.engine_socket:  # its private engine: let it finish its own stop (a signal ends the wait)
            _wait_engine_exit(engine_socket + ENGINE_LOCK_SUFFIX, ENGINE_STOP_WAIT_S,
                              lambda: signals["received"] > 1)
    finally:
        for child in children:  # only after an error of our own: the children have exited otherwise
            if child.poll() is None:
                child.kill()
                child.wait()
        os.close(write_end)
        if read_end >= 0:
            os.close(read_end)
        sock.close()
        if uds_inode:
            release_uds(config.uds, uds_inode)
        owned_dirs.remove(private)
        # last: a signal during the cleanup is ours to count, not `voltserve serve`'s early handler's to note
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


def _wait_engine_exit(lock_path: str, timeout_s: float, hurry) -> None:
    """Wait until the engine process has exited: its engine lock (`actors.engine_socket`) is free."""
    deadline = time.monotonic() + timeout_s
    with open(lock_path, "a") as f:
        while not try_flock(f):
            if hurry() or time.monotonic() > deadline:
                logger.warning("leaving the engine process to finish its stop on its own")
                return
            time.sleep(POLL_S)


def _wait(children: list[subprocess.Popen], asked_to_stop) -> int:
    """Wait for every child to exit; the first that exits unasked stops the others. Returns the status."""
    status = 0
    while True:
        alive = [c for c in children if c.poll() is None]
        gone = [c for c in children if c.returncode is not None]
        if gone and status == 0 and not asked_to_stop():  # (all of them may have gone since the last look)
            status = gone[0].returncode if gone[0].returncode > 0 else 1  # killed (< 0) or quit unasked (0)
            # status 2: a bad setting or model file, which one API process has logged (`voltserve.start_report`)
            (logger.info if status == 2 else logger.error)(
                "API process %d exited with status %d; stopping the others", gone[0].pid, gone[0].returncode)
            for child in alive:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
        if not alive:
            # stopped as asked: 0, or the SIGTERM's default action for a child that had not set up its handlers
            failed = [c.returncode for c in children if c.returncode not in (0, -signal.SIGTERM)]
            return status or (1 if failed else 0)  # e.g. the engine died during the drain
        time.sleep(POLL_S)


def watch_parent(fd: int, on_gone) -> None:
    """Call `on_gone()` once when `fd`, the read end of the supervisor's pipe, reaches EOF (the supervisor has
    exited, however it ended). Call it on the running loop."""
    loop = asyncio.get_running_loop()

    def readable() -> None:
        if not os.read(fd, 1):
            loop.remove_reader(fd)
            on_gone()

    loop.add_reader(fd, readable)
