"""Where a decode step's time goes: the kernel timeline of graph-replayed decode steps (CUPTI through
torch.profiler), per kernel of a decoder layer, against what its weight bytes would take at the copy bandwidth.

Each kernel's *share* is end[i] - end[i - 1]: the time from the previous kernel's end to its own, so the shares
of a step add up to the step (kernels that start early under programmatic dependent launch overlap the one
before; their own duration then includes waiting). `gap` is start[i] - end[i - 1] (negative: early start).
Per position of a layer the table gives the median over layers and steps; `ideal_us` is that position's weight
bytes over the copy bandwidth (GEMVs only).

    python tools/profile_step.py --synthetic llama3-8b --batch 1 --prompt-len 512
    python tools/profile_step.py --synthetic llama3-8b --env "VOLTSERVE_GEMV_PDL=auto|on" --out prof.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from tools.bench_decode import apply_env, env_settings, time_decode  # noqa: E402


def kernel_events(trace_path: str) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of every GPU kernel in a chrome trace written by torch.profiler, by start."""
    events = json.loads(pathlib.Path(trace_path).read_text())["traceEvents"]
    kernels = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
               if e.get("cat") == "kernel" and "ts" in e and "dur" in e]
    return sorted(kernels, key=lambda k: k[1])


def profiled_kernels(fn) -> list[tuple[str, float, float]]:
    """Run `fn()` under torch.profiler (CUDA activity) and return its GPU kernels as `kernel_events` does."""
    trace = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
        prof.export_chrome_trace(trace)
        return kernel_events(trace)
    finally:
        os.unlink(trace)


def split_steps(kernels: list[tuple[str, float, float]], first_kernel: str) -> list[list[tuple[str, float, float]]]:
    """The kernels cut into steps at each launch whose name starts with `first_kernel` (the step's embedding);
    kernels before the first such launch are dropped."""
    steps: list[list] = []
    for k in kernels:
        if k[0].startswith(first_kernel):
            steps.append([])
        if steps:
            steps[-1].append(k)
    return steps


