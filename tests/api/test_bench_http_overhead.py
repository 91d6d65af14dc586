"""tools/bench_http_overhead.py end to end on a tiny load (slow: it starts servers): every token streamed is
counted, across API processes sharing one engine too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("api_processes", [1, 2])
def test_bench_counts_every_token(api_processes):
    out = subprocess.run(
        [sys.executable, "tools/bench_http_overhead.py", "--concurrency", "4", "--requests", "2", "--max-tokens",
         "32", "--step-ms", "1", "--engine-process", "--client", "raw", "--repeat", "1", "--api-processes",
         str(api_processes)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    (run,) = report["runs"]
    assert run["tokens"] == 4 * 2 * 32 and run["engine_steps"] >= 32
    # CPU times tick in 10 ms: this load costs the API processes several ticks (the engine process maybe none)
    assert run["server_cpu_us_per_tok"] > 0
    assert 0 < run["chunks_per_tok"] <= 1 and report["config"]["api_processes"] == api_processes


@pytest.mark.parametrize("api", ["responses", "messages"])
@pytest.mark.parametrize("client", ["httpx", "raw"])
def test_bench_streams_every_api(api, client):
    """`--api`: the Responses and Anthropic Messages streams, read by both clients, count every token."""
    out = subprocess.run(
        [sys.executable, "tools/bench_http_overhead.py", "--concurrency", "4", "--requests", "2", "--max-tokens",
         "32", "--repeat", "1", "--client", client, "--api", api], cwd=ROOT, capture_output=True, text=True,
        timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    (run,) = report["runs"]
    assert run["tokens"] == 4 * 2 * 32 and report["config"]["api"] == api
    assert 0 < run["chunks_per_tok"] <= 1
