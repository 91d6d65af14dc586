"""GET /metrics: the server's request and engine figures in the Prometheus text format (prometheus-client).

Names follow vLLM's (`vllm:time_to_first_token_seconds`, ...) with the `voltserve:` prefix, so dashboards and
alerts written for it carry over; every series has a `model_name` label (the served model name).

- counters: `voltserve:request_success_total{finished_reason}` (requests whose every sequence finished: stop,
  length, ...; the reason of the last sequence to finish), `voltserve:request_failure_total{reason}` (requests
  ended early after they were admitted: `client_gone`, or the error code sent in-band / as the 5xx status:
  `engine_dead`, `step_failed`, `server_shutting_down`, ...; and `internal_error`: an unexpected exception, which
  answers 500 or ends a stream, admitted or not; one raised while the response is built, after the output was
  complete, has already counted as a success), `voltserve:prompt_tokens_total`,
  `voltserve:generation_tokens_total` (both counted for finished requests).
- histograms (seconds, measured in the API process from the handler's start): `time_to_first_token_seconds`
  (TTFT: until the first output is handed to the HTTP server, or received for a non-streamed request),
  `time_per_output_token_seconds` (TPOT: (last - first output) / (tokens of the longest sequence - 1): the
  sequences of n > 1 decode side by side; for requests of >= 2 such tokens) and `e2e_request_latency_seconds`.
- gauges, the engine's state at scrape time (`engine.kv_stats()`; a ProcessEngine's are first brought up to
  date, `refresh_engine_stats`): `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (share of
  KV blocks in use, 0..1); and speculative decoding's counters, read there too (the engine's since it started; 0
  without speculation), named as vLLM's:
  `spec_decode_num_drafts_total` (sequence-steps that verified drafts), `spec_decode_num_draft_tokens_total`,
  `spec_decode_num_accepted_tokens_total` (mean acceptance length = 1 + accepted / drafts); and the draft gate's
  choices (`voltserve.spec.gate`), ours: `spec_decode_gate_steps_total{mode}`, steps run with drafting on
  (`mode="draft"`) and steps it held drafts back in (`mode="plain"`: measuring plain decoding, or plain chosen).

The per-request cost is a clock read at the first and at the last output and a few counter updates (~10 us);
per delta, one comparison (the finish reason, in `UsageCounter.add`). GET /metrics needs the API key when one is set, as every route but /health.

Several API processes on one engine (`voltserve serve --api-processes N`, or `hypercorn -w N`): with
`PROMETHEUS_MULTIPROC_DIR` set when the process starts (the supervisor sets a private folder), the counters and
histograms live in prometheus-client's per-process files there and a scrape of any process sums them over all
(prometheus-client's multiprocess mode); without it each process counts its own requests only. The engine
figures (gauges, speculative counters) are the shared engine's, asked for by whichever process is scraped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from quart import Blueprint, Response

from voltserve.config import PROMETHEUS_DIR_VARIABLES, prometheus_multiproc_dir

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()  # no `_created` series per counter / histogram (vLLM does the same)
# prometheus-client reads the variable once, at its import: its values are per-process files from then on, or not
MULTIPROCESS = any(name in os.environ for name in PROMETHEUS_DIR_VARIABLES)
# TTFT / e2e buckets (s): from a launch-bound small model's milliseconds to long queued prompts
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                1.0, 2.5)


class _EngineGauges:
    """Collector of the engine's queue and KV-pool gauges, read when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict | None], model_name: str):
        self._stats, self._model = stats, model_name

    def collect(self):
        stats = self._stats() or {}
        blocks = stats.get("num_blocks", 0)
        used = (blocks - stats.get("num_free_blocks", 0)) / blocks if blocks else 0.0
        for name, doc, value in (
                ("voltserve:num_requests_running", "Requests in the engine's running batch.",
                 stats.get("num_running", 0)),
                ("voltserve:num_requests_waiting", "Requests queued for admission.", stats.get("num_waiting", 0)),
                ("voltserve:kv_cache_usage_perc", "Share of the KV pool's blocks in use (0..1).", used)):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self._model], float(value))
            yield gauge
        for name, doc, key in (
                ("voltserve:spec_decode_num_drafts", "Sequence-steps that verified drafts.", "num_verify_steps"),
                ("voltserve:spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
                ("voltserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens")):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self._model], float(stats.get(key, 0)))
            yield counter
        gate = CounterMetricFamily("voltserve:spec_decode_gate_steps", "Steps by the draft gate's mode.",
                                   labels=["model_name", "mode"])
        for mode in ("draft", "plain"):
            gate.add_metric([self._model, mode], float(stats.get(f"num_gate_{mode}_steps", 0)))
        yield gate


