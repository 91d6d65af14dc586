"""`voltserve serve --api-processes 2` on a tiny random-weight model: two API processes on one port and one
engine process; signals, a dead engine and a killed supervisor (slow: real processes)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import stop_process
from voltserve.api_processes import listen_socket

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    """The process has exited (a zombie no init has reaped yet counts as gone)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_until(check, timeout_s: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def _served(server) -> list[int]:
    """The pids named by the completions' access lines logged so far."""
    return [int(p) for p in re.findall(r'"POST /v1/completions 1.1" 200 .* <(\d+)>', server.text())]


class Server:
    """`voltserve serve MODEL --api-processes 2` as a subprocess, its log and the pids it logged."""

    def __init__(self, tiny_dir: Path, log: Path, **env_vars: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "VOLTSERVE_API_KEY": "", "VOLTSERVE_ENGINE_SOCKET": "", **env_vars}
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "voltserve.cli", "serve", str(tiny_dir), "--device", "cpu", "--max-model-len",
                 "512", "--num-kv-blocks", "128", "--port", str(self.port), "--api-processes", "2",
                 "--shutdown-timeout", "2"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        _wait_until(lambda: self.text().count("Running on") >= 2 or self.proc.poll() is not None, 120,
                    "two API processes did not come up", log)
        assert self.proc.poll() is None, self.text()[-3000:]
        started = re.search(r"API processes \(pids ([\d ]+)\) on \S+, one engine at (\S+)", self.text())
        self.api_pids, self.engine_socket = [int(p) for p in started[1].split()], started[2]
        (engine,) = re.findall(r"engine process (\d+) ready", self.text())
        self.engine_pid = int(engine)

    def text(self) -> str:
        return self.log.read_text()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)
        # the private folder of the engine socket (left when the supervisor was killed: its lock file stays)
        shutil.rmtree(os.path.dirname(self.engine_socket), ignore_errors=True)


