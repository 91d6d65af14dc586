"""The files of a shared engine (`EngineConfig.engine_socket`): its Unix socket and two locks next to it.

- `PATH`: the engine's listening socket, bound by the API process that starts the engine (under the start lock,
  before the engine process exists, so that an API process arriving at any later moment finds it and queues
  there), handed to the engine process, mode 0600 (it takes pickled messages: whoever connects can run code in
  the engine), removed by the engine as the last thing it does.
- `PATH.lock`: the start lock; an API process holds it while it connects or starts the engine.
- `PATH.engine`: held by the engine process for its whole life (the open file is inherited from the API process
  that started it); a new engine waits for it, so that it never starts while an old one still stops (on a GPU the
  two would not fit), and `voltserve serve --api-processes` waits for it before it exits.
- `PATH.failed`: written by an engine process whose start failed (a token of its own, then the error), mode 0600;
  an API process that waited for the start lock, or attached to that engine while it loaded, and finds a note
  other than the one there when it began to wait fails with that error instead of loading the model again (one
  load, not one per API process in turn); an engine that starts removes it. No clocks are compared.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
import uuid

from voltserve.errors import ConfigError

START_LOCK_SUFFIX = ".lock"
ENGINE_LOCK_SUFFIX = ".engine"
FAILED_SUFFIX = ".failed"
LOCK_POLL_S = 0.05


async def acquire_lock(path: str, timeout_s: float | None = None):
    """Open `path` (created if missing) and take an exclusive flock on it, polling (a cancelled wait leaves
    nothing behind); closing the returned file releases it, as does the exit of every process holding it open.

    Raises:
        TimeoutError: not free within `timeout_s` seconds (None: wait as long as it takes).
    """
    f = open(path, "a")  # noqa: SIM115 - the caller closes it
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not try_flock(f):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{path} is still locked after {timeout_s:g} s")
            await asyncio.sleep(LOCK_POLL_S)
        return f
    except BaseException:
        f.close()
        raise


def try_flock(f) -> bool:
    """Take an exclusive flock on the open file `f` if it is free; returns whether it did."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _check_ours(path: str) -> os.stat_result | None:
    """The stat of `path` (None if there is no file).

    Raises:
        ConfigError: it is not a socket, or another user's (we would unpickle what it sends).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"engine_socket {path} exists and is not a socket")
    if st.st_uid != os.getuid():
        raise ConfigError(f"engine_socket {path} belongs to another user (uid {st.st_uid})")
    return st


def connect(path: str) -> socket.socket | None:
    """A socket connected to the engine listening at `path`, or None when nobody listens there (no file, or one
    a dead engine left).

    Raises:
        ConfigError: see `_check_ours`.
    """
    if _check_ours(path) is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        return sock
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED):
            return None
        raise


def bind_listener(path: str) -> tuple[socket.socket, int]:
    """Listen at `path` (a dead engine's socket file there is replaced; the caller holds the start lock and
    found nobody listening), mode 0600. Returns the socket and the file's inode (whose removal is the engine's).

    Raises:
        ConfigError: see `_check_ours`.
    """
    if _check_ours(path) is not None:
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)  # before listen(): nobody can connect in between
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock, os.stat(path).st_ino


def remove_if_same(path: str, inode: int) -> None:
    """Remove the socket file at `path` if it is still the one of that inode."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


def record_failure(path: str, error: BaseException) -> None:
    """Note that the engine at `path` failed to start with `error` (`PATH.failed`, replaced atomically)."""
    note = f"{uuid.uuid4().hex}\n{type(error).__name__}: {error}"
    tmp = f"{path}{FAILED_SUFFIX}.{os.getpid()}"
    with contextlib.suppress(OSError):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as f:
            f.write(note)
        os.replace(tmp, path + FAILED_SUFFIX)


def read_failure(path: str) -> str | None:
    """The failure note of the engine at `path` (compare two reads: each failure writes a new one), or None when
    there is none or it is not this user's."""
    try:
        with open(path + FAILED_SUFFIX) as f:
            return f.read() if os.fstat(f.fileno()).st_uid == os.getuid() else None
    except OSError:
        return None


def failure_error(note: str) -> str:
    """The error a `read_failure` note names."""
    return note.partition("\n")[2]


def clear_failure(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path + FAILED_SUFFIX)
