"""A bare `hypercorn api:app` (README's systemd command) logs each line once. hypercorn gives `hypercorn.error` a
stderr handler of its own and lets its records propagate to the root, where the app's handler
(`voltserve.log_setup.configure_logging`) wrote them again: "Running on ..." came out twice, once in each format."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.api.conftest import REAL_MODEL, ROOT

PORT = 18210


def test_each_line_is_logged_once(smollm2_gguf, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOLTSERVE_")}
    env.update(VOLTSERVE_MODEL=REAL_MODEL, VOLTSERVE_DEVICE="cpu", VOLTSERVE_MAX_MODEL_LEN="1024",
               VOLTSERVE_NUM_KV_BLOCKS="128")
    log_path = tmp_path / "hypercorn.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hypercorn", "api:app", "--bind", f"127.0.0.1:{PORT}"],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{PORT}"
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        body = {"model": REAL_MODEL, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, log_path.read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)
    lines = log_path.read_text().splitlines()
    assert status == 0, lines[-20:]
    expected = ["api.app: starting engine: EngineConfig(model='smollm2-135m-instruct'",
                "actors.engine [engine process]: engine ready: model smollm2-135m-instruct, device cpu, "
                "max_model_len 1024, KV pool 128 blocks x 16 tokens",
                "actors.engine_process: engine process ",
                "api.app: serving 'smollm2-135m-instruct' (max_model_len=1024)",
                f"Running on http://127.0.0.1:{PORT} (CTRL + C to quit)"]
    assert {text: sum(text in line for line in lines) for text in expected} == dict.fromkeys(expected, 1), lines
