"""Speculative decoding's verify step against plain decoding, on synthetic weights (no model file, no tokenizer):
what a step that verifies k drafts costs when they all pass (the upper bound of the speedup) and when they all
fail (the price of a wasted verify), with draft backoff on and off (`voltserve.spec.backoff`).

    python tools/bench_verify.py --device cuda --batch 1,4 --k 1,2,4 --tokens 128 --out verify.json
    python tools/bench_verify.py --device cpu --shape tiny --tokens 24       # a smoke run

Each row: ms per generated token of each sequence (the second of two runs: the first captures the CUDA graphs),
for plain decoding one step at a time (`plain_sync`) and with steps planned ahead (`plain_pipelined`, the
engine's asynchronous scheduling), and for each (k, drafts pass / fail, backoff) the same load through verify
steps (pipelined where the scheduler allows), its ratio to both plain figures and whether its greedy tokens equal
plain decoding's (`lossless`). The drafter knows the plain output: "pass" proposes it, "fail" proposes each token
plus one. On the CPU no step is planned ahead and the tiny shape is host-bound: only the GPU figures are speeds.

`--temperature T` adds, per (batch, k), sampled decoding against sampled verify steps of k point-mass drafts (the
sequence's last token repeated), both at T with top_p 0.95: what a sampled verify costs a step (its rows'
distributions, the uniform draws and the residual's sample, on the device).

`--gpu-busy` (CUDA) adds `gpu_busy_ms_per_step` to the plain rows (one step at a time) and to the failing verify
rows without backoff: the time a step keeps the GPU busy (the union of its kernels' intervals under
torch.profiler, so kernels that overlap through programmatic dependent launch count once), against which the
rows' wall time shows the host's share of a step the device waits for.

`--draft-shape` adds, per (batch, k), a run with a draft model of that shape (random weights, so its drafts
fail and, without backoff, every step verifies k of them): `draft_ms_per_step` (the drafter's `prepare`: its
catch-up and k - 1 decode steps), `verify_ms_per_step` (the rest of the step) and the speedup over pipelined plain
decoding those costs give where a fraction `a` of drafts pass (`projected_speedup`: 1 + a + ... + a^k tokens a
step, the standard estimate of Leviathan et al. 2023).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.make_synthetic_checkpoint import synthetic_model  # noqa: E402
from voltserve.kv_cache import BlockPool  # noqa: E402
from voltserve.models.llama import LlamaModel  # noqa: E402
from voltserve.offline import run_steps  # noqa: E402
from voltserve.request import SamplingParams  # noqa: E402
from voltserve.runner import ModelRunner  # noqa: E402
from voltserve.scheduler import Scheduler  # noqa: E402
from voltserve.sequence import Sequence  # noqa: E402
from voltserve.spec.ladder import DraftLadder  # noqa: E402

BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN, PROMPT_LEN = 16, 256, 1024, 64
EOS = -1  # no token ends a sequence: lengths are set by --tokens


class KnownDrafter:
    """Proposes the plain greedy output (`fail`: each token plus one, so the first draft never passes)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], vocab_size: int, fail: bool):
        self.known = list(zip(prompts, outputs))
        self.vocab_size, self.fail = vocab_size, fail

    def propose(self, seq, k: int) -> list[int]:
        tokens = seq.token_ids()
        for prompt, out in self.known:
            if tokens[:len(prompt)] == prompt:
                drafts = out[len(tokens) - len(prompt):][:k]
                return [(t + 1) % self.vocab_size for t in drafts] if self.fail else drafts
        raise KeyError("unknown sequence")


class RepeatDrafter:
    """Proposes the sequence's last token k times (point masses, as n-gram lookup gives; on random weights they
    mostly fail): the load of `--temperature`'s sampled verify rows."""

    def propose(self, seq, k: int) -> list[int]:
        return [seq.token_ids()[-1]] * k