def test_two_api_processes_share_one_engine_and_stop_on_sigterm(tiny_dir, tmp_path):
    with Server(tiny_dir, tmp_path / "serve.log") as server:
        assert len(server.api_pids) == 2 and server.text().count("attached to the shared engine") == 1
        body = {"model": str(tiny_dir), "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        answers = set()
        for _ in range(8):
            with httpx.Client(timeout=30) as client:  # a new connection each: either process may accept it
                response = client.post(server.url + "/v1/completions", json=body)
                assert response.status_code == 200, response.text
                answers.add(response.json()["choices"][0]["text"])
        assert len(answers) == 1
        # hypercorn writes an access line after the response has gone out: the last one may still be on its way
        _wait_until(lambda: len(_served(server)) >= 8, 10, "8 access lines", server.log)
        served = _served(server)
        assert len(served) == 8 and set(served) <= set(server.api_pids)  # each access line names its process
        for _ in range(4):  # whichever process a scrape reaches counts both processes' requests
            with httpx.Client(timeout=30) as client:
                text = client.get(server.url + "/metrics").text
            assert f'voltserve:request_success_total{{finished_reason="length",model_name="{tiny_dir}"}} 8.0' in text
            assert f'voltserve:generation_tokens_total{{model_name="{tiny_dir}"}} 32.0' in text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert _gone(server.engine_pid)  # the supervisor waited for the engine's own stop (its engine lock)
        for pid in server.api_pids:
            _wait_until(lambda pid=pid: _gone(pid), 30, f"process {pid} still runs", server.log)


def test_a_long_tmpdir_serves_with_the_engine_socket_in_tmp(tiny_dir, tmp_path):
    """TMPDIR of 80+ bytes (systemd's per-service or per-user folders): the private engine socket's path there
    passed a Unix socket's 107 bytes and the server exited with status 2; its private folder now goes in /tmp and
    is removed at the exit."""
    long_tmp = tmp_path / ("t" * max(1, 81 - len(str(tmp_path))))
    long_tmp.mkdir()
    with Server(tiny_dir, tmp_path / "serve.log", TMPDIR=str(long_tmp)) as server:
        folder = os.path.dirname(server.engine_socket)
        assert os.path.dirname(folder) == "/tmp" and len(os.fsencode(server.engine_socket)) <= 107
        assert f"the temporary folder {long_tmp} is too long for a Unix socket's path" in server.text()
        body = {"model": str(tiny_dir), "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        for _ in range(2):
            with httpx.Client(timeout=30) as client:
                response = client.post(server.url + "/v1/completions", json=body)
                assert response.status_code == 200, response.text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert not os.path.exists(folder)
    assert os.listdir(long_tmp) == []


def test_a_dead_engine_ends_every_api_process_with_status_1(tiny_dir, tmp_path):
    with Server(tiny_dir, tmp_path / "serve.log") as server:
        os.kill(server.engine_pid, signal.SIGKILL)
        assert server.proc.wait(timeout=60) == 1  # systemd's Restart= brings the whole server back
        for pid in server.api_pids:
            _wait_until(lambda pid=pid: _gone(pid), 30, f"API process {pid} still runs", server.log)


def test_api_processes_stop_when_the_supervisor_is_killed(tiny_dir, tmp_path):
    with Server(tiny_dir, tmp_path / "serve.log") as server:
        server.proc.kill()
        server.proc.wait()
        for pid in (*server.api_pids, server.engine_pid):  # EOF on the supervisor's pipe: a drain, then exit
            _wait_until(lambda pid=pid: _gone(pid), 60, f"process {pid} outlived the supervisor", server.log)


def test_a_failed_engine_start_is_logged_once_with_status_2(tmp_path):
    """A model that passes the checks before the load and fails in it (no tokenizer.json): every API process
    fails on the shared engine's start, but one of them logs it (`voltserve.start_report`), in one line; the
    supervisor exits 2. It was one line per API process."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
        "num_hidden_layers": 2, "vocab_size": 320}))
    env = {**os.environ, "VOLTSERVE_API_KEY": "", "VOLTSERVE_ENGINE_SOCKET": ""}
    done = subprocess.run([sys.executable, "-m", "voltserve.cli", "serve", str(tmp_path), "--device", "cpu",
                           "--port", "18140", "--api-processes", "3"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert [line.partition(" ERROR ")[2] for line in done.stderr.splitlines() if " ERROR " in line] == [
        f"api.app: bad configuration: {tmp_path} has no tokenizer.json"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_a_signal_while_the_api_processes_start_reaches_them_all(tiny_dir, tmp_path):
    """SIGTERM right after the children started, while they import and load (e.g. systemctl stop at once):
    every child gets it, and all exit; status 0."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "voltserve.cli", "serve", str(tiny_dir), "--device", "cpu", "--max-model-len",
             "512", "--num-kv-blocks", "128", "--port", "0", "--api-processes", "2"], cwd=ROOT,
            env={**os.environ, "VOLTSERVE_API_KEY": "", "VOLTSERVE_ENGINE_SOCKET": ""}, stdout=out,
            stderr=subprocess.STDOUT)
    try:
        _wait_until(lambda: "API processes (pids" in log.read_text(), 60, "no children started", log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        pids = re.search(r"API processes \(pids ([\d ]+)\)", log.read_text())[1].split()
        for pid in pids:
            _wait_until(lambda pid=int(pid): _gone(pid), 30, f"API process {pid} still runs", log)
    finally:
        stop_process(proc)


def test_listen_socket_is_inheritable_and_nodelay():
    sock = listen_socket("127.0.0.1", 0)
    try:
        assert sock.get_inheritable() and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with pytest.raises(OSError):
            listen_socket("127.0.0.1", sock.getsockname()[1])  # in use: the supervisor fails before any child
    finally:
        sock.close()


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_listen_socket_on_ipv6_keeps_the_systems_dual_stack_default():
    """As hypercorn binds "::": IPV6_V6ONLY is the system's default (IPv4 clients too where that is 0)."""
    try:
        sock = listen_socket("::", 0)
    except OSError as exc:
        pytest.skip(f"no IPv6 here: {exc}")
    try:
        with socket.socket(socket.AF_INET6) as plain:
            default = plain.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == default
    finally:
        sock.close()
