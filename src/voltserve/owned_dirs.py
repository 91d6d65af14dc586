"""Temporary folders that name the process owning them, so that the folders of a process that was killed
(SIGKILL, a crash: no `finally` ran) do not stay in /tmp for good: the next process that makes one of the same kind
removes them.

Each folder (`tempfile.mkdtemp`, so under TMPDIR) holds a file OWNER_FILE with one line "PID START PIDNS": the
owner's pid, its start time (field 22 of /proc/PID/stat, in clock ticks since boot; a pid the kernel gave to
another process since has another) and its pid namespace (/proc/self/ns/pid; in another namespace the pid means
another process, so such a folder is never judged). A folder is stale when its owner line is well formed, names
this namespace, and no process with that pid and start time runs. A folder without an owner line (written by an
older voltserve, or its owner was killed between the two calls that make it) is left alone: nothing says whose it
is. Only folders of this user are looked at.

Used by `actors.tp` (the tensor-parallel ranks' rendezvous) and `voltserve.api_processes` (the private engine
socket and the metrics' files). The folders a process made are also removed when it exits normally (atexit), and
by `remove_mine()`, for a process that must exit at once (`os._exit`) in the middle of its start.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile

logger = logging.getLogger(__name__)

OWNER_FILE = "voltserve-owner"
# the folders this process made and has not removed, with its pid (a forked child must not remove its parent's)
_mine: dict[str, int] = {}


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, from /proc/PID/stat); None where there is no /proc or no
    such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: count fields after its last ")"
    fields = text[text.rindex(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc (not Linux): one namespace as far as we can tell
        return "-"


def _owner_line(pid: int) -> str:
    return f"{pid} {_start_time(pid) or '-'} {_pid_namespace()}"


def _is_stale(folder: str) -> bool:
    """Whether `folder`'s owner line names a process of this pid namespace that no longer runs."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            pid_text, started, namespace = f.read().split()
        pid = int(pid_text)
    except (OSError, ValueError):  # no owner line (yet), or not ours to read: not judged
        return False
    if namespace != _pid_namespace() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it runs, as another user
        return False
    return started != "-" and _start_time(pid) not in (None, started)  # the pid now names another process


def remove_stale(prefix: str, parent: str | None = None) -> list[str]:
    """Remove this user's folders `parent/prefix*` (default: the temporary folder) whose owner has exited.

    Args:
        prefix: the folders' name prefix, as given to `make`.
        parent: where to look; None = `tempfile.gettempdir()`.
    Returns:
        the folders removed.
    """
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        folder = os.path.join(parent, name)
        if not name.startswith(prefix) or folder in _mine:
            continue
        try:
            st = os.lstat(folder)
        except OSError:  # removed meanwhile
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and _is_stale(folder):
            shutil.rmtree(folder, ignore_errors=True)
            logger.info("removed %s, left behind by a process that is gone", folder)
            removed.append(folder)
    return removed


def make(prefix: str, parent: str | None = None) -> str:
    """A new private folder `parent/prefix*` (mode 0700) that names this process as its owner, after removing the
    stale ones of the same prefix there (`remove_stale`). Remove it with `remove`.

    Args:
        prefix: the folder's name prefix (a random 8-character suffix follows, `tempfile.mkdtemp`).
        parent: where to make it; None = `tempfile.gettempdir()` (TMPDIR).
    Raises:
        OSError: the folder cannot be created or written.
    """
    remove_stale(prefix, parent)
    folder = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        with open(os.path.join(folder, OWNER_FILE), "w") as f:
            f.write(_owner_line(os.getpid()) + "\n")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    _mine[folder] = os.getpid()
    return folder


def remove(folder: str) -> None:
    """Remove a folder `make` returned, with what it holds (a missing one is fine)."""
    _mine.pop(folder, None)
    shutil.rmtree(folder, ignore_errors=True)


def remove_mine() -> None:
    """Remove every folder this process made and still has (at its exit, or before an `os._exit`)."""
    for folder, pid in list(_mine.items()):
        if pid == os.getpid():
            remove(folder)


atexit.register(remove_mine)
