"""Speculative decoding benchmark: output tokens/s of the offline engine (`AsyncEngine`, no HTTP) with and
without n-gram drafts (and a draft model's, `--speculative-model`), per concurrency, greedy, on prompts whose
answers copy their input and on free ones.

    python tools/bench_spec.py --device cuda --concurrency 1,4,16 --max-tokens 256 --draft-max-pause 0,64 \
        --out spec.json
    python tools/bench_spec.py --model BIG.gguf --speculative-model SMALL.gguf --draft-max-pause 64

Reports, as JSON lines and in `--out`, for each (method, prompt set, concurrency): output tok/s (median of
`--repeats`), and for ngram the acceptance length (tokens a verify step emits per sequence, 1 + accepted /
verifies) and drafts per verify. Greedy outputs of both methods are compared (case D1) and a mismatch is
reported as `"lossless": false`. `--draft-max-pause` runs n-gram (and the draft model) once per backoff setting
(0: none), `--speculative-gate` once per draft gate mode (`auto`, the engine's default, or `off`: always draft;
`off,auto` compares them; one engine serves all prompt sets and concurrencies of a run, so the gate's
measurements carry over from one to the next, as in a server). `--speculative-model` names draft models
(comma-separated; "self": the model itself, whose greedy drafts all pass: the bound of acceptance at the cost of a
second model as large). `--temperature T` samples every request at T with top-p 0.95 instead (speculative
sampling; outputs then differ run to run, so no `lossless`). Other engine settings come from VOLTSERVE_*
variables.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's actors/ and loaders/

PROMPTS = {
    "copy": ["Repeat this paragraph word for word: The lighthouse stood on the rocks for a hundred years, and "
             "every night its keeper climbed the stairs, lit the lamp and watched the ships pass by.",
             "Rewrite this code with type hints: def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    "
             "return a * b\n\ndef sub(a, b):\n    return a - b\n",
             "List the numbers from 1 to 60 separated by commas."],
    "free": ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "Explain how a refrigerator works.",
             "Describe a day in the life of a medieval blacksmith."],
}


async def level(engine, prompts: list[list[int]], concurrency: int, max_tokens: int,
                temperature: float = 0.0) -> tuple[float, list]:
    """Run `concurrency` streams, each cycling through the prompts once (greedy, or sampled at `temperature` with
    top-p 0.95); returns (tok/s, token lists)."""
    from tests.e2e.engine_helpers import complete

    jobs = [prompts[i % len(prompts)] for i in range(max(concurrency, len(prompts)))]
    sem = asyncio.Semaphore(concurrency)

    async def one(p):
        async with sem:
            return await complete(engine, p, temperature=temperature, top_p=0.95 if temperature else 1.0,
                                  max_tokens=max_tokens, ignore_eos=False)

    t0 = time.perf_counter()
    outs = await asyncio.gather(*[one(p) for p in jobs])
    dt = time.perf_counter() - t0
    tokens = [o[1] for o in outs]
    return sum(map(len, tokens)) / dt, tokens


async def run(args) -> list[dict]:
    from actors.engine import AsyncEngine
    from loaders import load_model
    from voltserve.config import EngineConfig

    loaded = load_model(args.model)
    results, outputs = [], {}
    drafts = [("ngram", "")] + [("draft_model", args.model if m == "self" else m) for m in args.speculative_model]
    runs = [("none", "", 0, "off")] + [(m, d, p, g) for m, d in drafts for p in args.draft_max_pause
                                       for g in args.speculative_gate]
    for method, draft, pause, gate in runs:
        config = EngineConfig.from_env(model=args.model, device=args.device, speculative_method=method,
                                       speculative_model=draft, num_speculative_tokens=args.num_speculative_tokens,
                                       concurrency_drafts=args.concurrency_drafts, draft_max_pause=pause,
                                       speculative_gate=gate)
        engine = AsyncEngine(config, loaded=loaded)
        await engine.start()
        try:
            template, tok = engine.chat_template, engine.tokenizer
            for name, texts in PROMPTS.items():
                prompts = [tok.encode(template.render([{"role": "user", "content": t}])) for t in texts]
                for c in args.concurrency:
                    await level(engine, prompts, c, 8)  # warm-up (kernels, graphs of this width)
                    sched = engine._scheduler_actor.scheduler
                    v0, d0, a0 = sched.num_verify_steps, sched.num_draft_tokens, sched.num_accepted_tokens
                    rates = []
                    for _ in range(args.repeats):
                        rate, tokens = await level(engine, prompts, c, args.max_tokens, args.temperature)
                        rates.append(rate)
                    row = {"method": method,
                           **({"draft_max_pause": pause, "speculative_gate": gate} if method != "none" else {}),
                           **({"speculative_model": draft} if draft else {}),
                           "prompts": name, "concurrency": c, "device": args.device,
                           "output_tokens_per_s": round(statistics.median(rates), 1),
                           "runs": [round(r, 1) for r in rates]}
                    verifies = sched.num_verify_steps - v0
                    if verifies:
                        row["acceptance_length"] = round(1 + (sched.num_accepted_tokens - a0) / verifies, 3)
                        row["drafts_per_verify"] = round((sched.num_draft_tokens - d0) / verifies, 3)
                    key = (name, c)
                    if args.temperature:
                        row["temperature"] = args.temperature
                    elif method == "none":
                        outputs[key] = tokens
                    else:
                        row["lossless"] = tokens == outputs[key]
                    if method != "none":
                        base = next(r for r in results if r["method"] == "none" and r["prompts"] == name
                                    and r["concurrency"] == c)
                        row["speedup"] = round(row["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
                    print(json.dumps(row), flush=True)
                    results.append(row)
        finally:
            await engine.stop()
            # the next engine sizes its KV pool from free GPU memory: this one's must be gone first
            del engine
            gc.collect()
            if args.device == "cuda":
                import torch

                torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--concurrency", default=[1, 4, 16], type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--concurrency-drafts", default="")
    parser.add_argument("--draft-max-pause", default=[64], type=lambda s: [int(x) for x in s.split(",")],
                        help="draft backoff's longest pause (EngineConfig.draft_max_pause), one n-gram run per value; "
                             "0: no backoff")
    parser.add_argument("--speculative-gate", default=["auto"], type=lambda s: s.split(","),
                        help="draft gate modes (EngineConfig.speculative_gate), one run per value: auto, off")
    parser.add_argument("--speculative-model", default=[], type=lambda s: [m for m in s.split(",") if m],
                        help="draft models to run the draft_model method with (comma-separated; self: the model)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample every request at this temperature (top-p 0.95); 0: greedy, checked lossless")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results}, indent=1))


if __name__ == "__main__":
    main()