class ServerMetrics:
    """The metrics of one app, in a registry of its own: several apps in one process (as in tests) stay apart,
    except in multiprocess mode (`MULTIPROCESS`: PROMETHEUS_MULTIPROC_DIR set when prometheus-client was
    imported), where a scrape sums the counters and histograms of every process that wrote to that folder, and
    the values live per process: one app a process there.

    Args:
        model_name: the `model_name` label.
        engine_stats: -> `engine.kv_stats()` of the running engine, or None before it runs.

    Raises:
        ConfigError: in multiprocess mode, the folder is missing (`voltserve.config.prometheus_multiproc_dir`).
    """

    def __init__(self, model_name: str, engine_stats: Callable[[], dict | None]):
        multiprocess_dir = prometheus_multiproc_dir() if MULTIPROCESS else ""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # multiprocess: the metrics write to their files, and the registry reads back every process's files
        reg, label = (None if MULTIPROCESS else self.registry), ["model_name"]
        self.success = Counter("voltserve:request_success", "Finished requests, by finish reason.",
                               label + ["finished_reason"], registry=reg)
        self.failure = Counter("voltserve:request_failure",
                               "Admitted requests that ended early, and internal errors, by reason.",
                               label + ["reason"], registry=reg)
        # the series with the model's label only, bound to it once
        self.prompt_tokens = Counter("voltserve:prompt_tokens", "Prompt tokens of finished requests.", label,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("voltserve:generation_tokens", "Output tokens of finished requests.",
                                         label, registry=reg).labels(model_name)
        self.ttft = Histogram("voltserve:time_to_first_token_seconds", "Time to the first output token (TTFT).",
                              label, buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.tpot = Histogram("voltserve:time_per_output_token_seconds", "Time per output token after the first.",
                              label, buckets=TPOT_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("voltserve:e2e_request_latency_seconds", "Time from the request to its last token.",
                             label, buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        if MULTIPROCESS:
            MultiProcessCollector(self.registry, multiprocess_dir)
        self.registry.register(_EngineGauges(engine_stats, model_name))

    def request(self) -> "RequestStats":
        """A timer for one request, started now."""
        return RequestStats(self)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestStats:
    """One request's timings: `first_token()` when its first output goes out, then `finished(...)` or
    `failed(...)` once (later calls are ignored)."""

    __slots__ = ("_metrics", "_start", "_first", "_done")

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics
        self._start = time.perf_counter()
        self._first: float | None = None
        self._done = False

    def first_token(self) -> None:
        if self._first is None:
            self._first = time.perf_counter()

    def finished(self, prompt_tokens: int, output_tokens: int, longest: int, finish_reason: str | None) -> None:
        """Every sequence finished: `output_tokens` over all of them, `longest` the most of one sequence,
        `finish_reason` that of the last to finish."""
        if self._done:
            return
        self._done = True
        now, m = time.perf_counter(), self._metrics
        m.success.labels(m.model_name, finish_reason or "unknown").inc()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(output_tokens)
        m.e2e.observe(now - self._start)
        if self._first is not None:
            m.ttft.observe(self._first - self._start)
            if longest > 1:
                m.tpot.observe((now - self._first) / (longest - 1))

    def failed(self, reason: str) -> None:
        if self._done:
            return
        self._done = True
        self._metrics.failure.labels(self._metrics.model_name, reason).inc()


class _NoStats:
    """A RequestStats that records nothing: the default of the stream drivers' callers without metrics."""

    __slots__ = ()

    def first_token(self) -> None:
        pass

    def finished(self, prompt_tokens: int, output_tokens: int, longest: int, finish_reason: str | None) -> None:
        pass

    def failed(self, reason: str) -> None:
        pass


NO_STATS = _NoStats()


async def refresh_engine_stats(engine: Any) -> None:
    """Bring `engine.kv_stats()` up to the engine's present state before a scrape renders it. A ProcessEngine's
    are a copy, sent with the outputs of this API process's requests only (stale during a long prefill, or once
    they ended while other processes' requests ran or finished): it asks the engine process
    (`refresh_kv_stats`, one round trip, awaited here because the collector runs synchronously). An
    AsyncEngine's (or a test double's) are live: nothing to do."""
    refresh = getattr(engine, "refresh_kv_stats", None)
    if refresh is not None and getattr(engine, "is_healthy", False):
        await refresh()


def engine_stats(engine: Any) -> dict | None:
    """`engine.kv_stats()` when the engine runs, else None (the gauges then read 0)."""
    if engine is None or not getattr(engine, "is_healthy", False):
        return None
    return engine.kv_stats()


bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
async def metrics():
    """The Prometheus text exposition of this server's metrics."""
    from api.state import get_state

    state = get_state()
    await refresh_engine_stats(state.engine)
    return Response(state.metrics.render(), content_type=CONTENT_TYPE)
