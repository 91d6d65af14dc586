"""`voltserve.owned_dirs`: the temporary folders of processes that were killed (the tensor-parallel rendezvous of
`actors.tp`, the private folder of `voltserve serve --api-processes`) are removed by the next process that makes one;
those of running processes, or that name no owner, stay."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from voltserve import api_processes, owned_dirs
from voltserve.config import EngineConfig


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """This test's own temporary folder (tempfile's, as TMPDIR sets it)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: no process has this pid now (the kernel hands pids out in turn, not again at once)
    return proc.pid


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _folder(parent, name: str, owner: str | None) -> str:
    folder = parent / name
    folder.mkdir()
    (folder / "store").write_text("x")  # what a rendezvous leaves
    if owner is not None:
        (folder / owned_dirs.OWNER_FILE).write_text(owner + "\n")
    return name


def test_only_folders_of_owners_that_are_gone_are_removed(tmp, dead_pid, live_pid):
    here = owned_dirs._pid_namespace()
    dead = _folder(tmp, "voltserve-tp-dead", f"{dead_pid} 123 {here}")
    reused = _folder(tmp, "voltserve-tp-reused", f"{live_pid} 1 {here}")  # the pid now names a newer process
    alive = _folder(tmp, "voltserve-tp-alive", owned_dirs._owner_line(live_pid))
    alive_no_proc = _folder(tmp, "voltserve-tp-alive2", f"{live_pid} - {here}")  # made where /proc was missing
    elsewhere = _folder(tmp, "voltserve-tp-ns", f"{dead_pid} 123 pid:[1]")  # another pid namespace: not judged
    unknown = _folder(tmp, "voltserve-tp-old", None)  # no owner line: an older voltserve's, or not written yet
    garbled = _folder(tmp, "voltserve-tp-garbled", "not a pid")
    other = _folder(tmp, "voltserve-api-dead", f"{dead_pid} 123 {here}")  # another prefix
    (tmp / "voltserve-tp-file").write_text("a file, not a folder")

    removed = owned_dirs.remove_stale("voltserve-tp-")

    assert sorted(removed) == [str(tmp / dead), str(tmp / reused)]
    assert sorted(os.listdir(tmp)) == sorted([alive, alive_no_proc, elsewhere, unknown, garbled, other,
                                              "voltserve-tp-file"])


def test_make_names_this_process_and_removes_stale_ones_first(tmp, dead_pid):
    stale = _folder(tmp, "voltserve-tp-stale", f"{dead_pid} 5 {owned_dirs._pid_namespace()}")
    folder = owned_dirs.make("voltserve-tp-")
    try:
        assert os.path.dirname(folder) == str(tmp) and os.path.basename(folder).startswith("voltserve-tp-")
        assert os.listdir(tmp) == [os.path.basename(folder)]  # the stale one is gone
        with open(os.path.join(folder, owned_dirs.OWNER_FILE)) as f:
            assert f.read() == owned_dirs._owner_line(os.getpid()) + "\n"
        assert owned_dirs.remove_stale("voltserve-tp-") == []  # ours, and we run
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    finally:
        owned_dirs.remove(folder)
    assert not os.path.exists(folder) and folder not in owned_dirs._mine
    assert stale not in os.listdir(tmp)


