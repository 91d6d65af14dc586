"""`voltserve serve --uds PATH` takes PATH.lock (flock) before it looks at, replaces and binds the socket file: of
two servers that start at once on a stale socket file (its server was killed), one serves there and the other
exits with one line and status 2. Before, both could find the file stale, and the second's unlink took the path
from the first, whose socket then served nobody."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.loaders.test_gguf import write_tiny_gguf
from voltserve import api_processes
from voltserve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
# a server's listen step alone: one line ("listening", or the error), then it holds the socket until stdin closes
RIVAL = """import sys
from voltserve.api_processes import listen_unix
from voltserve.errors import ConfigError
try:
    sock, _ = listen_unix(sys.argv[1])
except ConfigError as exc:
    print(exc, flush=True)
    sys.exit(2)
print("listening", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def sock_path():
    """A socket path in a fresh short folder (a pytest tmp_path can pass a Unix socket's 100 bytes)."""
    folder = tempfile.mkdtemp(prefix="vs-uds-")
    yield os.path.join(folder, "api.sock")
    shutil.rmtree(folder, ignore_errors=True)


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("VOLTSERVE_")},
            "PYTHONPATH": os.pathsep.join(sys.path)}


def _rival(path: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RIVAL, path], cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _leave_stale_socket(path: str) -> None:
    with socket.socket(socket.AF_UNIX) as stale:  # bound, never listened on, closed: connect() is refused
        stale.bind(path)


def _busy_message(path: str) -> str:
    return f"uds {path!r}: another voltserve serves there or is starting to (it holds {path + '.lock'!r})"


def _lock_is_free(path: str) -> bool:
    with open(path + ".lock") as f:  # another open file description: it conflicts with this process's own lock
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_of_two_servers_on_one_stale_socket_one_serves_and_the_other_fails(sock_path, monkeypatch):
    """The race made certain: the rival starts and finishes its own listen step after this server found the file
    stale and before it removes it."""
    _leave_stale_socket(sock_path)
    rivals: list[tuple[subprocess.Popen, str]] = []
    real_unlink = os.unlink

    def rival_first(path, *args, **kwargs):
        if path == sock_path and not rivals:
            rival = _rival(sock_path)
            rivals.append((rival, rival.stdout.readline()))  # its listen step done, whichever way it went
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", rival_first)
    sock, inode = api_processes.listen_unix(sock_path)
    monkeypatch.undo()
    try:
        (rival, line), = rivals
        try:
            status = rival.wait(timeout=30)
        except subprocess.TimeoutExpired:  # it serves on a socket file that is no longer at the path
            status = None
        assert (status, line) == (2, _busy_message(sock_path) + "\n")
        assert os.stat(sock_path).st_ino == inode
        with socket.socket(socket.AF_UNIX) as client:  # a client at the path reaches this server
            client.connect(sock_path)
            sock.accept()[0].close()
    finally:
        rival.kill()
        rival.wait()
        sock.close()
        api_processes.release_uds(sock_path, inode)
    assert not os.path.exists(sock_path) and _lock_is_free(sock_path)


def test_a_second_serve_on_the_path_exits_2_with_one_line(sock_path, tmp_path):
    """`voltserve serve --uds PATH` while another server holds PATH (here: this process, still in its load)."""
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    _leave_stale_socket(sock_path)
    sock, inode = api_processes.listen_unix(sock_path)
    try:
        proc = subprocess.run([sys.executable, "-m", "voltserve.cli", "serve", str(model), "--uds", sock_path,
                               "--device", "cpu", "--num-kv-blocks", "64"], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=120)
        assert os.stat(sock_path).st_ino == inode  # left alone
    finally:
        sock.close()
        api_processes.release_uds(sock_path, inode)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if "ERROR" in x]
    assert line.endswith(" ERROR voltserve.cli: bad configuration: " + _busy_message(sock_path)), proc.stderr


def test_a_killed_servers_lock_and_socket_are_taken_over(sock_path):
    """kill -9 frees the lock (the kernel drops it with the process) and leaves a stale socket file: replaced."""
    rival = _rival(sock_path)
    try:
        assert rival.stdout.readline() == "listening\n"
        with pytest.raises(ConfigError) as error:
            api_processes.listen_unix(sock_path)
        assert str(error.value) == _busy_message(sock_path)
        rival.send_signal(signal.SIGKILL)
        rival.wait()
    finally:
        rival.kill()
        rival.wait()
    sock, inode = api_processes.listen_unix(sock_path)
    try:
        assert not _lock_is_free(sock_path)
        with socket.socket(socket.AF_UNIX) as client:  # the killed one's file was replaced: this one serves
            client.connect(sock_path)
            sock.accept()[0].close()
    finally:
        sock.close()
        api_processes.release_uds(sock_path, inode)
    assert not os.path.exists(sock_path) and _lock_is_free(sock_path)


def test_a_failed_listen_frees_the_lock(sock_path):
    """A live server's socket (not voltserve's: no lock) or another file: refused, left alone, the lock let go."""
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(sock_path)
        live.listen()
        with pytest.raises(ConfigError, match="a server listens there already"):
            api_processes.listen_unix(sock_path)
        assert os.path.exists(sock_path) and _lock_is_free(sock_path)


@pytest.mark.parametrize("sig, status", [("SIGTERM", 0), ("SIGINT", 130)])
def test_a_signal_after_the_listen_and_before_the_servers_handlers_removes_the_socket(sock_path, tmp_path, sig,
                                                                                       status):
    """The socket is bound before the model loads, and `import api` (torch: about a second) comes before the
    server's own handlers: a `systemctl stop` (or Ctrl-C) there ended with status 0 (130) but left the socket file,
    which a proxy then found refusing connections. Here the signal comes where `voltserve serve` logs its
    endpoint, after `import api`."""
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    script = ("import os, signal, sys\nfrom voltserve import cli\n"
              f"cli.endpoint = lambda *args: os.kill(os.getpid(), signal.{sig})\n"
              f"sys.exit(cli.main(['serve', {str(model)!r}, '--device', 'cpu', '--uds', {sock_path!r}]))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == status, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not os.path.exists(sock_path) and _lock_is_free(sock_path)


def test_a_lock_file_that_cannot_be_opened_is_named_in_the_error(sock_path, tmp_path):
    """A PATH.lock this user cannot open (e.g. left with mode 0600 by a server that ran as root or under
    UMask=0077; here a folder, which root cannot open either) was reported as "cannot listen on unix:PATH:
    Permission denied", though PATH itself was free to bind: the operator looked at the wrong file."""
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    os.mkdir(sock_path + ".lock")
    done = subprocess.run([sys.executable, "-m", "voltserve.cli", "serve", str(model), "--uds", sock_path,
                           "--device", "cpu"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert [line.split(" ", 2)[2] for line in done.stderr.splitlines()] == [
        f"ERROR voltserve.cli: bad configuration: uds {sock_path!r}: cannot open its lock file "
        f"{sock_path + '.lock'!r}: Is a directory (remove it if no voltserve serves there)"]
    assert not os.path.exists(sock_path)
