"""SIGTERM / SIGINT while the model loads (systemd's `systemctl stop` during a long load): the server exits at once,
with status 0, and leaves no process (engine process, tensor-parallel ranks, API processes) and no temporary
folder behind. Before, it reacted only once the load had finished, and systemd killed it after TimeoutStopSec.

The load is made slow in every process of the server by `slow_load_hook/sitecustomize.py`."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from actors.engine_process import ProcessEngine
from tests.e2e import slow_start_engine
from tests.loaders.test_gguf import write_tiny_gguf
from voltserve.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
HOOK = Path(__file__).resolve().parent / "slow_load_hook"
LOAD_DELAY_S = 300.0  # far past the bound below: a server that waits for the load fails, it does not pass late
EXIT_BOUND_S = 10.0  # the exit takes ~1-2 s on a 2-core machine; the rest is a margin for a busy one
SERVE = [sys.executable, "-m", "voltserve.cli", "serve"]


@pytest.fixture
def short_tmpdir():
    """A fresh, short TMPDIR for the server: --api-processes puts its engine socket in a folder there, and a
    pytest tmp_path (/tmp/pytest-of-USER/pytest-NNN/test_...) can push that path past a Unix socket's 100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="vs-sdl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process on this host (from /proc)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    text = f.read()
            except OSError:
                continue
            ppid = int(text[text.rindex(b")") + 2:].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        kids = tree.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return False
    return text[text.rindex(b")") + 2:].split()[0] not in (b"Z", b"X")


def _wait_for_loads(log: Path, count: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= count):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the loads did not start in 120 s"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("command, loads, sig", [
    ([], 1, signal.SIGTERM),  # the default: one API process, the engine process loads
    (["--tensor-parallel-size", "2"], 2, signal.SIGTERM),  # the engine process and rank 1 load
    (["--tensor-parallel-size", "2"], 2, signal.SIGINT),  # Ctrl-C: the same
    (["--api-processes", "2"], 1, signal.SIGTERM),  # a supervisor, 2 API processes, one engine process
    (["--tensor-parallel-size", "2", "--no-engine-process"], 2, signal.SIGTERM),  # rank 0 loads in the API process
    ("hypercorn", 1, signal.SIGTERM),  # a bare `hypercorn api:app`: its worker process, the engine process
], ids=["engine-process", "tp2-sigterm", "tp2-sigint", "api-processes", "no-engine-process", "hypercorn"])
def test_a_signal_during_the_load_stops_the_server_at_once(tmp_path, short_tmpdir, command, loads, sig):
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)  # heads 4, KV heads 2: TP 2 splits them
    tmp = short_tmpdir  # the server's TMPDIR: its temporary folders must all be gone afterwards
    log = tmp_path / "loads.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOK), *sys.path]), "TMPDIR": str(tmp),
           "VOLTSERVE_TEST_LOAD_DELAY_S": str(LOAD_DELAY_S), "VOLTSERVE_TEST_LOAD_LOG": str(log),
           "VOLTSERVE_API_KEY": "", "VOLTSERVE_LOG_LEVEL": "info"}
    if command == "hypercorn":
        env.update(VOLTSERVE_MODEL=str(model), VOLTSERVE_DEVICE="cpu", VOLTSERVE_NUM_KV_BLOCKS="64")
        argv = [sys.executable, "-m", "hypercorn", "api:app", "--bind", "127.0.0.1:0"]
    else:
        argv = [*SERVE, str(model), "--device", "cpu", "--port", "0", "--num-kv-blocks", "64", *command]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    family: list[int] = []
    try:
        _wait_for_loads(log, loads, proc)
        family = _descendants(proc.pid)
        assert family  # at least the engine process (or the rank, or hypercorn's worker)
        start = time.monotonic()
        proc.send_signal(sig)
        status = proc.wait(timeout=EXIT_BOUND_S)
        took_s = time.monotonic() - start
        output = proc.stdout.read()
        deadline = time.monotonic() + 5  # an orphan is reparented, and so still runs: the last ones get a moment
        while [p for p in family if _running(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in family if _running(p)]
    finally:
        for pid in {proc.pid, *family, *_descendants(proc.pid)}:  # an orphaned rank is no descendant any more
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert status == 0, output[-3000:]
    assert took_s < EXIT_BOUND_S
    assert left == [], output[-3000:]
    assert sorted(os.listdir(tmp)) == []  # no rendezvous folder of the ranks, no private folder of the supervisor
    assert "while the engine starts: stopping its start" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    # hypercorn opens its listeners after the cancelled start and logged "Running on ..." after the stop
    assert "Running on" not in output, output[-3000:]


@pytest.mark.slow
def test_a_killed_engine_leaves_no_rank_and_its_folder_goes_at_the_next_start(tmp_path):
    """SIGKILL of the engine process while it loads (no handler runs): its rank process exits at once instead of
    loading for nobody, and the rendezvous folder it leaves names a dead owner, so the next engine's start
    (`owned_dirs.make`) removes it."""
    from voltserve import owned_dirs

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    tmp, log = tmp_path / "tmp", tmp_path / "loads.log"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOK), *sys.path]), "TMPDIR": str(tmp),
           "VOLTSERVE_TEST_LOAD_DELAY_S": str(LOAD_DELAY_S), "VOLTSERVE_TEST_LOAD_LOG": str(log)}
    argv = [*SERVE, str(model), "--device", "cpu", "--port", "0", "--num-kv-blocks", "64", "--tensor-parallel-size",
            "2"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    family: list[int] = []
    try:
        _wait_for_loads(log, 2, proc)
        family = _descendants(proc.pid)
        loading = {int(line.split()[1]) for line in log.read_text().splitlines()}
        (engine_pid,) = loading & set(_children()[proc.pid])  # rank 0; rank 1 is its child
        (rank_pid,) = loading - {engine_pid}
        os.kill(engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _running(rank_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(rank_pid)
        assert proc.wait(timeout=30) == 1  # the engine died while starting
    finally:
        for pid in {proc.pid, *family, *_descendants(proc.pid)}:  # an orphaned rank is no descendant any more
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    (left,) = os.listdir(tmp)
    assert left.startswith("voltserve-tp-")
    assert owned_dirs.remove_stale("voltserve-tp-", str(tmp)) == [str(tmp / left)] and os.listdir(tmp) == []


async def test_the_engine_process_on_sigterm_stops_cleanly_and_during_its_start_at_once(tmp_path, monkeypatch):
    """The engine process itself: SIGTERM once it serves is a clean stop (exit 0, as StopMsg; it was killed by the
    signal before), and during its start (a load of 600 s here) an exit at once, also with status 0."""
    engine = ProcessEngine(EngineConfig(model="x"), functools.partial(slow_start_engine.make, 0.0))
    await engine.start()
    engine.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(engine.process.wait, 10) == 0
    await engine.stop()

    engine = ProcessEngine(EngineConfig(model="x"), functools.partial(slow_start_engine.make, 600.0))
    log = tmp_path / "engine.log"
    monkeypatch.setenv(slow_start_engine.LOG_ENV, str(log))  # the engine process logs when its start begins
    starting = asyncio.create_task(engine.start())
    while not log.exists():
        await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    start = loop.time()
    starting.cancel()  # what a SIGTERM to the server does: ProcessEngine then terminates its engine process
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert engine.process.returncode == 0 and loop.time() - start < EXIT_BOUND_S