def test_folders_left_by_a_process_are_removed_at_its_exit_and_judged_stale_after_a_kill(tmp):
    code = ("import os, sys, tempfile\ntempfile.tempdir = sys.argv[1]\nfrom voltserve import owned_dirs\n"
            "print(owned_dirs.make('voltserve-tp-'), flush=True)\n"
            "if sys.argv[2] == 'kill':\n    os.kill(os.getpid(), 9)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    exited = subprocess.run([sys.executable, "-c", code, str(tmp), "exit"], capture_output=True, text=True, env=env)
    assert exited.returncode == 0 and not os.path.exists(exited.stdout.strip())  # atexit removed it
    killed = subprocess.run([sys.executable, "-c", code, str(tmp), "kill"], capture_output=True, text=True, env=env)
    assert killed.returncode == -9 and os.path.isdir(killed.stdout.strip())  # SIGKILL: no atexit
    assert owned_dirs.remove_stale("voltserve-tp-") == [killed.stdout.strip()]


def test_the_tensor_parallel_rendezvous_folder_is_owned_and_removes_stale_ones(tmp, dead_pid):
    from actors.tp import TPRanks

    stale = _folder(tmp, "voltserve-tp-stale", f"{dead_pid} 5 {owned_dirs._pid_namespace()}")
    ranks = TPRanks.start(EngineConfig(device="cpu", tensor_parallel_size=1).validate(), "cpu")  # rank 0 only
    try:
        assert os.listdir(tmp) == [os.path.basename(ranks.folder)] and stale not in os.listdir(tmp)
        assert owned_dirs.OWNER_FILE in os.listdir(ranks.folder)
    finally:
        ranks.stop()
    assert os.listdir(tmp) == []


def test_the_api_processes_private_folder_is_owned_and_removes_stale_ones(tmp, dead_pid, live_pid, monkeypatch):
    here = owned_dirs._pid_namespace()
    stale = _folder(tmp, "voltserve-api-stale", f"{dead_pid} 5 {here}")
    alive = _folder(tmp, "voltserve-api-alive", owned_dirs._owner_line(live_pid))
    seen = {}

    class Child:  # exits at once, as asked: the supervisor's folder exists meanwhile
        pid, returncode = 10**7, 0

        def __init__(self, *args, env, **kwargs):
            folder = os.path.dirname(env["VOLTSERVE_ENGINE_SOCKET"])
            seen.update(folder=folder, listing=sorted(os.listdir(tmp)), owner=os.listdir(folder))

        def poll(self):
            return 0

    monkeypatch.setattr(api_processes.subprocess, "Popen", Child)
    monkeypatch.setattr(api_processes, "ENGINE_STOP_WAIT_S", 0.0)
    api_processes.run_api_processes(EngineConfig(api_processes=1, port=0).validate())
    assert stale not in seen["listing"] and alive in seen["listing"]
    assert os.path.basename(seen["folder"]).startswith("voltserve-api-")
    assert sorted(seen["owner"]) == ["metrics", owned_dirs.OWNER_FILE]
    assert os.listdir(tmp) == [alive]  # its own folder removed at its exit


def test_a_tmpdir_too_long_for_the_engine_socket_moves_the_private_folder_to_tmp(tmp_path, monkeypatch):
    """TMPDIR of 80+ bytes (systemd's per-service or per-user folders): TMPDIR/voltserve-api-XXXXXXXX/engine.sock
    passed a Unix socket's 107 bytes and `voltserve serve --api-processes 2` exited with status 2 ("engine_socket
    must be a path of at most 100 bytes"); now the private folder goes in /tmp (mode 0700, removed at exit)."""
    from voltserve.config import MAX_SOCKET_PATH_BYTES

    long_tmp = tmp_path / ("t" * max(1, 81 - len(str(tmp_path))))
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    seen = {}

    class Child:  # exits at once, as asked: the supervisor's folder exists meanwhile
        pid, returncode = 10**7, 0

        def __init__(self, *args, env, **kwargs):
            folder = os.path.dirname(env["VOLTSERVE_ENGINE_SOCKET"])
            seen.update(socket=env["VOLTSERVE_ENGINE_SOCKET"], mode=os.stat(folder).st_mode & 0o777,
                        owner=sorted(os.listdir(folder)), long_tmp=os.listdir(long_tmp))

        def poll(self):
            return 0

    monkeypatch.setattr(api_processes.subprocess, "Popen", Child)
    monkeypatch.setattr(api_processes, "ENGINE_STOP_WAIT_S", 0.0)
    api_processes.run_api_processes(EngineConfig(api_processes=1, port=0).validate())  # the child "quits": 1
    folder, name = os.path.split(seen["socket"])
    assert os.path.dirname(folder) == "/tmp" and os.path.basename(folder).startswith("voltserve-api-")
    assert name == "engine.sock" and len(os.fsencode(seen["socket"])) <= MAX_SOCKET_PATH_BYTES
    assert seen["mode"] == 0o700 and seen["owner"] == ["metrics", owned_dirs.OWNER_FILE]
    assert seen["long_tmp"] == []  # nothing of it left in TMPDIR
    assert not os.path.exists(folder) and os.listdir(long_tmp) == []  # removed at the supervisor's exit


def test_the_private_folder_stays_in_tmpdir_where_the_socket_fits_or_one_is_given(tmp, monkeypatch):
    """The fallback is for the private engine socket's path only: a TMPDIR that fits it, or a given
    `--engine-socket` (the folder then holds the metrics' files only), keeps the folder in TMPDIR."""
    folder = api_processes.private_folder(for_engine_socket=True)
    assert os.path.dirname(folder) == str(tmp)
    owned_dirs.remove(folder)
    long_tmp = tmp / ("t" * 100)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    folder = api_processes.private_folder(for_engine_socket=False)
    assert os.path.dirname(folder) == str(long_tmp)
    owned_dirs.remove(folder)
