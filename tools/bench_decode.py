"""Offline decode throughput: tokens/s of the engine's ModelRunner at several batch sizes, graphs on and off.

Each point prefills `batch` sequences of `--prompt-len` tokens, then times `--steps` decode steps (median of
`--repeats`). For the 8B-shape synthetic model it also prints the batch-1 roofline: (weight bytes + KV bytes read
per step) / the device-to-device copy bandwidth (`bench_kernels.copy_bandwidth`, measured before anything is
loaded) (issue 4, target 3). `--gemv-kernel scalar,auto` repeats every point per decode-GEMV choice
(`VOLTSERVE_GEMV_KERNEL`), `--pdl`, `--mixed-graphs` and `--async-scheduling` likewise. `--churn GEN_LEN` adds
the serving steady state (`time_churn`: sequences of GEN_LEN tokens replaced by new --prompt-len requests as
they finish, so new prefills share steps with the others' decodes).

    python tools/bench_decode.py --model smollm2-135m-instruct --device cuda --out decode.json
    python tools/bench_decode.py --synthetic llama3-8b --device cuda --batch 1,8 --gemv-kernel scalar,auto
    python tools/bench_decode.py --device cuda --batch 1 --prefill 512 --repeats 5   # adds pp512
    python tools/bench_decode.py --device cuda --batch 64 --graphs on --churn 256 --prompt-len 40 --steps 256 \
        --mixed-graphs on,off
    python tools/bench_decode.py --synthetic llama3-8b --device cuda --batch 1 --graphs on \
        --env "VOLTSERVE_FUSE_NORM=auto|off"   # any backend knob read from the environment, A/B in one process
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from actors.build import build_runner  # noqa: E402
from voltserve.config import EngineConfig  # noqa: E402
from voltserve.kv_cache import BlockPool  # noqa: E402
from voltserve.offline import run_steps  # noqa: E402
from voltserve.request import SamplingParams  # noqa: E402
from voltserve.scheduler import Scheduler  # noqa: E402
from voltserve.sequence import Sequence  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _scheduler(built, batch: int, prompt_len: int, max_tokens: int, max_num_seqs: int = 0,
               temperature: float = 0.0, top_p: float = 1.0) -> Scheduler:
    """A scheduler (no prefix caching) holding `batch` sequences of distinct `prompt_len`-token prompts, greedy
    (temperature 0) or sampled at `temperature` with `top_p` (the device sampler), running at most
    max(batch, max_num_seqs) at once."""
    cfg = built.model_config
    pool = BlockPool(built.num_blocks, built.runner.block_size, enable_prefix_caching=False)
    sched = Scheduler(pool, max(batch, max_num_seqs), max(2048, batch * prompt_len), prompt_len + max_tokens, (),
                      *built.runner.ahead_admission())
    for i in range(batch):
        prompt = [(7 * i + j) % min(cfg.vocab_size, 250) + 1 for j in range(prompt_len)]
        sched.add(Sequence(i, f"r{i}", 0, prompt, SamplingParams(temperature=temperature, top_p=top_p, ignore_eos=True),
                           max_tokens, philox_seed=i))
    return sched


def time_decode(built, batch: int, prompt_len: int, steps: int, device: str, pipelined: bool = True,
                temperature: float = 0.0, top_p: float = 1.0) -> float:
    """Seconds per decode step at `batch` sequences, greedy or sampled at `temperature` with `top_p`. pipelined:
    asynchronous scheduling as the engine does it (`voltserve.offline.run_steps`)."""
    sched = _scheduler(built, batch, prompt_len, steps + 2, temperature=temperature, top_p=top_p)
    plan = sched.schedule()  # prefill all
    sched.update(plan, built.runner.execute(plan)[0])
    _sync(device)
    start = time.perf_counter()
    assert run_steps(sched, built.runner, steps, pipelined) == steps
    _sync(device)
    return (time.perf_counter() - start) / steps


def time_churn(built, batch: int, prompt_len: int, gen_len: int, steps: int, device: str) -> tuple[float, float]:
    """Steady state of a server at `batch` streams: every sequence generates `gen_len` tokens and is replaced by a
    new `prompt_len`-token request when it finishes; the first `batch` have staggered lengths (gen_len * (i + 1) /
    batch), so about batch / gen_len requests start in each step and their prefills share steps with the others'
    decodes (mixed steps), as under HTTP clients that drift apart. Returns (seconds per step, output tokens/s) over
    `steps` steps after one gen_len-long warm-up."""
    sched = _scheduler(built, 0, prompt_len, gen_len, max_num_seqs=batch)
    cfg = built.model_config
    next_id = [0]

    def add(max_tokens: int) -> None:
        i = next_id[0]
        next_id[0] += 1
        prompt = [(7 * i + j) % min(cfg.vocab_size, 250) + 1 for j in range(prompt_len)]
        sched.add(Sequence(i, f"r{i}", 0, prompt, SamplingParams(temperature=0, ignore_eos=True), max_tokens))

    tokens = [0]

    def on_update(touched, _logprobs) -> None:
        tokens[0] += len(touched)
        for seq in touched:
            if seq.is_finished:
                add(gen_len)

    for i in range(batch):
        add(max(1, gen_len * (i + 1) // batch))
    run_steps(sched, built.runner, gen_len, True, on_update)  # warm-up: reach the staggered steady state
    _sync(device)
    tokens[0] = 0
    start = time.perf_counter()
    done = run_steps(sched, built.runner, steps, True, on_update)
    _sync(device)
    elapsed = time.perf_counter() - start
    return elapsed / done, tokens[0] / elapsed


def time_prefill(built, prompt_len: int, device: str) -> float:
    """Seconds for one sequence's whole-prompt prefill of `prompt_len` tokens (llama.cpp's ppN, N = prompt_len),
    including sampling its first token."""
    plan = _scheduler(built, 1, prompt_len, 1).schedule()
    _sync(device)
    start = time.perf_counter()
    built.runner.execute(plan)
    _sync(device)
    return time.perf_counter() - start


def env_settings(specs: list[str]) -> list[dict[str, str]]:
    """Every combination of the `--env NAME=V1|V2` values, as {NAME: value} dicts ([{}] without any).

    Raises:
        SystemExit: a spec without '=' or without a value.
    """
    combos: list[dict[str, str]] = [{}]
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or not name or not values:
            raise SystemExit(f"--env {spec!r}: expected NAME=V1|V2")
        combos = [{**c, name: v} for c in combos for v in values.split("|")]
    return combos


def apply_env(env: dict[str, str]) -> None:
    """Set each variable of one `env_settings` combination ('-': unset it), before the engine that reads it is
    built."""
    for name, value in env.items():
        if value == "-":
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def step_weight_bytes(loaded) -> int:
    """Bytes of the weights one decode step reads, the embedding left out: fp16 weights at 2 bytes a weight,
    packed ones at the type their fused group (QKV, gate_up; else the weight alone) runs as
    (`voltserve.quant.fused_qtype`: Q8_0 where the group's packed types differ)."""
    from voltserve.quant import BLOCK_BYTES, fused_qtype

    quant = loaded.quantized
    total = 0
    for name, t in loaded.tensors.items():
        if name == "model.embed_tokens.weight":
            continue
        if name not in quant:
            total += t.numel() * 2
            continue
        group = next(((g, part) for g in FUSED_GROUPS for part in g if f".{part}." in name), None)
        siblings = [name.replace(group[1], other) for other in group[0]] if group else [name]
        rows, cols = quant[name].shape
        runs_as = fused_qtype({quant[n].qtype for n in siblings}) if all(n in quant for n in siblings) else None
        total += rows * cols // 32 * BLOCK_BYTES[runs_as] if runs_as else quant[name].data.nbytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description="decode tokens/s, batch sweep, graphs on/off")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--synthetic", choices=["llama3-8b", "smollm2-135m", "tiny"],
                        help="random weights made on the device")
    parser.add_argument("--synthetic-qtype", choices=["Q4_0", "Q4_1", "Q8_0", "Q4_K_M"],
                        help="the synthetic model's decoder linears as random GGUF blocks of this type (Q4_K_M: "
                             "the mix such a file runs as once converted, lm_head included)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", default="1,8,32,64")
    parser.add_argument("--graphs", default="on,off")
    parser.add_argument("--pdl", default="on", help="programmatic dependent launch (SM90+): on, off or on,off")
    parser.add_argument("--gemv-kernel", default="auto",
                        help="decode GEMV kernels (VOLTSERVE_GEMV_KERNEL): auto, scalar, mma or a list like scalar,mma")
    parser.add_argument("--mixed-graphs", default="on",
                        help="CUDA graphs for mixed prefill + decode steps (EngineConfig.mixed_graphs): on, off or "
                             "on,off")
    parser.add_argument("--async-scheduling", default="on",
                        help="plan each decode step before the previous one's tokens are known: on, off or on,off")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=V1|V2",
                        help="repeat every point per value of this environment variable (read when the engine is "
                             "built, e.g. VOLTSERVE_FUSE_NORM=auto|off); '-' leaves it unset; may be repeated")
    parser.add_argument("--temperature", default="0",
                        help="decode greedily (0) or sample at this temperature on the device, or a list like 0,1 "
                             "(OpenAI's default is 1)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's top_p of the sampled points")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=0,
                        help="also time a single-sequence prefill of this many tokens (pp512: --prefill 512)")
    parser.add_argument("--churn", type=int, default=0, metavar="GEN_LEN",
                        help="also time the serving steady state: each sequence generates GEN_LEN tokens, then a new "
                             "--prompt-len request takes its place (mixed prefill + decode steps; `time_churn`)")
    parser.add_argument("--max-model-len", default="0",
                        help="the engine's context capacity (EngineConfig.max_model_len; sizes the CUDA graphs' block "
                             "tables and attention split grid): 0 = just what the run needs, or a list like 0,131072 "
                             "(a server runs with the model's own, e.g. 131,072 for Llama-3.1)")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    temperatures = [float(t) for t in args.temperature.split(",")]
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "model": args.synthetic or args.model, "command": " ".join(sys.argv), "points": []}
    copy_bw = None
    if args.device == "cuda":
        # the ceiling bench_kernels.py uses, measured before anything is loaded: measured after the 8B runs
        # (the old place) the copy gave 3,750 GB/s where it gave 4,173 earlier on the same H200, which made the
        # 8B roofline fractions of earlier reports ~10% too high
        from tools.bench_kernels import copy_bandwidth

        copy_bw = copy_bandwidth(10) / 1e9
    loaded = None
    if args.synthetic:
        from tools.make_synthetic_checkpoint import synthetic_model

        loaded = synthetic_model(args.synthetic, device=args.device,
                                 dtype=torch.float16 if args.device == "cuda" else torch.float32,
                                 qtype=args.synthetic_qtype)
    runs = [(g, pdl, gk, mixed, env, int(cap)) for g in args.graphs.split(",") for pdl in args.pdl.split(",")
            for gk in args.gemv_kernel.split(",") for mixed in args.mixed_graphs.split(",")
            for env in env_settings(args.env) for cap in args.max_model_len.split(",")]
    modes = args.async_scheduling.split(",")
    for graphs, pdl, gemv_kernel, mixed, env, capacity in runs:
        apply_env(env)
        if args.device != "cuda" and (graphs == "on" or pdl == "off"):
            continue
        if graphs == "off" and mixed == "off" and "on" in args.mixed_graphs.split(","):
            continue  # the same run as mixed "on"
        os.environ["VOLTSERVE_GEMV_KERNEL"] = gemv_kernel
        decode_len = max(args.steps, args.churn)
        needed = max(args.prompt_len + decode_len + 16, args.prefill + 16)
        config = EngineConfig(model=args.model, device=args.device, max_num_seqs=max(batches),
                              max_model_len=max(needed, capacity),
                              enforce_eager=graphs == "off", pdl=pdl == "on", mixed_graphs=mixed == "on",
                              max_num_batched_tokens=max(2048, args.prefill),
                              # the pool holds every sequence of the run and one of the full capacity (build_runner)
                              num_kv_blocks=max(max(batches) * -(-(max(args.prompt_len + decode_len, args.prefill) + 16)
                                                                 // 16), -(-capacity // 16)))
        built = build_runner(config, loaded)
        run = {"graphs": graphs, "pdl": pdl, "gemv": gemv_kernel, **env}
        if capacity:
            run["max_model_len"] = config.max_model_len

        def emit(**fields) -> None:
            point = {**run, **fields}
            results["points"].append(point)
            print(json.dumps(point), flush=True)

        for batch in batches:
            for mode in modes:
                for temp in temperatures:
                    times = [time_decode(built, batch, args.prompt_len, args.steps, args.device, mode == "on", temp,
                                         args.top_p) for _ in range(args.repeats)]
                    step_s = statistics.median(times)
                    sampled = {"temperature": temp, "top_p": args.top_p} if temp else {}
                    emit(**{"async": mode}, **sampled, batch=batch, step_ms=step_s * 1e3, tokens_per_s=batch / step_s)
            if args.churn:
                runs_ = [time_churn(built, batch, args.prompt_len, args.churn, args.steps, args.device)
                         for _ in range(args.repeats)]
                step_s, tok_s = statistics.median(r[0] for r in runs_), statistics.median(r[1] for r in runs_)
                emit(mixed_graphs=mixed, batch=batch, churn_gen_len=args.churn, prompt_len=args.prompt_len,
                     step_ms=step_s * 1e3, tokens_per_s=tok_s)
        if args.prefill:
            time_prefill(built, args.prefill, args.device)  # warm-up: kernels load, allocator grows
            pre_s = statistics.median(time_prefill(built, args.prefill, args.device) for _ in range(args.repeats))
            emit(prefill_tokens=args.prefill, prefill_ms=pre_s * 1e3, prefill_tokens_per_s=args.prefill / pre_s)
        del built
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.device == "cuda":
        results["copy_bandwidth_gbs"] = copy_bw
        if loaded is not None:
            cfg = loaded.config
            weight_bytes = step_weight_bytes(loaded)
            kv_bytes = cfg.num_layers * 2 * (args.prompt_len + args.steps // 2) * cfg.num_kv_heads * cfg.head_dim * 2
            roof_s = (weight_bytes + kv_bytes) / (copy_bw * 1e9)
            results["batch1_roofline_ms"] = roof_s * 1e3
            for p in results["points"]:
                if p.get("batch") == 1:
                    p["roofline_fraction"] = roof_s * 1e3 / p["step_ms"]
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