class Bench:
    """One model, backend and KV cache; CUDA graphs per verify width, captured once."""

    def __init__(self, device: str, shape: str, qtype: str | None, max_seqs: int):
        dtype = torch.float16 if device == "cuda" else torch.float32
        loaded = synthetic_model(shape, device=device, dtype=dtype, qtype=qtype, seed=3)
        if device == "cuda":
            from voltserve.backends.cuda.backend import CudaBackend
            self.backend = CudaBackend(0)
        else:
            from voltserve.backends.cpu import CpuBackend
            self.backend = CpuBackend()
        self.device, self.max_seqs = device, max_seqs
        self.model = LlamaModel(loaded.config, loaded.tensors, self.backend, loaded.quantized,
                                max_positions=MAX_MODEL_LEN)
        cfg = loaded.config
        self.vocab_size = cfg.vocab_size
        self.kv = self.backend.allocate_kv_cache(cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads,
                                                 cfg.head_dim)
        self._graphs: dict[int, object] = {}

    def draft_model_drafter(self, shape: str, k: int):
        """A DraftModelDrafter over a random draft model of `shape` (dense) with a pool as large as the target's
        and, on CUDA, its own decode and mixed graphs; its `prepare` time accumulates in `.prepare_s`."""
        from voltserve.spec.draft_model import DraftModelDrafter

        dtype = torch.float16 if self.device == "cuda" else torch.float32
        loaded = synthetic_model(shape, device=self.device, dtype=dtype, seed=5)
        cfg = loaded.config
        model = LlamaModel(cfg, loaded.tensors, self.backend, loaded.quantized, max_positions=MAX_MODEL_LEN)
        kv = self.backend.allocate_kv_cache(cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        graphs = None
        if self.device == "cuda":
            from voltserve.graphs import StepGraphs
            graphs = StepGraphs(model, self.backend, kv, max_num_seqs=self.max_seqs, max_model_len=MAX_MODEL_LEN,
                                prefill_tokens=(8, PROMPT_LEN))
            graphs.capture()
        drafter = DraftModelDrafter(ModelRunner(model, self.backend, kv, (), seed=0, graphs=graphs),
                                    BlockPool(NUM_BLOCKS, BLOCK_SIZE, False), k, self.vocab_size)
        drafter.prepare_s = 0.0
        prepare = drafter.prepare

        def timed_prepare(wanted):
            t0 = time.perf_counter()
            prepare(wanted)  # synchronous: each draft step's tokens come back to the host
            drafter.prepare_s += time.perf_counter() - t0
        drafter.prepare = timed_prepare
        return drafter

    def graphs(self, k: int):
        """The StepGraphs for verify width k (0: none), or None on the CPU."""
        if self.device != "cuda":
            return None
        if k not in self._graphs:
            from voltserve.graphs import StepGraphs
            g = StepGraphs(self.model, self.backend, self.kv, max_num_seqs=self.max_seqs,
                           max_model_len=MAX_MODEL_LEN, prefill_tokens=(PROMPT_LEN,),
                           verify_width=DraftLadder(k).width if k else None)
            g.capture()
            self._graphs[k] = g
        return self._graphs[k]

    def run(self, prompts: list[list[int]], tokens: int, pipelined: bool, k: int = 0, drafter=None,
            max_pause: int = 0, temperature: float = 0.0) -> tuple[float, list[list[int]], Scheduler, int]:
        """(seconds, outputs, the scheduler, steps) of `tokens` tokens per prompt, all prompts at once (greedy, or
        sampled at `temperature` with top_p 0.95)."""
        runner = ModelRunner(self.model, self.backend, self.kv, (EOS,), seed=0, graphs=self.graphs(k))
        spec = {"drafter": drafter, "ladder": DraftLadder(k), "draft_max_pause": max_pause} if k else {}
        sched = Scheduler(BlockPool(NUM_BLOCKS, BLOCK_SIZE), self.max_seqs, 512, MAX_MODEL_LEN, (EOS,),
                          *runner.ahead_admission(), **spec)
        params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, ignore_eos=True)
        seqs = [Sequence(i, f"r{i}", 0, list(p), params, tokens) for i, p in enumerate(prompts)]
        for s in seqs:
            sched.add(s)
        self.sync()
        start = time.perf_counter()
        steps = run_steps(sched, runner, pipelined=pipelined)
        self.sync()
        return time.perf_counter() - start, [s.output_ids for s in seqs], sched, steps

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def timed(self, *args, **kwargs):
        """`run`'s second call (the first captures graphs and warms the allocator)."""
        self.run(*args, **kwargs)
        return self.run(*args, **kwargs)


def draft_model_row(bench: Bench, shape: str, k: int, prompts, plain, tokens: int, t_pipe: float,
                    base: dict) -> dict:
    """The `--draft-shape` row (see the module's docstring): the second of two runs, no backoff; `lossless`:
    its greedy tokens equal `plain`'s."""
    for _ in range(2):
        drafter = bench.draft_model_drafter(shape, k)
        start = time.perf_counter()
        runner = ModelRunner(bench.model, bench.backend, bench.kv, (EOS,), seed=0, graphs=bench.graphs(k))
        sched = Scheduler(BlockPool(NUM_BLOCKS, BLOCK_SIZE), bench.max_seqs, 512, MAX_MODEL_LEN, (EOS,),
                          drafter=drafter, ladder=DraftLadder(k), draft_max_pause=0)
        seqs = [Sequence(i, f"r{i}", 0, list(p), SamplingParams(temperature=0, ignore_eos=True), tokens)
                for i, p in enumerate(prompts)]
        for seq in seqs:
            sched.add(seq)
        steps = run_steps(sched, runner)
        bench.sync()
        t = time.perf_counter() - start
    draft_ms, step_ms = 1e3 * drafter.prepare_s / steps, 1e3 * t / steps
    plain_step_ms = 1e3 * t_pipe / tokens
    projected = {str(a): round(sum(a ** i for i in range(k + 1)) * plain_step_ms / step_ms, 3)
                 for a in (0.5, 0.7, 0.9)}
    return {**base, "run": "draft_model", "draft_shape": shape, "k": k, "steps": steps,
            "verify_steps": sched.num_verify_steps, "draft_ms_per_step": round(draft_ms, 4),
            "verify_ms_per_step": round(step_ms - draft_ms, 4), "plain_ms_per_step": round(plain_step_ms, 4),
            "projected_speedup": projected, "lossless": [s.output_ids for s in seqs] == plain}


