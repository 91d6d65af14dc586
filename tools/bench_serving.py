"""Serving benchmark: streaming chat completions against a running server at several concurrency levels.

For each level it sends `--num-requests` requests (at most `concurrency` in flight) and reports, as JSON:
TTFT (request sent -> first content delta), TPOT ((last delta - first delta) / (output tokens - 1)), ITL (gaps
between consecutive content deltas), each as p50/p90/p99/mean in seconds, plus output tokens/s and requests/s.
With matplotlib installed it also draws latency percentiles against concurrency (`--plot`).

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 1,4,16 --out bench.json

`--processes N` splits each level's streams and requests over N client processes (one httpx process parsing
every SSE line is itself a bound near 12k tok/s) and sums their tokens over the longest one's wall time.
`--temperature T --top-p P` samples every request (OpenAI's default is temperature 1; the default here, 0, is
greedy). `--offline MODEL` replays the same request stream through an in-process `AsyncEngine` without HTTP (same chat
template, same concurrency gate): the engine's offline figure for the same load, the denominator of "HTTP tok/s
>= 90% of offline" (issue "Performance", target 5). Engine settings come from VOLTSERVE_* variables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds, monotonic clock) and its token count."""

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None
    start_s: float = field(default_factory=time.perf_counter)  # when the request was sent
    last_s: float = 0.0  # the last content delta (start_s until one arrives)

    def __post_init__(self) -> None:
        self.last_s = self.last_s or self.start_s

    def content_delta(self) -> None:
        """A content delta arrived now: the first sets TTFT, later ones add an inter-token gap."""
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - self.start_s
        else:
            self.itl_s.append(now - self.last_s)
        self.last_s = now

    def done(self) -> None:
        self.latency_s = self.last_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                      headers: dict[str, str], temperature: float = 0.0, top_p: float = 1.0) -> RequestResult:
    """Send one streaming chat completion (greedy, or sampled at `temperature` / `top_p`; EOS ignored so every
    request makes `max_tokens` tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error event")
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if any(c["delta"].get("content") for c in event.get("choices", [])):
                    result.content_delta()
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.done()
    return result


async def one_request_offline(engine, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
                              top_p: float = 1.0) -> RequestResult:
    """One request through `engine.generate` (EOS ignored), sampled as `one_request` samples, timed like it."""
    from voltserve.request import SamplingParams

    result = RequestResult()
    params = SamplingParams(temperature=temperature, top_p=top_p, ignore_eos=True, max_tokens=max_tokens)
    async for out in engine.generate(prompt_ids, params):
        result.output_tokens = out.num_output_tokens
        if out.text:
            result.content_delta()
    result.done()
    return result


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean of `values` (None when empty)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


async def run_level(send, concurrency: int, num_requests: int) -> dict:
    """Run `num_requests` requests (`send()` makes one, -> RequestResult) with at most `concurrency` in flight;
    returns the level's summary."""
    gate = asyncio.Semaphore(concurrency)

    async def gated() -> RequestResult:
        async with gate:
            return await send()

    start = time.perf_counter()
    results = await asyncio.gather(*(gated() for _ in range(num_requests)))
    duration_s = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "num_requests": num_requests,
        "num_errors": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else None,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else None,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r.itl_s]),
    }


def plot(report: dict, path: str) -> bool:
    """Latency percentiles vs concurrency as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    levels = [r["concurrency"] for r in report["results"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, metric in zip(axes, ("ttft_s", "tpot_s", "itl_s")):
        for pct in ("p50", "p90", "p99"):
            values = [r[metric][pct] for r in report["results"]]
            ax.plot(levels, [v * 1e3 if v is not None else np.nan for v in values], marker="o", label=pct)
        ax.set(title=metric.removesuffix("_s").upper(), xlabel="concurrency", ylabel="ms", xscale="log")
        ax.legend()
    fig.suptitle(f"{report['model']} @ {report['base_url']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


async def bench(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Run every concurrency level of `args`; returns the JSON report."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(600.0), transport=transport,
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = args.model
        if not model:
            models = (await client.get("/v1/models", headers=headers)).raise_for_status().json()
            model = models["data"][0]["id"]
        results = await _levels(args, lambda: one_request(client, model, args.prompt, args.max_tokens, headers,
                                                          args.temperature, args.top_p))
    return {"base_url": args.base_url, "model": model, "command": " ".join(sys.argv), "max_tokens": args.max_tokens,
            **_sampling(args), "prompt_chars": len(args.prompt), "results": results}


def _sampling(args: argparse.Namespace) -> dict:
    """The report's sampling fields: none for greedy requests."""
    return {"temperature": args.temperature, "top_p": args.top_p} if args.temperature else {}


