"""The scheduler's host cost under KV pool pressure: `Scheduler.schedule()` and `update()` of many long prompts
through a pool that holds about a quarter of them (chunked prefill, decode, preemption by recompute, admissions the
pool defers), on the CPU with no model: every sampled token is made up. Reports the milliseconds spent in
schedule() and update() over the whole run (the median of `--repeat` runs) and the number of `hash_block` calls
(the prefix cache's SHA-256 per full block).

    python tools/bench_scheduler.py                       # 64 sequences x 4096-token prompts, 4096 blocks of 16
    python tools/bench_scheduler.py --seqs 16 --prompt 1024 --blocks 1024 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src")]

from voltserve import kv_cache  # noqa: E402
from voltserve.kv_cache import BlockPool  # noqa: E402
from voltserve.request import SamplingParams  # noqa: E402
from voltserve.scheduler import Scheduler  # noqa: E402
from voltserve.sequence import Sequence  # noqa: E402


def run(args) -> dict:
    """One run to the end of every sequence; returns its figures."""
    pool = BlockPool(args.blocks, args.block_size, enable_prefix_caching=True)
    s = Scheduler(pool, args.seqs, args.batched_tokens, args.prompt + args.max_tokens, (0,))
    shared = list(range(1, args.shared_prefix + 1))  # a system prompt every request starts with
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.seqs):
        unique = [(i * 7919 + p) % 30000 + 1 for p in range(args.prompt - args.shared_prefix)]
        s.add(Sequence(i, f"r{i}", 0, shared + unique, params, args.max_tokens))
    real, calls = kv_cache.hash_block, [0]

    def counted(parent, token_ids):
        calls[0] += 1
        return real(parent, token_ids)

    kv_cache.hash_block = counted
    schedule_s = update_s = 0.0
    steps = 0
    try:
        while s.has_work():
            t0 = time.perf_counter()
            plan = s.schedule()
            t1 = time.perf_counter()
            sampled = {e.seq.seq_id: (e.seq.seq_id * 31 + e.start) % 30000 + 1 for e in plan.entries if e.sample}
            s.update(plan, sampled)
            schedule_s += t1 - t0
            update_s += time.perf_counter() - t1
            steps += 1
    finally:
        kv_cache.hash_block = real
    return {"schedule_ms": schedule_s * 1e3, "update_ms": update_s * 1e3, "steps": steps,
            "preemptions": s.num_preemptions, "hash_block_calls": calls[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens of each sequence")
    ap.add_argument("--shared-prefix", type=int, default=1024, help="leading prompt tokens all sequences share")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4096, help="KV pool blocks (64 x 4352 tokens need 17,408)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    runs = [run(args) for _ in range(args.repeat)]
    median = {k: statistics.median(r[k] for r in runs) for k in ("schedule_ms", "update_ms")}
    print(json.dumps({"device": "cpu (host only)", "command": " ".join(sys.argv), **vars(args),
                      **{k: round(v, 1) for k, v in median.items()},
                      **{k: runs[0][k] for k in ("steps", "preemptions", "hash_block_calls")}}, indent=1))


if __name__ == "__main__":
    main()