def layer_period(names: list[str], num_layers: int) -> int:
    """Kernels per decoder layer: the largest P with `num_layers` repeats of the same P kernel names at the start
    of `names` (the step after its embedding; the tail after the layers may be longer than one layer). The
    largest: a layer may repeat a kernel name within itself (two launches of one GEMV), and a multiple of the
    true period would need a tail as long as all the layers.

    Raises:
        ValueError: no such period (the step is not `num_layers` equal layers and a tail).
    """
    for period in range(len(names) // num_layers, 0, -1):
        if all(names[i] == names[i % period] for i in range(period * num_layers)):
            return period
    raise ValueError(f"no layer pattern repeating {num_layers} times in {len(names)} kernels")


def layer_table(steps: list[list[tuple[str, float, float]]], num_layers: int,
                gemv_bytes: list[int], copy_gbs: float) -> dict:
    """Per-position medians of one decoder layer's kernels over all layers and full steps, plus the step's
    head (before layer 0) and tail (after the last layer). Only steps with the most common kernel count are
    kept (the prefill step and a cut last step differ), and never the last one when others remain."""
    counts = [len(s) for s in steps[:-1]] or [len(steps[0])]
    common = max(set(counts), key=counts.count)
    full = [s for s in steps[:-1] if len(s) == common] or steps
    n = len(full[0])
    head = 1  # the embedding
    per_layer = layer_period([k[0] for k in full[0][head:]], num_layers)
    tail = n - head - per_layer * num_layers
    shares: dict[int, list[float]] = {}
    durs: dict[int, list[float]] = {}
    gaps: dict[int, list[float]] = {}
    names: dict[int, str] = {}
    head_tail = {"head": [], "tail": []}
    spans = []
    for s in full:
        ends = [k[1] + k[2] for k in s]
        spans.append(ends[-1] - s[0][1])
        for i, (name, start, dur) in enumerate(s):
            share = ends[i] - ends[i - 1] if i else dur
            gap = start - ends[i - 1] if i else 0.0
            if i < head:
                head_tail["head"].append(share)
            elif i >= n - tail:
                head_tail["tail"].append(share)
            else:
                pos = (i - head) % per_layer
                names[pos] = name
                shares.setdefault(pos, []).append(share)
                durs.setdefault(pos, []).append(dur)
                gaps.setdefault(pos, []).append(gap)
    rows = []
    # one GEMV launch per weight (up to 8 x rows); with more, a weight's launches are not told apart: no ideal
    one_each = sum(names[pos].startswith("gemv") for pos in range(per_layer)) == len(gemv_bytes)
    weights = iter(gemv_bytes if one_each else [])
    for pos in range(per_layer):
        name = names[pos]
        ideal = None
        if name.startswith("gemv"):
            nbytes = next(weights, None)
            ideal = nbytes / (copy_gbs * 1e3) if nbytes is not None and copy_gbs else None
        share = statistics.median(shares[pos])
        rows.append({"pos": pos, "kernel": name, "share_us": share, "dur_us": statistics.median(durs[pos]),
                     "gap_us": statistics.median(gaps[pos]),
                     "ideal_us": ideal, "fraction": ideal / share if ideal else None})
    tail_names = [k[0] for k in full[0][n - tail:]]
    step0 = full[len(full) // 2][0][1]
    return {"kernels_per_step": n, "kernels_per_layer": per_layer, "steps": len(full),
            "one_step": [(name, round(start - step0, 2), round(dur, 2)) for name, start, dur in full[len(full) // 2]],
            "step_span_us": statistics.median(spans), "layer_us": sum(r["share_us"] for r in rows),
            "head_us": sum(head_tail["head"]) / len(full), "tail_us": sum(head_tail["tail"]) / len(full),
            "tail_kernels": tail_names, "layer": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description="kernel timeline of graph-replayed decode steps")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--synthetic", choices=["llama3-8b", "smollm2-135m", "tiny"])
    parser.add_argument("--synthetic-qtype", choices=["Q4_0", "Q4_1", "Q8_0", "Q4_K_M"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12, help="decode steps profiled (after as many warm-up)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=V1|V2",
                        help="profile once per value of this backend knob (as bench_decode.py --env)")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    from actors.build import build_runner
    from tools.bench_kernels import copy_bandwidth
    from voltserve.config import EngineConfig

    copy_gbs = copy_bandwidth(10) / 1e9
    loaded = None
    if args.synthetic:
        from tools.make_synthetic_checkpoint import synthetic_model

        loaded = synthetic_model(args.synthetic, device="cuda", dtype=torch.float16, qtype=args.synthetic_qtype)
    report = {"device": torch.cuda.get_device_name(), "model": args.synthetic or args.model,
              "command": " ".join(sys.argv), "copy_bandwidth_gbs": copy_gbs, "runs": []}
    print(f"copy {copy_gbs:.0f} GB/s (read + write)")
    for env in env_settings(args.env):
        apply_env(env)
        steps = args.steps
        config = EngineConfig(model=args.model, device="cuda", max_num_seqs=args.batch,
                              max_model_len=args.prompt_len + 3 * steps + 32,
                              num_kv_blocks=args.batch * (-(-(args.prompt_len + 3 * steps + 32) // 16)))
        built = build_runner(config, loaded)
        layer0 = built.runner.model.layers[0]
        gemv_bytes = [int(w.data.nbytes) for w in (layer0.qkv, layer0.o_proj, layer0.gate_up, layer0.down)]
        step_ms = time_decode(built, args.batch, args.prompt_len, steps, "cuda") * 1e3  # warm-up, and timed
        kernels = profiled_kernels(lambda: time_decode(built, args.batch, args.prompt_len, steps, "cuda"))
        table = layer_table(split_steps(kernels, "embedding"), built.model_config.num_layers, gemv_bytes, copy_gbs)
        run = {**env, "batch": args.batch, "step_ms_unprofiled": step_ms, **table}
        report["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if k not in ("layer", "one_step", "tail_kernels")}))
        print(f"{'pos':>3} {'kernel':<22} {'share':>8} {'dur':>8} {'gap':>7} {'ideal':>7} {'frac':>5}")
        for r in table["layer"]:
            ideal = f"{r['ideal_us']:7.2f}" if r["ideal_us"] else "      -"
            frac = f"{r['fraction']:5.2f}" if r["fraction"] else "    -"
            print(f"{r['pos']:>3} {r['kernel'][:22]:<22} {r['share_us']:8.2f} {r['dur_us']:8.2f} "
                  f"{r['gap_us']:7.2f} {ideal} {frac}")
        del built
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