async def _levels(args: argparse.Namespace, send) -> list[dict]:
    results = []
    for concurrency in args.concurrency:
        num_requests = args.num_requests or max(4, 2 * concurrency)
        level = await run_level(send, concurrency, num_requests)
        print(f"concurrency {concurrency}: {level['output_tokens_per_s']:.1f} tok/s, "
              f"TTFT p50 {level['ttft_s']['p50']}, TPOT p50 {level['tpot_s']['p50']}", file=sys.stderr)
        results.append(level)
    return results


async def bench_offline(args: argparse.Namespace) -> dict:
    """The same levels through an in-process AsyncEngine serving `args.offline` (no HTTP); the engine's log lines
    (VOLTSERVE_GPU_BUSY_LOG_INTERVAL windows among them) go to stderr at VOLTSERVE_LOG_LEVEL, as a server's do."""
    from actors.engine import AsyncEngine
    from api.openai.chat_prompt import encode_rendered
    from voltserve.config import EngineConfig
    from voltserve.log_setup import configure_logging

    configure_logging()
    engine = AsyncEngine(EngineConfig.from_env(model=args.offline))
    await engine.start()
    try:
        rendered = engine.chat_template.render([{"role": "user", "content": args.prompt}],
                                               add_generation_prompt=True)
        prompt_ids = encode_rendered(engine.tokenizer, rendered)
        results = await _levels(args, lambda: one_request_offline(engine, prompt_ids, args.max_tokens,
                                                                  args.temperature, args.top_p))
    finally:
        await engine.stop()
    return {"offline": args.offline, "model": args.offline, "command": " ".join(sys.argv),
            "max_tokens": args.max_tokens, **_sampling(args), "prompt_chars": len(args.prompt), "results": results}


def bench_processes(args: argparse.Namespace, argv: list[str]) -> dict:
    """Each level split over `args.processes` client processes; tokens summed over the longest wall time."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for concurrency in args.concurrency:
            n = args.processes
            num_requests = args.num_requests or max(4, 2 * concurrency)
            children = []
            for i in range(n):
                out = os.path.join(tmp, f"{concurrency}-{i}.json")
                child = argv + ["--processes", "1", "--concurrency", str(max(1, concurrency // n)),
                                "--num-requests", str(max(1, num_requests // n)), "--out", out, "--plot", ""]
                children.append((subprocess.Popen([sys.executable, os.path.abspath(__file__), *child],
                                                  stdout=subprocess.DEVNULL), out))
            parts = []
            for proc, out in children:
                proc.wait()
                with open(out) as f:
                    parts.append(json.load(f)["results"][0])
            duration = max(p["duration_s"] for p in parts)
            tokens = sum(p["output_tokens"] for p in parts)
            results.append({
                "concurrency": concurrency, "processes": n, "num_requests": sum(p["num_requests"] for p in parts),
                "num_errors": sum(p["num_errors"] for p in parts), "duration_s": duration, "output_tokens": tokens,
                "output_tokens_per_s": tokens / duration, "per_process": parts,
                # the first process's percentiles (each process sees the same mix of streams)
                "ttft_s": parts[0]["ttft_s"], "tpot_s": parts[0]["tpot_s"], "itl_s": parts[0]["itl_s"]})
            print(f"concurrency {concurrency} over {n} processes: {tokens / duration:.1f} tok/s", file=sys.stderr)
    return {"base_url": args.base_url, "model": args.model, "command": " ".join(sys.argv),
            "max_tokens": args.max_tokens, **_sampling(args), "prompt_chars": len(args.prompt), "results": results}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="", help="default: the first model of /v1/models")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--concurrency", default=[1, 4, 16], type=lambda s: [int(x) for x in s.split(",")],
                        help="comma-separated levels (default 1,4,16)")
    parser.add_argument("--num-requests", type=int, default=0, help="per level; default max(4, 2 x concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; OpenAI's default is 1")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--out", default="", help="also write the JSON report here")
    parser.add_argument("--plot", default="", help="PNG of latency percentiles vs concurrency (needs matplotlib)")
    parser.add_argument("--processes", type=int, default=1, help="client processes per level (their sum is reported)")
    parser.add_argument("--offline", default="", metavar="MODEL",
                        help="no HTTP: the same requests through an in-process AsyncEngine serving MODEL")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.offline:
        report = asyncio.run(bench_offline(args))
    elif args.processes > 1:
        report = bench_processes(args, argv)
    else:
        report = asyncio.run(bench(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.plot and not plot(report, args.plot):
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0 if all(r["num_errors"] == 0 for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
