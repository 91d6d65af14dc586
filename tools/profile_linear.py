"""Launch one decode linear of the CUDA backend repeatedly, for a kernel profiler to attach to.

Nsight Compute reads one launch's counters (stall reasons, bytes in flight, occupancy); this script gives it a
realistic launch without the engine around it: random weights of the chosen format and shape (GGUF blocks from
tests/kernels/kutils.make_quant; repacked where VOLTSERVE_QUANT_REPACK says), x of `--rows` rows, optionally
with the fused RMSNorm / SwiGLU / residual, launched `--launches` times.

    ncu --clock-control none --kernel-name regex:gemv --launch-skip 5 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python3 tools/profile_linear.py --fmt Q4_1 --out-features 14336 --in-features 4096 --rows 1
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a checkout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fmt", choices=["F16", "Q4_0", "Q4_1", "Q8_0"], default="Q4_1")
    parser.add_argument("--out-features", type=int, default=14336)
    parser.add_argument("--in-features", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=1, help="x rows (decode batch)")
    parser.add_argument("--norm", action="store_true", help="fuse the RMSNorm of x")
    parser.add_argument("--silu", action="store_true", help="the weight is [gate; up]: fuse SwiGLU (implies --norm)")
    parser.add_argument("--residual", action="store_true")
    parser.add_argument("--launches", type=int, default=10)
    args = parser.parse_args()

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "kernels"))
    from kutils import make_quant

    from voltserve.backends.cuda.backend import CudaBackend

    be = CudaBackend(0)
    gen = torch.Generator().manual_seed(0)
    n, k = args.out_features, args.in_features
    if args.fmt == "F16":
        w = be.prepare_linear(torch.randn(n, k, generator=gen) * 0.02)
    else:
        quant, deq = make_quant(args.fmt, n, k, gen)
        w = be.prepare_linear(deq, quant, swiglu=args.silu)
    x = torch.randn(args.rows, k, device="cuda", dtype=torch.float16)
    norm = be.prepare_norm(torch.rand(k, generator=gen) + 0.5)
    res = torch.randn(args.rows, n, device="cuda", dtype=torch.float16) if args.residual else None
    for _ in range(args.launches):
        if args.norm or args.silu:
            y = be.norm_linear(x, norm, 1e-5, w, silu=args.silu)
            if res is not None:  # norm_linear takes no residual: the add runs as its own op
                y = y + res[:, :y.shape[1]]
        else:
            be.linear(x, w, residual=res)
    torch.cuda.synchronize()
    print(f"{args.launches} launches of {args.fmt} {n}x{k} m={args.rows} ({getattr(w, 'layout', 'gguf')} rows)")


if __name__ == "__main__":
    main()