def sampled_row(bench: Bench, prompts, tokens: int, k: int, temperature: float, base: dict) -> dict:
    """The `--temperature` row: ms per step of sampled decoding (the device sampler, pipelined) and of sampled
    verify steps of k point-mass drafts each (`RepeatDrafter`, no backoff), and the tokens a verify step gave."""
    t_plain, _, _, _ = bench.timed(prompts, tokens, pipelined=True, temperature=temperature)
    t, _, sched, steps = bench.timed(prompts, tokens, pipelined=True, k=k, drafter=RepeatDrafter(),
                                     temperature=temperature)
    return {**base, "run": "verify_sampled", "k": k, "temperature": temperature,
            "plain_ms_per_step": round(1e3 * t_plain / tokens, 4),
            "verify_ms_per_step": round(1e3 * t / steps, 4), "steps": steps,
            "verify_steps": sched.num_verify_steps, "accepted": sched.num_accepted_tokens,
            "tokens_per_step": round(tokens / steps, 3)}


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (any unit, any order): the time at least one ran."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def gpu_busy_ms_per_step(bench: Bench, *args, **kwargs) -> float:
    """ms of GPU busy time a step of `bench.run(*args, **kwargs)` (a run after `timed`'s warm-up), under
    torch.profiler: the union of its CUDA kernels' and copies' intervals over the run, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, _, _, steps = bench.run(*args, **kwargs)
    events = [(e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return round(busy_seconds(events) / 1e3 / steps, 4)  # profiler times are in us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="smollm2-135m", help="a tools/make_synthetic_checkpoint.py shape")
    parser.add_argument("--qtype", default="Q4_1", help="decoder linears as GGUF blocks (CUDA only); 'none': dense")
    parser.add_argument("--batch", default=[1, 4], type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--k", default=[1, 2, 4], type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens per sequence")
    parser.add_argument("--max-pause", type=int, default=64, help="the backoff runs' draft_max_pause")
    parser.add_argument("--draft-shape", default="", help="also a draft model of this shape (random weights)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="also sampled verify steps at this temperature (top_p 0.95) against plain sampling")
    parser.add_argument("--gpu-busy", action="store_true",
                        help="also the GPU busy time a step of the plain and failing verify runs (CUDA)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    busy = args.gpu_busy and args.device == "cuda"
    qtype = None if args.device != "cuda" or args.qtype == "none" else args.qtype
    bench = Bench(args.device, args.shape, qtype, max(args.batch))
    rows = []
    for batch in args.batch:
        prompts = [[(7 * j + 3 * i) % (bench.vocab_size - 10) + 5 for j in range(PROMPT_LEN)] for i in range(batch)]
        t_sync, plain, _, _ = bench.timed(prompts, args.tokens, pipelined=False)
        t_pipe, _, _, _ = bench.timed(prompts, args.tokens, pipelined=True)
        base = {"device": args.device, "shape": args.shape, "qtype": qtype, "batch": batch, "tokens": args.tokens}
        rows.append({**base, "run": "plain", "sync_ms_per_token": round(1e3 * t_sync / args.tokens, 4),
                     "pipelined_ms_per_token": round(1e3 * t_pipe / args.tokens, 4)})
        if busy:
            rows[-1]["gpu_busy_ms_per_step"] = gpu_busy_ms_per_step(bench, prompts, args.tokens, pipelined=False)
        print(json.dumps(rows[-1]), flush=True)
        for k in args.k:
            for drafts, pause in (("pass", 0), ("fail", 0), ("fail", args.max_pause)):
                drafter = KnownDrafter(prompts, plain, bench.vocab_size, fail=drafts == "fail")
                t, out, sched, _ = bench.timed(prompts, args.tokens, pipelined=True, k=k, drafter=drafter,
                                               max_pause=pause)
                rows.append({**base, "run": "verify", "k": k, "drafts": drafts, "draft_max_pause": pause,
                             "ms_per_token": round(1e3 * t / args.tokens, 4),
                             "speedup_vs_pipelined": round(t_pipe / t, 3), "speedup_vs_sync": round(t_sync / t, 3),
                             "verify_steps": sched.num_verify_steps, "accepted": sched.num_accepted_tokens,
                             "lossless": out == plain})
                if busy and drafts == "fail" and not pause:
                    rows[-1]["gpu_busy_ms_per_step"] = gpu_busy_ms_per_step(
                        bench, prompts, args.tokens, pipelined=True, k=k, drafter=drafter)
                print(json.dumps(rows[-1]), flush=True)
            if args.temperature > 0:
                rows.append(sampled_row(bench, prompts, args.tokens, k, args.temperature, base))
                print(json.dumps(rows[-1]), flush=True)
            if args.draft_shape:
                rows.append(draft_model_row(bench, args.draft_shape, k, prompts, plain, args.tokens, t_pipe,
                                            base))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
