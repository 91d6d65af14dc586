"""HTTP streaming overhead benchmark: the API layer alone, with an engine double that costs (almost) nothing.

The app (`api.create_app`) runs under hypercorn on a loopback port in a child process, with `StepEngine`: a fake
that keeps the real scheduler actor's output path (`SchedulerActor._emit`: incremental detokenization, stop
strings, RequestOutput, `RequestStream.put` and its merging) but replaces model steps by "append one token to every
running sequence", as fast as the event loop allows. `--concurrency` streaming chat clients (httpx, in this
process, so they run on another core) each send `--requests` requests of `--max-tokens` tokens, with
`stream_options.include_usage` as `tools/bench_serving.py` does. The output is JSON:

- `tok_s`: streamed completion tokens per second (usage chunks' `completion_tokens`, wall clock of the load).
- `server_cpu_us_per_tok`: the server process's CPU time (user + sys) per streamed token during the load: the
  API's per-token cost, which on a real server is spent on the same event loop that drives the engine.
- `chunks_per_tok`: SSE content chunks per token (< 1 when the loop fell behind and deltas merged).
- `writes_per_tok` (`--client raw`): HTTP body chunks per token, i.e. the server's writes (below
  `chunks_per_tok` where several events went out in one write).
- `client_cpu_us_per_tok`: the clients' cost, to check they were not the bottleneck.

    .venv/bin/python tools/bench_http_overhead.py --concurrency 64 --max-tokens 256 --repeat 3
    .venv/bin/python tools/bench_http_overhead.py --profile /tmp/server.prof   # cProfile of the server's load

`--step-ms T` makes each step take T ms on a worker thread behind a real `actors.base.Actor` ask (as
`actors/worker.py` runs the model), to see whether the API's per-token work overlaps the device step: the offline
figure is then `running sequences / T`, e.g. 64 / 2.79 ms = 22,939 tok/s for the H200's default-model decode.

`--engine-process` puts the step engine behind `actors.engine_process.ProcessEngine`, as `hypercorn api:app` runs
the real engine by default: the fake steps, `_emit` and detokenization run in the engine process, the HTTP work in
the server process, and one message per step crosses between them. `server_cpu_us_per_tok` is then the API
process alone and `engine_process_cpu_us_per_tok` the engine process's (0 in-process).

    .venv/bin/python tools/bench_http_overhead.py --concurrency 64 --step-ms 2.79 --repeat 3 --offline
    .venv/bin/python tools/bench_http_overhead.py --concurrency 64 --step-ms 2.79 --repeat 3 --offline --engine-process

`--api-processes N` (with `--engine-process`) runs N API processes on one shared engine process
(`EngineConfig.engine_socket`, as `voltserve serve --api-processes N` and `hypercorn -w N` do), each on a port of
its own; client i talks to process i mod N. `server_cpu_us_per_tok` is then the N processes' sum.

`--offline` adds `offline_tok_s` (the step engine alone, consumers in-process, no HTTP) and `http_over_offline`.
`--step-python-ms P` makes each step first hold the GIL for P ms on the worker thread (the runner's Python step
preparation), e.g. `--step-ms 2.17 --step-python-ms 0.15` for the H200's 2.32 ms per 64-sequence step.
`--client raw` replaces httpx by a minimal HTTP/1.1 client (~1/3 of its CPU per token), so that on a small machine
more of the cores go to the server.

`--loop auto|uvloop|asyncio` is the event loop of the server, the engine process and the `--offline` run, as
`voltserve serve --event-loop` (auto, the default: uvloop when installed; `asyncio` is what the tool measured
before uvloop became the default). `--keep-alive S` sets the server's `--sse-keep-alive-interval`
(`tools/voltserve.service` runs with 15).

`--engine scripted` uses `tests/api/fake_engine.py:ScriptedEngine` (zero delay) instead: its per-request
generators skip the scheduler actor's path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout
from tools.bench_api_shapes import SHAPES, ApiShape  # noqa: E402

MODEL = "bench-model"
TEXT = "The quick brown fox jumps over the lazy dog. "  # ASCII: one byte token = one character of text


# ---- server side (child process) ------------------------------------------------------------------------------


class _StubScheduler:
    """What `SchedulerActor._emit` calls on the policy: finish()."""

    def __init__(self, running: list):
        self.running = running

    def add(self, seq) -> None:
        self.running.append(seq)

    def finish(self, seq, reason, stop_reason=None) -> None:
        from voltserve.sequence import SequenceStatus

        if seq.is_finished:
            return
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason


def _step(step_s: float, python_s: float) -> None:
    end = time.perf_counter() + python_s
    while time.perf_counter() < end:  # holds the GIL, as Python code does
        pass
    time.sleep(step_s)


def _device_double(step_s: float, python_s: float = 0.0):
    """A worker actor whose step is `python_s` of Python (GIL held: the runner's step preparation and launches)
    then `time.sleep(step_s)` (the device computes, the GIL is free) on its own thread, as
    `actors.worker.WorkerActor` runs the model's step."""
    from concurrent.futures import ThreadPoolExecutor

    from actors.base import Actor

    pool = ThreadPoolExecutor(max_workers=1)

    class DeviceDouble(Actor):
        async def handle(self, msg):
            return await asyncio.get_running_loop().run_in_executor(pool, _step, step_s, python_s)

    return DeviceDouble("device-double")


class StepEngine:
    """AsyncEngine double: every "step" appends one token to every running sequence and emits it through the real
    `SchedulerActor._emit` into a real `RequestStream`; steps run back to back, yielding to the loop in between, or
    each behind a `step_s` wait on a worker actor's thread (the model's step) when step_s > 0."""

    def __init__(self, max_model_len: int = 8192, step_s: float = 0.0, python_s: float = 0.0,
                 stream_interval: int = 1):
        from actors.scheduler import SchedulerActor
        from tests.api.fake_engine import ByteTokenizer, ChatMLTemplate
        from voltserve.config import EngineConfig, ModelConfig

        self.config = EngineConfig(model=MODEL, stream_interval=stream_interval).validate()
        self.max_model_len = max_model_len
        self.tokenizer = ByteTokenizer()
        self.model_config = ModelConfig("bench", self.tokenizer.vocab_size, 64, 64, 1, 1, 1, 64)
        self.chat_template = ChatMLTemplate()
        self.running: list = []
        self.actor = SchedulerActor(_StubScheduler(self.running), worker=None, tokenizer=self.tokenizer)
        self.script = self.tokenizer.encode(TEXT, parse_special=False)
        self._seq_ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_steps = 0
        self.device = _device_double(step_s, python_s) if step_s > 0 else None

    @property
    def is_healthy(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self.device is not None:
            self.device.start()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def add_request(self, prompt_token_ids, params, request_id=None):
        import uuid

        from actors.stream import RequestStream
        from voltserve.request import check_request

        max_tokens = check_request(prompt_token_ids, params, self.tokenizer.vocab_size, self.max_model_len)
        stream = RequestStream(request_id or uuid.uuid4().hex, params.n, self.abort, self.config.stream_interval)
        self.submit(prompt_token_ids, params, max_tokens, stream)
        return stream

    def submit(self, prompt_token_ids, params, max_tokens, stream) -> None:
        """AsyncEngine.submit: queue a checked request whose outputs go to `stream` (in the engine process, the
        forwarder to the API process)."""
        from actors.scheduler import AddRequestMsg
        from voltserve.sequence import Sequence

        seqs = tuple(Sequence(seq_id=next(self._seq_ids), request_id=stream.request_id, index=i,
                              prompt_ids=list(prompt_token_ids), params=params, max_tokens=max_tokens)
                     for i in range(params.n))
        self.actor._on_message(AddRequestMsg(seqs, stream))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        from actors.scheduler import AbortRequestMsg

        self.actor._on_message(AbortRequestMsg(request_id))

    def kv_stats(self) -> dict:
        # num_steps rides along so that the API process of `--engine-process` can report it
        return {"num_blocks": 0, "num_free_blocks": 0, "num_running": len(self.running), "num_waiting": 0,
                "num_steps": self.num_steps}

    async def _loop(self) -> None:
        from voltserve.request import FinishReason
        from voltserve.sequence import SequenceStatus

        script, actor, device = self.script, self.actor, self.device
        deferred: list = []  # the last step's sequences, emitted once the next step is with the device

        def emit(seqs: list) -> None:
            for seq in seqs:
                actor._emit(seq, None)

        while True:
            if not self.running:
                deferred = emit(deferred) or []
                self._wake.clear()
                await self._wake.wait()
                continue
            if device is not None:  # SchedulerActor.run_loop: schedule, hand the step over, emit, await it
                reply = device.ask_nowait(None)
                asyncio.get_running_loop().call_soon(emit, deferred)
                deferred = []
                await reply
            touched = list(self.running)
            for seq in touched:  # Scheduler.update: append the sampled token, finish at max_tokens
                seq.output_ids.append(script[len(seq.output_ids) % len(script)])
                if len(seq.output_ids) >= seq.max_tokens:
                    self.running.remove(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = FinishReason.LENGTH
            deferred = touched if device is not None else emit(touched) or []
            self.num_steps += 1
            if device is None:
                await asyncio.sleep(0)


def make_step_engine(step_s: float, python_s: float, config=None, on_death=None) -> StepEngine:
    """ProcessEngine's engine_factory for `--engine-process`: the StepEngine, built in the engine process."""
    return StepEngine(step_s=step_s, python_s=python_s)


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve(port: int, engine_kind: str, profile: str | None, ready, step_ms: float = 0.0,
           engine_process: bool = False, step_python_ms: float = 0.0, loop: str = "auto",
           keep_alive_s: float = 0.0, stream_interval: int = 1, engine_socket: str = "") -> None:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]
    import cProfile

    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from api import create_app
    from voltserve import event_loop
    from voltserve.config import EngineConfig

    async def main() -> None:
        if engine_kind == "scripted":
            from tests.api.fake_engine import ScriptedEngine

            engine = ScriptedEngine(scripts=[TEXT * 200], max_model_len=16384)
            engine.config = EngineConfig(model=MODEL).validate()
        elif engine_process:
            import functools

            from actors.engine_process import ProcessEngine
            from tools.bench_http_overhead import make_step_engine as factory  # by a name the child can import

            config = EngineConfig(model=MODEL, event_loop=loop, stream_interval=stream_interval,
                                  engine_socket=engine_socket).validate()
            engine = ProcessEngine(config, engine_factory=functools.partial(factory, step_ms / 1000,
                                                                            step_python_ms / 1000))
        else:
            engine = StepEngine(step_s=step_ms / 1000, python_s=step_python_ms / 1000, stream_interval=stream_interval)
        app = create_app(engine, EngineConfig(model=MODEL, sse_keep_alive_interval=keep_alive_s).validate())
        profiler = cProfile.Profile() if profile else None
        marks: list[float] = []

        @app.get("/bench/mark")
        async def mark():  # first call: start of the load, second call: its end
            now = sum(os.times()[:2])
            marks.append(now)
            if profiler is not None:
                if len(marks) == 1:
                    profiler.enable()
                elif len(marks) == 2:
                    profiler.disable()
                    profiler.dump_stats(profile)
            process = getattr(engine, "process", None)
            engine_cpu_s = _process_cpu_s(process.pid) if process is not None else 0.0
            steps = getattr(engine, "num_steps", None)
            if process is not None:  # the step engine's count, sent with every step's outputs
                steps = engine.kv_stats().get("num_steps")
            return {"cpu_s": now, "engine_cpu_s": engine_cpu_s, "steps": steps}

        @app.get("/bench/reset")
        async def reset():
            marks.clear()
            return {}

        config = Config()
        config.bind = [f"127.0.0.1:{port}"]
        config.accesslog = None
        config.errorlog = None
        stop = asyncio.Event()
        ready.set()
        await serve(app, config, shutdown_trigger=stop.wait)

    event_loop.run(main(), loop)


# ---- client side ----------------------------------------------------------------------------------------------


async def _one(client, max_tokens: int, api: ApiShape = SHAPES["chat"]) -> tuple[int, int, float | None]:
    """One streamed request through httpx -> (completion tokens, content chunks, TTFT in s)."""
    buf = bytearray()
    t0, ttft = time.perf_counter(), None
    async with client.stream("POST", api.path, json=api.body(MODEL, max_tokens)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for data in response.aiter_raw():
            if ttft is None and api.has_content(data):
                ttft = time.perf_counter() - t0
            buf += data
    return (*api.count(bytes(buf)), ttft, 0)


class _RawConnection:
    """One keep-alive HTTP/1.1 connection that POSTs streamed chat requests: a client with a fraction of httpx's
    CPU per SSE chunk, so that on a small machine the server processes get the cores (`--client raw`).

    Args:
        base_url: http://host:port.
    """

    def __init__(self, base_url: str, api: ApiShape = SHAPES["chat"]):
        self._api = api
        self._host, port = base_url.removeprefix("http://").rsplit(":", 1)
        self._port = int(port)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def one(self, max_tokens: int) -> tuple[int, int, float | None]:
        """One streamed chat request -> (completion tokens, content chunks, TTFT in s: request written -> first
        content delta read, as `tools/bench_serving.py` times it)."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        api = self._api
        body = json.dumps(api.body(MODEL, max_tokens)).encode()
        t0, ttft = time.perf_counter(), None
        self._writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (api.path.encode(), self._host.encode(), len(body), body))
        reader = self._reader
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200") or b"transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"unexpected response head {head[:200]!r}")
        buf = bytearray()
        writes = 1  # the terminating zero-size chunk
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):  # chunked transfer coding (RFC 9112)
            data = (await reader.readexactly(size + 2))[:-2]
            if ttft is None and api.has_content(data):
                ttft = time.perf_counter() - t0
            buf += data
            writes += 1
        await reader.readuntil(b"\r\n")
        return (*api.count(bytes(buf)), ttft, writes)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


async def _marks(clients) -> dict:
    """/bench/mark of every API process, summed (the steps: the latest count any of them has)."""
    marks = [(await c.get("/bench/mark")).json() for c in clients]
    steps = [m["steps"] for m in marks if m["steps"] is not None]
    return {"cpu_s": sum(m["cpu_s"] for m in marks), "engine_cpu_s": sum(m["engine_cpu_s"] for m in marks),
            "steps": max(steps) if steps else None}


async def _round(base_urls: list[str], concurrency: int, requests: int, max_tokens: int, step_ms: float,
                 client_kind: str = "httpx", api: ApiShape = SHAPES["chat"]) -> dict:
    """One load: client i streams its requests from API process i mod len(base_urls)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(base_url=url, limits=limits, timeout=120))
                   for url in base_urls]
        for c in clients:
            await _one(c, 4, api)  # warm: connections, first-request paths
        raw = [_RawConnection(base_urls[i % len(base_urls)], api) for i in range(concurrency)] \
            if client_kind == "raw" else []
        for conn in raw:
            await conn.one(4)
        before = await _marks(clients)
        cpu0, t0 = sum(os.times()[:2]), time.perf_counter()

        ttfts: list[float] = []
        writes: list[int] = []

        async def worker(i: int) -> tuple[int, int]:
            tokens = chunks = 0
            for _ in range(requests):
                t, c, ttft, w = await (raw[i].one(max_tokens) if raw else
                                       _one(clients[i % len(clients)], max_tokens, api))
                tokens, chunks = tokens + t, chunks + c
                writes.append(w)
                ttfts.append(ttft)
            return tokens, chunks

        results = await asyncio.gather(*(worker(i) for i in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, sum(os.times()[:2]) - cpu0
        for conn in raw:
            conn.close()
        after = await _marks(clients)
        for c in clients:
            await c.get("/bench/reset")
    tokens = sum(r[0] for r in results)
    chunks = sum(r[1] for r in results)
    steps = None if before["steps"] is None else after["steps"] - before["steps"]
    return {
        "tok_s": round(tokens / wall, 1),
        "server_cpu_us_per_tok": round((after["cpu_s"] - before["cpu_s"]) / tokens * 1e6, 2),
        "engine_process_cpu_us_per_tok": round((after["engine_cpu_s"] - before["engine_cpu_s"]) / tokens * 1e6, 2),
        "client_cpu_us_per_tok": round(cpu / tokens * 1e6, 2),
        "chunks_per_tok": round(chunks / tokens, 3),
        "writes_per_tok": round(sum(writes) / tokens, 3) if raw else None,
        "ttft_p50_ms": _ms(statistics.median(ttfts)), "ttft_p90_ms": _ms(_p90(ttfts)),
        "tokens": tokens, "wall_s": round(wall, 3), "engine_steps": steps,
        # share of the load's wall time the modelled device spent in steps (the "GPU busy")
        "device_busy": None if not steps or not step_ms else round(steps * step_ms / 1000 / wall, 3),
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


async def _offline(concurrency: int, max_tokens: int, step_ms: float, step_python_ms: float,
                   requests: int = 1) -> dict:
    """The step engine alone (no HTTP: `concurrency` consumers in this process, each draining `requests` streams
    one after the other, as the HTTP clients do), the figures the HTTP runs are compared with: tok/s and TTFT
    (add_request -> first delta with text)."""
    from voltserve.request import SamplingParams

    engine = StepEngine(step_s=step_ms / 1000, python_s=step_python_ms / 1000)
    await engine.start()
    ttfts: list[float] = []

    async def client() -> None:
        for _ in range(requests):
            start, first = time.perf_counter(), True
            async for out in engine.add_request([65, 66], params):
                if first and out.text:
                    ttfts.append(time.perf_counter() - start)
                    first = False

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await engine.stop()
    return {"tok_s": round(concurrency * requests * max_tokens / wall, 1),
            "ttft_p50_ms": _ms(statistics.median(ttfts)), "ttft_p90_ms": _ms(_p90(ttfts))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--api", choices=sorted(SHAPES), default="chat",
                    help="the streamed API the clients call (tools/bench_api_shapes.py)")
    ap.add_argument("--requests", type=int, default=1, help="requests per client per run")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="runs; the summary is their median")
    ap.add_argument("--engine", choices=("step", "scripted"), default="step")
    ap.add_argument("--profile", help="write a cProfile of the server during the (last) run here")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="step engine: each step waits this long on a worker thread (the device's step time)")
    ap.add_argument("--step-python-ms", type=float, default=0.0,
                    help="step engine: before its wait, each step runs this long in Python on the worker thread "
                         "(holding the GIL, as the runner's step preparation does)")
    ap.add_argument("--engine-process", action="store_true",
                    help="step engine behind actors.engine_process.ProcessEngine (its own process), as "
                         "`hypercorn api:app` runs the engine by default")
    ap.add_argument("--offline", action="store_true",
                    help="also run the step engine without HTTP (same load, median of --repeat): the denominator")
    ap.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                    help="event loop of the server, the engine process and the --offline run, as `voltserve serve "
                         "--event-loop` (auto: uvloop when installed)")
    ap.add_argument("--keep-alive", type=float, default=0.0, metavar="S",
                    help="the server's --sse-keep-alive-interval (0 = off, the default; tools/voltserve.service sets 15)")
    ap.add_argument("--stream-interval", type=int, default=1, metavar="N",
                    help="the server's --stream-interval: tokens a stream gathers before each SSE chunk (1: every "
                         "token)")
    ap.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                    help="raw: a minimal HTTP/1.1 client (much less client CPU per chunk than httpx)")
    ap.add_argument("--api-processes", type=int, default=1, metavar="N",
                    help="with --engine-process: N API processes on one shared engine process, a port each")
    args = ap.parse_args()
    if args.engine_process and args.engine != "step":
        ap.error("--engine-process needs --engine step")
    if args.api_processes > 1 and not args.engine_process:
        ap.error("--api-processes needs --engine-process")

    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="vs-bench-")
    engine_socket = os.path.join(folder, "engine.sock") if args.api_processes > 1 else ""
    servers, base_urls = [], []
    try:
        for i in range(args.api_processes):
            port, ready = _free_port(), ctx.Event()
            # not daemonic: with --engine-process the server starts a process of its own
            servers.append(ctx.Process(target=_serve, args=(
                port, args.engine, args.profile if i == 0 else None, ready, args.step_ms, args.engine_process,
                args.step_python_ms, args.loop, args.keep_alive, args.stream_interval, engine_socket)))
            servers[-1].start()
            ready.wait(60)
            base_urls.append(f"http://127.0.0.1:{port}")
        import httpx

        for base_url in base_urls:
            for _ in range(600):  # wait for the socket (the first process waits for the engine's start)
                try:
                    if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        runs = [asyncio.run(_round(base_urls, args.concurrency, args.requests, args.max_tokens, args.step_ms,
                                   args.client, SHAPES[args.api]))
                for _ in range(args.repeat)]
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.join(5)
        shutil.rmtree(folder, ignore_errors=True)
    keys = ("tok_s", "server_cpu_us_per_tok", "engine_process_cpu_us_per_tok", "client_cpu_us_per_tok",
            "chunks_per_tok", "ttft_p50_ms", "ttft_p90_ms") + (("device_busy",) if args.step_ms else ()) + (
                ("writes_per_tok",) if args.client == "raw" else ())
    summary = {k: statistics.median(r[k] for r in runs) for k in keys}
    if args.offline:
        sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]
        from voltserve import event_loop

        offline = [event_loop.run(_offline(args.concurrency, args.max_tokens, args.step_ms, args.step_python_ms,
                                           args.requests), args.loop)
                   for _ in range(args.repeat)]
        summary["offline_tok_s"] = statistics.median(r["tok_s"] for r in offline)
        summary["offline_ttft_p50_ms"] = statistics.median(r["ttft_p50_ms"] for r in offline)
        summary["offline_ttft_p90_ms"] = statistics.median(r["ttft_p90_ms"] for r in offline)
        summary["http_over_offline"] = round(summary["tok_s"] / summary["offline_tok_s"], 3)
    report = {"config": vars(args), "median": summary, "runs": runs}
    if args.offline:
        report["offline_runs"] = offline
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
