"""GET /metrics (api/metrics.py): the Prometheus exposition after real requests through the app (token counts
equal to the responses' usage, one TTFT / TPOT / e2e observation per finished request, failures by reason) and
the engine gauges read at scrape time."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.api.conftest import MODEL, chat_body, leave_mid_stream, stream_until_engine_dies
from tests.api.fake_engine import ScriptedEngine


async def _scrape(client, **headers) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one GET /metrics."""
    response = await client.get("/metrics", headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = (await response.get_data()).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _m(**labels) -> tuple:
    return tuple(sorted({"model_name": MODEL, **labels}.items()))


async def test_finished_requests_are_counted(serve):
    async with serve(ScriptedEngine(scripts=["Hello, world!"])) as (client, _):
        streamed = await client.post("/v1/chat/completions",
                                     json=chat_body(stream=True, stream_options={"include_usage": True}))
        body = await streamed.get_data()
        usage_a = orjson.loads(body.split(b"\n\n")[-3][len(b"data: "):])["usage"]
        plain = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 4})
        usage_b = orjson.loads(await plain.get_data())["usage"]
        metrics = await _scrape(client)
    assert metrics[("voltserve:request_success_total", _m(finished_reason="stop"))] == 1
    assert metrics[("voltserve:request_success_total", _m(finished_reason="length"))] == 1
    assert metrics[("voltserve:prompt_tokens_total", _m())] == usage_a["prompt_tokens"] + usage_b["prompt_tokens"]
    assert metrics[("voltserve:generation_tokens_total", _m())] == (usage_a["completion_tokens"]
                                                                     + usage_b["completion_tokens"])
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert metrics[(f"voltserve:{name}_count", _m())] == 2, name
        assert metrics[(f"voltserve:{name}_sum", _m())] >= 0
    assert metrics[("voltserve:num_requests_running", _m())] == 0
    assert metrics[("voltserve:kv_cache_usage_perc", _m())] == 0


async def test_failures_by_reason(serve):
    """A client that leaves mid-stream, and an engine that dies under a stream (in-band engine_dead error)."""
    engine = ScriptedEngine(scripts=["x" * 200], delay_s=0.02)
    async with serve(engine) as (client, _):
        await leave_mid_stream(client, chat_body(stream=True))
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        dead = await stream_until_engine_dies(client, engine, "/v1/chat/completions", chat_body(stream=True),
                                              after_s=0.1)
        assert b'"code":"engine_dead"' in dead
        metrics = await _scrape(client)
    assert metrics[("voltserve:request_failure_total", _m(reason="client_gone"))] == 1
    assert metrics[("voltserve:request_failure_total", _m(reason="engine_dead"))] == 1
    assert ("voltserve:request_success_total", _m(finished_reason="stop")) not in metrics
    assert metrics[("voltserve:e2e_request_latency_seconds_count", _m())] == 0  # no finished request


class _BrokenStream:
    """An engine stream that fails with an unexpected error at its first output."""

    finished = done = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise RuntimeError("boom")

    def abort(self) -> None:
        pass


