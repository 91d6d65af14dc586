"""Why a step that starts a new request costs more than a decode-only one: the kernel timeline of the serving
steady state (`bench_decode.time_churn`: every sequence generates --gen tokens, then a new --prompt-len request
takes its place, so about batch / gen requests start in each step, as under HTTP clients that drift apart),
split into mixed steps (an `attn_prefill` launch: prompt tokens next to the others' decodes) and decode-only
ones, with each kernel name's share of a step (end-to-end, as `profile_step.py` counts it) in both kinds.

    python tools/profile_mixed_step.py --batch 64 --prompt-len 32 --gen 256
    python tools/profile_mixed_step.py --synthetic smollm2-135m --qtype Q4_1 --env "VOLTSERVE_GEMM_TC_SPLIT=rows|fixed"
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from tools.bench_decode import apply_env, env_settings, time_churn  # noqa: E402
from tools.profile_step import profiled_kernels, split_steps  # noqa: E402

Kernel = tuple[str, float, float]  # name, start_us, duration_us


def _shares(step: list[Kernel]) -> tuple[collections.Counter, collections.Counter]:
    """(us, launches) per kernel name in one step; a kernel's share is the time from the previous kernel's end to
    its own (the first kernel: its duration), so the shares add up to the step's span."""
    us, launches = collections.Counter(), collections.Counter()
    prev_end = None
    for name, start, dur in step:
        end = start + dur
        us[name] += dur if prev_end is None else end - prev_end
        launches[name] += 1
        prev_end = end
    return us, launches


def mixed_vs_decode(steps: list[list[Kernel]], marker: str = "attn_prefill") -> dict:
    """Per step kind ("mixed": the step launches a kernel whose name starts with `marker`; "decode": the others):
    steps, the median span (us), and per kernel name the mean share (us a step) and the median launches a step.
    Kinds without steps are left out."""
    out = {}
    for kind in ("mixed", "decode"):
        group = [s for s in steps if any(k[0].startswith(marker) for k in s) == (kind == "mixed")]
        if not group:
            continue
        per = [_shares(s) for s in group]
        names = sorted({n for us, _ in per for n in us})
        out[kind] = {
            "steps": len(group),
            "span_us": statistics.median(s[-1][1] + s[-1][2] - s[0][1] for s in group),
            "kernels": {n: {"us_per_step": sum(us[n] for us, _ in per) / len(group),
                            "launches": statistics.median(c[n] for _, c in per)} for n in names}}
    return out


def _print(table: dict, top: int) -> None:
    for kind, t in table.items():
        print(f"{kind}: {t['steps']} steps, span median {t['span_us']:.1f} us")
    if len(table) < 2:
        return
    m, d = table["mixed"]["kernels"], table["decode"]["kernels"]
    zero = {"us_per_step": 0.0, "launches": 0}
    names = sorted(set(m) | set(d), key=lambda n: d.get(n, zero)["us_per_step"] - m.get(n, zero)["us_per_step"])
    print(f"{'kernel':<44} {'mixed us/step':>13} {'n':>4} {'decode us/step':>14} {'n':>4}")
    for n in names[:top]:
        a, b = m.get(n, zero), d.get(n, zero)
        print(f"{n[:44]:<44} {a['us_per_step']:13.1f} {a['launches']:4.0f} {b['us_per_step']:14.1f} {b['launches']:4.0f}")


def _profile(args, env: dict[str, str], loaded) -> dict:
    """One engine built with the backend knobs `env`: the churn timed, then profiled (`mixed_vs_decode`)."""
    from actors.build import build_runner
    from voltserve.config import EngineConfig

    apply_env(env)
    need = args.prompt_len + args.gen + 16
    config = EngineConfig(model=args.model, device="cuda", max_num_seqs=args.batch,
                          max_model_len=max(need, args.max_model_len),
                          num_kv_blocks=2 * args.batch * -(-need // 16) + -(-args.max_model_len // 16))
    built = build_runner(config, loaded)
    try:
        step_s, tok_s = time_churn(built, args.batch, args.prompt_len, args.gen, args.steps, "cuda")
        kernels = profiled_kernels(lambda: time_churn(built, args.batch, args.prompt_len, args.gen, args.steps,
                                                      "cuda"))
    finally:
        del built
        torch.cuda.empty_cache()
    table = mixed_vs_decode(split_steps(kernels, "embedding")[1:-1])  # whole steps only
    return {**env, "churn_step_ms": step_s * 1e3, "churn_tokens_per_s": tok_s, **table}


def main() -> None:
    parser = argparse.ArgumentParser(description="kernel timeline of mixed vs decode-only steps (serving churn)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--synthetic", choices=["llama3-8b", "smollm2-135m", "tiny"])
    parser.add_argument("--qtype", choices=["Q4_0", "Q4_1", "Q8_0"], help="the synthetic model's quant type")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen", type=int, default=256, help="tokens each sequence generates before it is replaced")
    parser.add_argument("--steps", type=int, default=128, help="steps timed after --gen warm-up ones (the profile covers both)")
    parser.add_argument("--max-model-len", type=int, default=8192, help="the engine's capacity (a server's own)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=V1|V2",
                        help="once per value of this backend knob (as bench_decode.py --env)")
    parser.add_argument("--top", type=int, default=12, help="kernel names printed, largest excess first")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    loaded = None
    if args.synthetic:
        from tools.make_synthetic_checkpoint import synthetic_model

        loaded = synthetic_model(args.synthetic, device="cuda", dtype=torch.float16, qtype=args.qtype)
    runs = []
    for env in env_settings(args.env):
        run = _profile(args, env, loaded)
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if k not in ("mixed", "decode")}))
        _print({k: run[k] for k in ("mixed", "decode") if k in run}, args.top)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "model": args.synthetic or args.model,
                                        "command": " ".join(sys.argv), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
