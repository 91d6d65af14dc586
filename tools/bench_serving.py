"""Serving benchmark: streaming chat completions against a running server at several concurrency levels.

For each level it sends `--num-requests` requests (at most `concurrency` in flight) and reports, as JSON:
TTFT (request sent -> first content delta), TPOT ((last delta - first delta) / (output tokens - 1)), ITL (gaps
between consecutive content deltas), each as p50/p90/p99/mean in seconds, plus output tokens/s and requests/s.
With matplotlib installed it also draws latency percentiles against concurrency (`--plot`).

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency 1,4,16 --out bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
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

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                      headers: dict[str, str]) -> RequestResult:
    """Send one streaming chat completion (greedy, EOS ignored so every request makes `max_tokens` tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult()
    start = last = time.perf_counter()
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
                if not any(c["delta"].get("content") for c in event.get("choices", [])):
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = last - start
    return result


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean of `values` (None when empty)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


async def run_level(client: httpx.AsyncClient, model: str, concurrency: int, num_requests: int, prompt: str,
                    max_tokens: int, headers: dict[str, str]) -> dict:
    """Run `num_requests` requests with at most `concurrency` in flight; returns the level's summary."""
    gate = asyncio.Semaphore(concurrency)

    async def gated() -> RequestResult:
        async with gate:
            return await one_request(client, model, prompt, max_tokens, headers)

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
        results = []
        for concurrency in args.concurrency:
            num_requests = args.num_requests or max(4, 2 * concurrency)
            level = await run_level(client, model, concurrency, num_requests, args.prompt, args.max_tokens, headers)
            print(f"concurrency {concurrency}: {level['output_tokens_per_s']:.1f} tok/s, "
                  f"TTFT p50 {level['ttft_s']['p50']}, TPOT p50 {level['tpot_s']['p50']}", file=sys.stderr)
            results.append(level)
    return {"base_url": args.base_url, "model": model, "command": " ".join(sys.argv), "max_tokens": args.max_tokens,
            "prompt_chars": len(args.prompt), "results": results}


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
    parser.add_argument("--out", default="", help="also write the JSON report here")
    parser.add_argument("--plot", default="", help="PNG of latency percentiles vs concurrency (needs matplotlib)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
