"""`voltserve serve --uds PATH`: the server on a Unix socket (behind nginx on the same host), one API process or
several, on the default model and the CPU: a stale socket file is replaced, a live server's socket or any other
file is never touched, SIGTERM exits 0 and removes the socket (slow: real processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import stop_process
from voltserve import cli

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _serve(sock: Path, log: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOLTSERVE_")}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "voltserve.cli", "serve", "--uds", str(sock), "--device", "cpu",
                                 "--max-model-len", "512", "--num-kv-blocks", "64", *args], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def _wait_running(proc: subprocess.Popen, log: Path, count: int) -> None:
    deadline = time.monotonic() + 240
    while log.read_text().count("Running on http://unix:") < count:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.mark.parametrize("processes", ["1", "2"])
def test_serve_on_a_unix_socket(smollm2_gguf, tmp_path, processes):
    sock = tmp_path / "api.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # left by a server that was killed: nothing accepts on it
        stale.bind(str(sock))
    log = tmp_path / "serve.log"
    proc = _serve(sock, log, "--api-processes", processes)
    try:
        _wait_running(proc, log, int(processes))
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://voltserve",
                          timeout=60) as client:
            models = client.get("/v1/models").json()
            chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 16,
                                                             "temperature": 0}).json()
        assert models == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": models["data"][0][
            "created"], "owned_by": "voltserve", "max_model_len": 512}]}
        assert chat["id"].startswith("chatcmpl-")
        assert {k: v for k, v in chat.items() if k not in ("id", "created")} == {
            "object": "chat.completion", "model": MODEL, "choices": [{
                "index": 0, "message": {"role": "assistant", "content": "The capital of France is Paris."},
                "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 37, "completion_tokens": 8, "total_tokens": 45,
                      "prompt_tokens_details": {"cached_tokens": 0}}}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        stop_process(proc)
    assert not sock.exists()  # removed at exit: a proxy gets "no such file" rather than a refused connection
    assert "http://unix:" + str(sock) in log.read_text()


def test_a_live_servers_socket_and_other_files_are_left_alone(tmp_path, caplog):
    """One line and status 2 before anything loads; the file stays."""
    sock, other = tmp_path / "api.sock", tmp_path / "notes.txt"
    other.write_text("mine")
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(sock))
        live.listen()
        assert cli.main(["serve", "--uds", str(sock), "--device", "cpu"]) == 2
        assert cli.main(["serve", "--uds", str(other), "--device", "cpu"]) == 2
        assert cli.main(["serve", "--uds", str(sock), "--port", "9000"]) == 2
    assert sock.exists() and other.read_text() == "mine"
    assert [r.getMessage() for r in caplog.records if r.name == "voltserve.cli"] == [
        f"bad configuration: uds {str(sock)!r}: a server listens there already",
        f"bad configuration: uds {str(other)!r} exists and is not a socket (not removed)",
        f"bad configuration: uds {str(sock)!r} and host / port 127.0.0.1:9000 both say where to listen: give one "
        "of them"]
