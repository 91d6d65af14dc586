"""ProcessEngine's process lifecycle on a tiny random-weight model: clean stop, a killed engine process, a dead
API process, start errors. No orphan or zombie process may remain."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.engine import AsyncEngine
from actors.engine_process import ProcessEngine
from api.app import watch_engine
from tests.e2e.engine_helpers import assert_engine_dead, complete
from voltserve.config import EngineConfig
from voltserve.errors import EngineDeadError, LoaderError
from voltserve.request import FinishReason, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _config(tiny_dir) -> EngineConfig:
    # a long context so that a request is still running when the test kills the engine
    return EngineConfig(model=str(tiny_dir), device="cpu", max_model_len=4096, num_kv_blocks=256)


def _assert_reaped(proc: subprocess.Popen) -> None:
    """The child has exited and was waited for: no zombie left."""
    assert proc.returncode is not None
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)


async def test_clean_stop_reaps_the_child(tiny_dir):
    engine = ProcessEngine(_config(tiny_dir))
    await engine.start()
    assert engine.is_healthy and engine.max_model_len == 4096 and engine.model_config.vocab_size == 320
    _, tokens, last = await complete(engine, engine.tokenizer.encode("hello"), temperature=0, max_tokens=5,
                                     ignore_eos=True)
    assert len(tokens) == 5 and last.finish_reason is FinishReason.LENGTH and last.num_prompt_tokens == 5
    running = engine.add_request(engine.tokenizer.encode("hello"), SamplingParams(ignore_eos=True, max_tokens=None))
    await running.__anext__()
    await engine.stop()
    assert engine.process.returncode == 0
    _assert_reaped(engine.process)
    outs = [o async for o in running]  # the child aborted it on its way out, as AsyncEngine.stop() does
    assert outs and outs[-1].finish_reason is FinishReason.ABORT
    assert not engine.is_healthy
    with pytest.raises(EngineDeadError):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))


async def test_killed_child_fails_streams_and_health(tiny_dir):
    """Case E1 in process mode: the engine process is killed mid-stream."""
    engine = ProcessEngine(_config(tiny_dir))
    await engine.start()
    try:
        stream = engine.add_request(engine.tokenizer.encode("hello"), SamplingParams(ignore_eos=True,
                                                                                     max_tokens=None))
        assert (await stream.__anext__()).token_ids
        os.kill(engine.process.pid, signal.SIGKILL)
        await assert_engine_dead(engine, stream)
        died = asyncio.Event()
        await asyncio.wait_for(watch_engine(engine, died.set, interval_s=0.01), 5)
        assert died.is_set()  # the server would shut itself down now
    finally:
        await engine.stop()
    assert engine.process.returncode == -signal.SIGKILL
    _assert_reaped(engine.process)


async def test_start_error_has_the_in_process_type_and_message(tmp_path):
    config = EngineConfig(model=str(tmp_path / "missing.gguf"), device="cpu")
    with pytest.raises(LoaderError) as in_process:
        await AsyncEngine(config).start()
    engine = ProcessEngine(config)
    with pytest.raises(type(in_process.value)) as in_child:
        await engine.start()
    assert str(in_child.value) == str(in_process.value) and "missing.gguf" in str(in_child.value)
    assert engine.process.returncode == 1 and not engine.is_healthy
    _assert_reaped(engine.process)


_PARENT = """
import asyncio, sys
from actors.engine_process import ProcessEngine
from voltserve.config import EngineConfig

async def main():
    engine = ProcessEngine(EngineConfig(model=sys.argv[1], device="cpu", num_kv_blocks=64))
    await engine.start()
    print(engine.process.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _gone(pid: int) -> bool:
    """True when `pid` no longer runs (exited, or a zombie whose parent is gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_child_exits_when_the_api_process_dies(tiny_dir):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tiny_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert not _gone(child_pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while not _gone(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child_pid)  # EOF on its socket ended it


@pytest.mark.slow
def test_sigterm_to_voltserve_serve_ends_open_streams_cleanly(tiny_dir):
    """`voltserve serve` on SIGTERM (systemd stop): a stream still running after --shutdown-timeout ends with the
    shutdown error event and [DONE] (not a cut connection), the server exits 0 with its engine process reaped,
    and nothing is logged as a traceback."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VOLTSERVE_API_KEY": "", "VOLTSERVE_LOG_LEVEL": "info"}
    proc = subprocess.Popen([sys.executable, "-m", "voltserve.cli", "serve", str(tiny_dir), "--device", "cpu",
                             "--port", str(port), "--max-model-len", "4096", "--num-kv-blocks", "256",
                             "--shutdown-timeout", "0.5"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not healthy after 120 s"
            time.sleep(0.2)
        body = b""
        request = {"model": str(tiny_dir), "prompt": "hello", "max_tokens": 3000, "ignore_eos": True,
                   "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=request, timeout=30) as response:
            assert response.status_code == 200
            for chunk in response.iter_raw():
                if not body:
                    proc.send_signal(signal.SIGTERM)  # mid-stream, after the first tokens
                body += chunk
        assert proc.wait(timeout=30) == 0
        log = proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = body.split(b"\n\n")
    assert events[-3] == (b'data: {"error":{"message":"the server is shutting down","type":"server_error",'
                          b'"param":null,"code":"server_shutting_down"}}'), body[-400:]
    assert body.endswith(b"data: [DONE]\n\n")
    assert len(events) > 4  # tokens were streamed before the cut
    assert re.search(r"ended 1 request\(s\) still running after 0\.\d s", log), log[-3000:]
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
