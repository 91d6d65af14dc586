"""A shared engine (`EngineConfig.engine_socket`): several API processes, one engine process, on a tiny
random-weight model. Each ProcessEngine here stands for one API process (as each worker of `hypercorn -w N
api:app` holds one); the last test runs hypercorn with two workers."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from actors import engine_socket
from actors.engine_ipc import EngineDiedMsg
from actors.engine_process import ProcessEngine
from api import create_app
from tests.e2e import slow_start_engine
from tests.e2e.engine_helpers import assert_engine_dead, complete
from tests.e2e.test_metrics_gauges import scrape_gauges
from tests.helpers import stop_process
from voltserve.config import EngineConfig
from voltserve.errors import ConfigError, EngineDeadError, LoaderError
from voltserve.request import FinishReason, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
LONG = dict(ignore_eos=True, max_tokens=None)  # runs until aborted (the context is long)


def _config(tiny_dir, sock_path, **overrides) -> EngineConfig:
    values = dict(model=str(tiny_dir), device="cpu", max_model_len=4096, num_kv_blocks=256, engine_socket=sock_path)
    return EngineConfig(**{**values, **overrides})


async def _greedy(engine, text: str = "hello", n: int = 6) -> list[int]:
    _, tokens, last = await complete(engine, engine.tokenizer.encode(text), temperature=0, max_tokens=n,
                                     ignore_eos=True)
    assert last.finish_reason is FinishReason.LENGTH
    return tokens


async def _wait_exit(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the engine process did not exit"
        await asyncio.sleep(0.05)
    return proc.returncode


async def test_second_api_process_attaches_to_the_first_ones_engine(tiny_dir, sock_path):
    first, second = ProcessEngine(_config(tiny_dir, sock_path)), ProcessEngine(_config(tiny_dir, sock_path,
                                                                                       port=9001))
    await first.start()
    try:
        await second.start()  # another port (an API-only setting): still the same engine
        assert first.process is not None and second.process is None
        assert second.max_model_len == first.max_model_len == 4096
        assert second.kv_stats()["num_blocks"] == 256
        alone = await _greedy(first)
        both = await asyncio.gather(_greedy(first), _greedy(second), _greedy(second, "other"))
        assert both[0] == both[1] == alone and len(alone) == 6
        assert both[2] != alone
        # a request of each runs at once; each process gets its own outputs only
        a = first.add_request(first.tokenizer.encode("hello"), SamplingParams(**LONG))
        b = second.add_request(second.tokenizer.encode("other"), SamplingParams(**LONG))
        out_a, out_b = await a.__anext__(), await b.__anext__()
        assert out_a.request_id == a.request_id and out_b.request_id == b.request_id
        assert second.kv_stats()["num_running"] + second.kv_stats()["num_waiting"] >= 1
        a.abort()
        b.abort()
        assert [o async for o in a][-1].finish_reason is FinishReason.ABORT
        assert [o async for o in b][-1].finish_reason is FinishReason.ABORT
    finally:
        await second.stop()
        await first.stop()
    assert await _wait_exit(first.process) == 0
    assert not os.path.exists(sock_path)


async def test_an_api_process_that_leaves_has_its_requests_aborted(tiny_dir, sock_path):
    first, second = ProcessEngine(_config(tiny_dir, sock_path)), ProcessEngine(_config(tiny_dir, sock_path))
    await first.start()
    await second.start()
    try:
        running = second.add_request(second.tokenizer.encode("hello"), SamplingParams(**LONG))
        await running.__anext__()
        await second.stop()  # its socket closes: the engine aborts its request, and serves the others
        with pytest.raises(EngineDeadError):
            async for _ in running:
                pass
        assert not second.is_healthy and first.is_healthy
        assert len(await _greedy(first)) == 6
        # aborted within a step or so: far sooner than the ~10 s it would take to fill its 4,096-token context
        deadline = time.monotonic() + 2
        while first.kv_stats()["num_running"] or first.kv_stats()["num_waiting"]:
            assert time.monotonic() < deadline, first.kv_stats()
            await _greedy(first, n=1)
    finally:
        await first.stop()
    assert await _wait_exit(first.process) == 0


async def test_metrics_of_one_api_process_show_the_engine_as_it_is(tiny_dir, sock_path):
    """/metrics of an API process reads the shared engine's present state: another process's request while it
    runs, and nothing once it ended, although this process's own last output (sent while that request ran)
    said one was running. (Each API process used to serve the figures of its last output: after a run,
    scrapes alternated between processes and showed requests running on an idle engine.)"""
    first = ProcessEngine(_config(tiny_dir, sock_path))
    await first.start()
    second = ProcessEngine(_config(tiny_dir, sock_path))
    try:
        async with create_app(second).test_app() as test_app:
            client = test_app.test_client()
            running = first.add_request(first.tokenizer.encode("hello"), SamplingParams(**LONG))
            await running.__anext__()
            gauges = await scrape_gauges(client)
            assert gauges[:2] == (1, 0) and gauges[2] > 0
            response = await client.post("/v1/completions", json={"model": second.config.served_model_name,
                                                                   "prompt": "other", "max_tokens": 3})
            assert response.status_code == 200
            assert second.kv_stats()["num_running"] == 1  # as of its last output: the other request ran
            running.abort()
            assert [o async for o in running][-1].finish_reason is FinishReason.ABORT
            assert await scrape_gauges(client) == (0, 0, 0)
            assert second.kv_stats()["num_running"] == 0
    finally:
        await first.stop()
    assert await _wait_exit(first.process) == 0


async def test_the_engine_outlives_the_process_that_started_it(tiny_dir, sock_path):
    first, second = ProcessEngine(_config(tiny_dir, sock_path)), ProcessEngine(_config(tiny_dir, sock_path))
    await first.start()
    await second.start()
    proc = first.process
    await first.stop()
    assert proc.poll() is None  # the other API process still uses it
    assert len(await _greedy(second)) == 6
    third = ProcessEngine(_config(tiny_dir, sock_path))
    await third.start()  # a restarted worker attaches again
    assert third.process is None and len(await _greedy(third)) == 6
    await second.stop()
    await third.stop()
    assert await _wait_exit(proc) == 0  # the last one has gone


async def test_an_api_process_starting_as_the_last_one_leaves_gets_an_engine(tiny_dir, sock_path):
    """It may connect just before the engine exits: it starts over (attaching, or starting an engine once the old
    one has exited: never two at once)."""
    engine = ProcessEngine(_config(tiny_dir, sock_path))
    await engine.start()
    engine_proc = engine.process
    for _ in range(3):
        successor = ProcessEngine(_config(tiny_dir, sock_path))
        await engine.stop()
        await successor.start()
        assert successor.is_healthy and len(await _greedy(successor)) == 6
        if successor.process is not None:  # it started a new engine: the old one had exited
            assert engine_proc.poll() is not None
            engine_proc = successor.process
        engine = successor
    await engine.stop()


async def test_an_attach_that_meets_the_engine_exit_starts_over(tiny_dir, sock_path, monkeypatch):
    """The newcomer connects, then (held up here) attaches only after the engine's last API process has left
    and the engine has given up on the silent connection (ATTACH_DEADLINE_S) and exited: its attach fails, and
    it starts over with an engine of its own."""
    first = ProcessEngine(_config(tiny_dir, sock_path))
    await first.start()
    connect = engine_socket.connect
    calls = []

    def connect_then_leave(path):
        sock = connect(path)
        if not calls:  # the first connection: the engine's last API process leaves now, and the engine exits
            first._close_conn()
            first.process.wait(30)
        calls.append(sock is not None)
        return sock

    monkeypatch.setattr(engine_socket, "connect", connect_then_leave)
    second = ProcessEngine(_config(tiny_dir, sock_path))
    await second.start()
    try:
        assert calls[0] and second.process is not None and len(await _greedy(second)) == 6
    finally:
        await second.stop()
        await first.stop()


async def test_stray_connections_do_not_hold_up_the_engine(tiny_dir, sock_path):
    """Not API processes: an HTTP request (read as a huge message) and half a message are dropped at once."""
    first = ProcessEngine(_config(tiny_dir, sock_path))
    await first.start()
    strays = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    try:
        for stray in strays:
            stray.connect(sock_path)
        strays[0].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        strays[1].sendall(struct.pack("!i", 100) + b"0123456789")  # a 100-byte message, 10 bytes of it
        second = ProcessEngine(_config(tiny_dir, sock_path))
        await asyncio.wait_for(second.start(), 5)
        assert second.process is None and len(await asyncio.wait_for(_greedy(second), 5)) == 6
        await second.stop()
    finally:
        for stray in strays:
            stray.close()
        await first.stop()


async def test_an_engine_that_exits_right_after_ready_fails_the_start(sock_path):
    """Its ReadyMsg and its exit are read in one go: start() raises, it does not report a healthy engine with no
    connection (whose requests would hang)."""
    engine = ProcessEngine(EngineConfig(model="x"), functools.partial(slow_start_engine.make_exiting, 1.0))
    read = engine._on_readable

    def read_after_the_exit() -> None:  # the first read comes once the engine process has exited
        os.waitid(os.P_PID, engine.process.pid, os.WEXITED | os.WNOWAIT)
        read()

    engine._on_readable = read_after_the_exit
    with pytest.raises(EngineDeadError, match="right after it was ready"):
        await asyncio.wait_for(engine.start(), 30)
    assert not engine.is_healthy
    await engine.stop()


async def test_engine_died_during_start_is_the_start_error():
    engine = ProcessEngine(EngineConfig(model="x"))
    engine._loop = asyncio.get_running_loop()
    engine._ready = engine._loop.create_future()
    engine._dispatch(EngineDiedMsg(RuntimeError("device lost")))
    with pytest.raises(EngineDeadError, match="device lost"):
        await asyncio.wait_for(engine._ready, 5)
    assert engine._dead is None  # a retried attach is not dead on arrival


async def _kill_starter_during_the_load(sock_path: str, log: str, make: str) -> None:
    """Start the shared engine at `sock_path` from another API process (a subprocess) with the engine factory
    `slow_start_engine.<make>` and a 3 s start, and kill that process once its engine has begun the start (the
    engine's LOG_ENV file `log` exists)."""
    factory = f"functools.partial(__import__('tests.e2e.slow_start_engine').e2e.slow_start_engine.{make}, 3.0)"
    starter = subprocess.Popen([sys.executable, "-c", (
        "import asyncio, functools, sys; from actors.engine_process import ProcessEngine; "
        "from voltserve.config import EngineConfig; "
        f"e = ProcessEngine(EngineConfig(model='x', engine_socket=sys.argv[1]), {factory}); "
        "asyncio.run(e.start())"), sock_path], cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT}/src"})
    deadline = time.monotonic() + 30
    while not os.path.exists(log):  # its engine has begun its 3 s start
        assert starter.poll() is None and time.monotonic() < deadline
        await asyncio.sleep(0.05)
    starter.kill()
    starter.wait()


async def test_an_engine_whose_starter_died_serves_the_next_api_process(sock_path, monkeypatch):
    """The starting API process binds the socket before the engine process exists: an API process that comes
    while the engine loads (its starter killed meanwhile) waits for it instead of starting a second engine."""
    log = os.path.join(os.path.dirname(sock_path), "engines.log")
    monkeypatch.setenv(slow_start_engine.LOG_ENV, log)  # the engine processes inherit it
    await _kill_starter_during_the_load(sock_path, log, "make")
    late = ProcessEngine(EngineConfig(model="x", engine_socket=sock_path),
                         functools.partial(slow_start_engine.make, 0.0))
    await late.start()
    try:
        assert late.process is None  # attached to the first engine, which outlived its starter
        engine_pid = late.kv_stats()["pid"]
        other = ProcessEngine(EngineConfig(model="x", engine_socket=sock_path))
        await other.start()
        assert other.process is None and other.kv_stats()["pid"] == engine_pid
        await other.stop()
    finally:
        await late.stop()
    deadline = time.monotonic() + 30
    while os.path.exists(sock_path):  # the engine exits with the last API process, its socket file last
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert [e for e, _, _ in slow_start_engine.read_log(log)] == ["start", "exit"]  # one engine


async def test_a_new_engine_waits_for_the_old_ones_exit(sock_path, monkeypatch):
    """The old engine takes 1.5 s to stop after its last API process left: the next start waits for its exit
    (its engine lock) instead of loading a second engine meanwhile."""
    log = os.path.join(os.path.dirname(sock_path), "engines.log")
    monkeypatch.setenv(slow_start_engine.LOG_ENV, log)
    factory = functools.partial(slow_start_engine.make_slow_stop, 1.5)
    old = ProcessEngine(EngineConfig(model="x", engine_socket=sock_path), factory)
    await old.start()
    await old.stop()
    new = ProcessEngine(EngineConfig(model="x", engine_socket=sock_path), factory)
    await new.start()
    await new.stop()
    deadline = time.monotonic() + 30
    while [e for e, _, _ in slow_start_engine.read_log(log)].count("exit") < 2:  # both engines' stops are done
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    events = slow_start_engine.read_log(log)
    (old_exit,) = [t for e, pid, t in events if e == "exit" and pid == old.process.pid]
    (new_start,) = [t for e, pid, t in events if e == "start" and pid == new.process.pid]
    assert new_start > old_exit


async def test_a_failed_start_fails_the_api_processes_that_waited_for_it(sock_path, monkeypatch):
    """Three API processes start at once and the engine's start fails: one engine process tried (not one per API
    process in turn); the first gets the engine's error, the two that waited for the start lock fail with it at
    once, with its type. A start after that (a restart) is not held back by the old failure, and removes its note."""
    log = os.path.join(os.path.dirname(sock_path), "engines.log")
    monkeypatch.setenv(slow_start_engine.LOG_ENV, log)
    failing = functools.partial(slow_start_engine.make_failing, 0.5)
    engines = [ProcessEngine(EngineConfig(model="x", engine_socket=sock_path), failing) for _ in range(3)]
    try:
        results = await asyncio.wait_for(asyncio.gather(*(e.start() for e in engines), return_exceptions=True),
                                         60)
        assert [e for e, _, _ in slow_start_engine.read_log(log)].count("start") == 1
        # a bad model file: LoaderError in all three (`voltserve serve` exits 2 in each), the waiters' saying so
        assert [type(r).__name__ for r in results] == ["LoaderError"] * 3
        assert all("GGUF magic invalid" in str(r) for r in results)
        assert sum("failed to start while this API process waited" in str(r) for r in results) == 2
        assert os.path.exists(sock_path + engine_socket.FAILED_SUFFIX)
        later = ProcessEngine(EngineConfig(model="x", engine_socket=sock_path),
                              functools.partial(slow_start_engine.make, 0.0))
        await asyncio.wait_for(later.start(), 60)
        try:
            assert later.process is not None
            assert not os.path.exists(sock_path + engine_socket.FAILED_SUFFIX)
        finally:
            await later.stop()
    finally:
        for e in engines:
            await e.stop()


async def test_a_failed_start_whose_starter_died_fails_the_attached_api_process(sock_path, monkeypatch):
    """The starter is killed while its engine loads; the next API process attaches to that engine, whose start
    then fails: it fails with that error (a bad model file: its type, LoaderError) instead of starting a second
    engine."""
    log = os.path.join(os.path.dirname(sock_path), "engines.log")
    monkeypatch.setenv(slow_start_engine.LOG_ENV, log)
    await _kill_starter_during_the_load(sock_path, log, "make_failing")
    late = ProcessEngine(EngineConfig(model="x", engine_socket=sock_path),
                         functools.partial(slow_start_engine.make, 0.0))
    with pytest.raises(LoaderError, match="failed to start while this API process waited for it: .*GGUF magic"):
        await asyncio.wait_for(late.start(), 60)
    assert [e for e, _, _ in slow_start_engine.read_log(log)].count("start") == 1
    await late.stop()


def test_failure_notes(sock_path):
    """Each failure writes a note of its own (what a waiting API process compares), this user's, mode 0600."""
    assert engine_socket.read_failure(sock_path) is None
    engine_socket.record_failure(sock_path, ValueError("bad"))
    first = engine_socket.read_failure(sock_path)
    assert engine_socket.failure_error(first) == "ValueError: bad"
    assert stat.S_IMODE(os.stat(sock_path + engine_socket.FAILED_SUFFIX).st_mode) == 0o600
    engine_socket.record_failure(sock_path, ValueError("bad"))
    assert engine_socket.read_failure(sock_path) not in (None, first)
    engine_socket.clear_failure(sock_path)
    assert engine_socket.read_failure(sock_path) is None
    engine_socket.clear_failure(sock_path)  # none: no error
    assert os.listdir(os.path.dirname(sock_path)) == []


async def test_the_socket_is_private_and_other_files_are_left_alone(tiny_dir, sock_path):
    with open(sock_path, "w") as f:
        f.write("not a socket")
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        await ProcessEngine(_config(tiny_dir, sock_path)).start()
    assert open(sock_path).read() == "not a socket"
    os.unlink(sock_path)
    engine = ProcessEngine(_config(tiny_dir, sock_path))
    await engine.start()
    try:
        assert stat.S_ISSOCK(os.stat(sock_path).st_mode) and stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    finally:
        await engine.stop()


async def test_attaching_with_other_engine_settings_fails(tiny_dir, sock_path):
    first = ProcessEngine(_config(tiny_dir, sock_path))
    await first.start()
    try:
        other = ProcessEngine(_config(tiny_dir, sock_path, max_model_len=2048))
        with pytest.raises(ConfigError, match=r"max_model_len=2048 \(engine: 4096\)"):
            await other.start()
        assert len(await _greedy(first)) == 6
    finally:
        await first.stop()


async def test_a_stale_socket_file_is_replaced(tiny_dir, sock_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)  # left behind by an engine that was killed: nobody listens
    stale.close()
    engine = ProcessEngine(_config(tiny_dir, sock_path))
    await engine.start()
    try:
        assert engine.process is not None and len(await _greedy(engine)) == 6
    finally:
        await engine.stop()


async def test_a_killed_engine_fails_every_api_process(tiny_dir, sock_path):
    first, second = ProcessEngine(_config(tiny_dir, sock_path)), ProcessEngine(_config(tiny_dir, sock_path))
    await first.start()
    await second.start()
    streams = [e.add_request(e.tokenizer.encode("hello"), SamplingParams(**LONG)) for e in (first, second)]
    for stream in streams:
        await stream.__anext__()
    os.kill(first.process.pid, signal.SIGKILL)
    await assert_engine_dead(first, streams[0])
    await assert_engine_dead(second, streams[1])
    await first.stop()
    await second.stop()


def test_engine_socket_settings_are_checked():
    with pytest.raises(ConfigError, match="need engine_process"):
        EngineConfig(engine_socket="/tmp/x.sock", engine_process=False).validate()
    with pytest.raises(ConfigError, match=r"^engine_socket '/tmp/x+' is 108 bytes long: a Unix socket's path "
                                          r"holds at most 107 bytes \(choose a shorter one\)$"):
        EngineConfig(engine_socket="/tmp/" + "x" * 103).validate()
    with pytest.raises(ConfigError, match="engine_socket '/no/such/dir/e.sock': the folder '/no/such/dir' does "
                                          "not exist"):
        EngineConfig(engine_socket="/no/such/dir/e.sock").validate()
    assert EngineConfig(engine_socket="e.sock").validate().engine_socket == "e.sock"  # the working directory
    base = EngineConfig().validate().engine_settings()
    assert "api_key" not in base and "port" not in base and base["max_model_len"] == 0
    assert EngineConfig(port=1, api_key="k", stream_interval=4).validate().engine_settings() == base


@pytest.mark.slow
def test_hypercorn_workers_share_one_engine(tiny_dir, sock_path):
    """`hypercorn -w 2 api:app` with VOLTSERVE_ENGINE_SOCKET: one worker starts the engine, the other attaches
    (one engine process), and requests through the shared port get the same greedy answer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VOLTSERVE_MODEL": str(tiny_dir), "VOLTSERVE_DEVICE": "cpu",
           "VOLTSERVE_MAX_MODEL_LEN": "512", "VOLTSERVE_NUM_KV_BLOCKS": "128", "VOLTSERVE_ENGINE_SOCKET": sock_path,
           "VOLTSERVE_API_KEY": ""}
    log_path = Path(sock_path).parent / "hypercorn.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hypercorn", "-w", "2", "api:app", "--bind",
                                 f"127.0.0.1:{port}"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while log_path.read_text().count("serving ") < 2:  # both workers have their engine
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        body = {"model": str(tiny_dir), "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        texts = set()
        for _ in range(8):
            with httpx.Client(timeout=30) as client:  # a new connection each: the workers take turns accepting
                response = client.post(url + "/v1/completions", json=body)
                assert response.status_code == 200, response.text
                texts.add(response.json()["choices"][0]["text"])
        assert len(texts) == 1  # one greedy answer whichever worker took it
        text = log_path.read_text()
        started = re.findall(r"engine process \d+ ready", text)
        assert len(started) == 1 and text.count("attached to the shared engine") == 1, text[-3000:]
    finally:
        stop_process(proc)
    assert not os.path.exists(sock_path)  # the engine exited with the last worker, and removed its socket
