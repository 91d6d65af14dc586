"""/metrics' engine gauges through the HTTP app on a ProcessEngine (the engine in its own process, as
`voltserve serve` runs it): the engine's state at the scrape, also during a long prefill, when no output has
carried the engine's figures to the API process yet. Several API processes: tests/e2e/test_shared_engine.py."""

from __future__ import annotations

import asyncio
import functools
import time

from actors.engine_process import ProcessEngine
from api import create_app
from tests.api.test_metrics import _scrape
from tests.e2e import slow_prefill_engine, slow_start_engine
from voltserve.config import EngineConfig

PREFILL_S = 2.0  # each step with a prompt chunk takes this much longer (slow_prefill_engine)
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


async def scrape_gauges(client) -> tuple[float, float, float]:
    """(running, waiting, KV usage) of one GET /metrics."""
    metrics = await _scrape(client)
    return tuple(next(v for (name, _), v in metrics.items() if name == f"voltserve:{gauge}") for gauge in GAUGES)


async def test_gauges_show_a_prefill_in_progress_then_an_idle_engine(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", max_model_len=512, num_kv_blocks=64)
    engine = ProcessEngine(config, engine_factory=functools.partial(slow_prefill_engine.make, PREFILL_S))
    app = create_app(engine)
    body = {"model": config.served_model_name, "prompt": "hello world " * 20, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    async with app.test_app() as test_app:
        client = test_app.test_client()
        assert await scrape_gauges(client) == (0, 0, 0)
        request = asyncio.create_task(client.post("/v1/completions", json=body))
        deadline = time.monotonic() + 60  # a safety only: the request cannot end before its prefill's PREFILL_S
        seen = None
        while not request.done() and time.monotonic() < deadline:  # the request is in its prefill meanwhile
            gauges = await scrape_gauges(client)
            if not request.done() and gauges[0]:
                seen = gauges
                break
            await asyncio.sleep(0.05)
        assert seen is not None, "no scrape showed the request while its prefill ran"
        running, waiting, kv_usage = seen
        assert (running, waiting) == (1, 0) and kv_usage > 0
        response = await request
        assert response.status_code == 200
        assert await scrape_gauges(client) == (0, 0, 0)  # done: the engine is idle, its blocks free


async def test_refresh_waits_for_the_engine_at_most_its_timeout(caplog):
    """ProcessEngine.refresh_kv_stats: the engine process's answer; without one in time (a hung engine), the last
    known figures after the timeout, never a scrape held up for good; after the stop, at once."""
    engine = ProcessEngine(EngineConfig(model="x"), functools.partial(slow_start_engine.make, 0.0))
    await engine.start()
    try:
        assert (await engine.refresh_kv_stats())["pid"] == engine.process.pid
        engine._send = lambda cmd: None  # the question goes nowhere: no answer comes
        start = time.monotonic()
        both = await asyncio.gather(engine.refresh_kv_stats(0.2), engine.refresh_kv_stats(0.2))
        assert both[0] == both[1] == engine.kv_stats() and time.monotonic() - start < 1.0
        assert "did not report its stats" in caplog.text
    finally:
        await engine.stop()
    assert await asyncio.wait_for(engine.refresh_kv_stats(), 0.1) == engine.kv_stats()