async def test_internal_errors_are_counted_once(serve, monkeypatch):
    """A 500 counts as `internal_error` once: raised before the request reached the engine (a handler's
    dependency), while a non-streamed request collects its output (counted there, not again by the app's 500
    handler), and in a route without request stats (count_tokens)."""
    import api.anthropic.messages
    import api.openai.chat

    async def broken(*args, **kwargs):
        raise RuntimeError("boom")

    openai_500 = {"error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}}
    engine = ScriptedEngine()
    async with serve(engine) as (client, _):
        with monkeypatch.context() as patch:
            patch.setattr(api.openai.chat, "chat_prompt_ids", broken)
            before_engine = await client.post("/v1/chat/completions", json=chat_body())
        with monkeypatch.context() as patch:
            patch.setattr(engine, "add_request", lambda *args, **kwargs: _BrokenStream())
            in_collect = await client.post("/v1/chat/completions", json=chat_body())
        with monkeypatch.context() as patch:
            patch.setattr(api.anthropic.messages, "prompt_ids", broken)
            count = await client.post("/v1/messages/count_tokens", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        for response in (before_engine, in_collect):
            assert (response.status_code, orjson.loads(await response.get_data())) == (500, openai_500)
        assert (count.status_code, orjson.loads(await count.get_data())) == (
            500, {"type": "error", "error": {"type": "api_error", "message": "internal server error"}})
        metrics = await _scrape(client)
    assert metrics[("voltserve:request_failure_total", _m(reason="internal_error"))] == 3
    assert ("voltserve:request_success_total", _m(finished_reason="stop")) not in metrics


async def test_engine_gauges_and_api_key(serve):
    """The gauges read engine.kv_stats() when scraped; with an API key /metrics needs it (unlike /health)."""
    engine = ScriptedEngine()
    engine.kv_stats = lambda: {"num_blocks": 200, "num_free_blocks": 150, "num_running": 3, "num_waiting": 2,
                               "num_verify_steps": 10, "num_draft_tokens": 40, "num_accepted_tokens": 17,
                               "num_gate_draft_steps": 12, "num_gate_plain_steps": 30}
    async with serve(engine, api_key="k") as (client, _):
        assert (await client.get("/metrics")).status_code == 401
        metrics = await _scrape(client, authorization="Bearer k")
    assert metrics[("voltserve:num_requests_running", _m())] == 3
    assert metrics[("voltserve:num_requests_waiting", _m())] == 2
    assert metrics[("voltserve:kv_cache_usage_perc", _m())] == 0.25
    assert [metrics[(f"voltserve:spec_decode_num_{n}_total", _m())] for n in ("drafts", "draft_tokens",
                                                                              "accepted_tokens")] == [10, 40, 17]
    assert [metrics[("voltserve:spec_decode_gate_steps_total", _m(mode=m))] for m in ("draft", "plain")] == [12, 30]


def test_tpot_uses_the_longest_sequence():
    """n > 1 sequences decode side by side: TPOT divides by the longest sequence's tokens - 1, not their sum;
    no `_created` series."""
    from api.metrics import ServerMetrics

    metrics = ServerMetrics(MODEL, lambda: None)
    stats = metrics.request()
    stats.first_token()
    stats._first -= 1.0  # 1 s between the first output and the end
    stats.finished(prompt_tokens=4, output_tokens=30, longest=11, finish_reason="length")
    stats.failed("client_gone")  # after finished: ignored
    text = metrics.render().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert 0.1 <= samples[("voltserve:time_per_output_token_seconds_sum", _m())] < 0.11
    assert samples[("voltserve:generation_tokens_total", _m())] == 30
    assert ("voltserve:request_failure_total", _m(reason="client_gone")) not in samples
    assert "_created" not in text


_RECORD = """
import sys
from api.metrics import ServerMetrics
metrics = ServerMetrics(sys.argv[1], lambda: None)
for _ in range(int(sys.argv[2])):
    stats = metrics.request()
    stats.first_token()
    stats.finished(prompt_tokens=5, output_tokens=7, longest=7, finish_reason="length")
metrics.request().failed("client_gone")
if sys.argv[3] == "render":
    sys.stdout.write(metrics.render().decode())
"""


def test_multiprocess_mode_sums_every_process(tmp_path):
    """PROMETHEUS_MULTIPROC_DIR set when the API processes start (`voltserve serve --api-processes`): a scrape
    of any one of them counts the requests of all, the exited ones included, and the gauges once."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    env.pop("prometheus_multiproc_dir", None)

    def run(requests: int, action: str) -> str:
        done = subprocess.run([sys.executable, "-c", _RECORD, MODEL, str(requests), action], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    run(2, "-")
    run(3, "-")
    text = run(4, "render")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("voltserve:request_success_total", _m(finished_reason="length"))] == 9
    assert samples[("voltserve:request_failure_total", _m(reason="client_gone"))] == 3
    assert samples[("voltserve:prompt_tokens_total", _m())] == 45
    assert samples[("voltserve:generation_tokens_total", _m())] == 63
    assert samples[("voltserve:time_to_first_token_seconds_count", _m())] == 9
    assert samples[("voltserve:time_per_output_token_seconds_count", _m())] == 9
    assert samples[("voltserve:time_to_first_token_seconds_bucket", _m(le="+Inf"))] == 9
    assert samples[("voltserve:num_requests_running", _m())] == 0
    assert text.count("# TYPE voltserve:num_requests_running gauge") == 1


def test_multiprocess_dir_must_be_a_folder(tmp_path, monkeypatch):
    import api.metrics
    from voltserve.config import prometheus_multiproc_dir
    from voltserve.errors import ConfigError

    assert prometheus_multiproc_dir({}) == ""
    assert prometheus_multiproc_dir({"prometheus_multiproc_dir": str(tmp_path)}) == str(tmp_path)
    assert prometheus_multiproc_dir({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
                                     "prometheus_multiproc_dir": "/elsewhere"}) == str(tmp_path)
    for env in ({"PROMETHEUS_MULTIPROC_DIR": ""}, {"PROMETHEUS_MULTIPROC_DIR": "", "prometheus_multiproc_dir": "x"},
                {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "missing")}):
        with pytest.raises(ConfigError, match="PROMETHEUS_MULTIPROC_DIR='.*' is not a folder"):
            prometheus_multiproc_dir(env)
    monkeypatch.setattr(api.metrics, "MULTIPROCESS", True)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="is not a folder"):
        api.metrics.ServerMetrics(MODEL, lambda: None)


@pytest.mark.parametrize("processes", ["1", "2"])
def test_serve_with_a_missing_multiproc_dir_exits_2(tmp_path, processes):
    """A PROMETHEUS_MULTIPROC_DIR that does not exist: one error line and status 2, no process started."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "missing"), "VOLTSERVE_API_KEY": "",
           "VOLTSERVE_ENGINE_SOCKET": ""}
    done = subprocess.run([sys.executable, "-m", "voltserve.cli", "serve", "--api-processes", processes,
                           "--port", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"bad configuration: PROMETHEUS_MULTIPROC_DIR='{tmp_path / 'missing'}' is not a folder" in done.stderr
    assert "Traceback" not in done.stderr and "API processes (pids" not in done.stderr
