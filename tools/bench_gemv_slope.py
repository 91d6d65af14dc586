"""Decode GEMV time against weight size: the rate a kernel streams at, and what a launch costs beyond its bytes.

Times decode GEMVs of one weight format and width k at several output-feature counts, as `bench_kernels.py`'s
`decode_gemv_*` rows do (a CUDA graph of launches over copies of the weight filling >= 4x the L2, so every launch
reads its weight from HBM), and fits time = bytes / rate + fixed by least squares over the counts:

  - `streaming_fraction_of_copy`: the rate over the device-to-device copy bandwidth measured in the same process
    (read + write counted, as `bench_kernels.py` counts it; a read-only kernel reaches ~0.95 of it on an H100);
  - `fixed_us`: the time a launch costs that does not grow with its weight (launch, prologue, the last wave).

A kernel whose rate is near the copy's but whose row misses its target is bound by its fixed cost (fewer or
overlapped launches help); one with a low rate is bound inside its loop. `--grid` (VOLTSERVE_GEMV_S8_GRID:
gemv_s8 / gemv_s8w) and `--x` (VOLTSERVE_GEMV_S8_X) run each choice on the same weights. Output counts that are
multiples of the grid's warps (132 SMs x 32 warps = 4,224 on an H100 / H200 for Q4 gemv_s8w) show the last
wave's share: 12,672 is 3 whole waves, 14,336 3.39.

    python tools/bench_gemv_slope.py --fmt Q4_1 --k 4096 --out-features 4224,12672,14336,16896,28672 \\
        --grid persistent,full --out slope.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tools.*, tests.kernels.kutils


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y = slope * x + intercept over (x, y) points.

    Raises:
        ValueError: fewer than two distinct x values.
    """
    n = len(points)
    mean_x = sum(x for x, _ in points) / max(n, 1)
    mean_y = sum(y for _, y in points) / max(n, 1)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if n < 2 or sxx == 0:
        raise ValueError("a line needs points at two or more distinct x values")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return slope, mean_y - slope * mean_x


def slope_row(label: str, points: list[tuple[float, float]], copy_bytes_s: float) -> dict:
    """The fit of (weight bytes, seconds a launch) points as a JSON row: the streaming rate as a fraction of the
    copy bandwidth `copy_bytes_s` (bytes / s) and the fixed cost a launch in us."""
    slope, intercept = fit_line(points)
    return {"variant": label, "streaming_fraction_of_copy": round(1 / slope / copy_bytes_s, 3) if slope > 0 else None,
            "fixed_us": round(intercept * 1e6, 2), "points": len(points)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", choices=["F16", "Q4_0", "Q4_1", "Q8_0"], default="Q4_1")
    ap.add_argument("--k", type=int, default=4096, help="in features")
    ap.add_argument("--out-features", default=[4224, 12672, 14336, 16896, 28672],
                    type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--rows", type=int, default=1, help="x rows (decode batch)")
    ap.add_argument("--grid", default="persistent", help="gemv_s8 / gemv_s8w grids to run: persistent, full, or both")
    ap.add_argument("--x", default="auto", help="gemv_s8 x quantization to run: auto, block, launch, or a list")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()

    from tools.bench_kernels import _rotated_weights, _timed, copy_bandwidth
    from voltserve.backends.cuda.backend import CudaBackend

    be = CudaBackend(0)
    copy_bw = copy_bandwidth(args.repeats)
    variants = [(g, x) for g in args.grid.split(",") for x in args.x.split(",")]
    gen = torch.Generator().manual_seed(1)
    points: dict[tuple[str, str], list[tuple[float, float]]] = {v: [] for v in variants}
    result = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "fmt": args.fmt, "k": args.k,
              "rows": args.rows, "copy_GBps": round(copy_bw / 1e9, 1), "points": [], "fits": []}
    for n in args.out_features:
        lin, lins, wbytes, copies = _rotated_weights(be, args.fmt, n, args.k, gen)
        x = torch.randn(args.rows, args.k, device="cuda", dtype=torch.float16)
        for grid, xmode in variants:
            be.gemv_s8_grid, be.gemv_s8_x = grid, xmode
            t, ran = _timed(be, [(lambda li=li: be.linear(x, li)) for li in lins], args.repeats, copies,
                            lambda kernels: True)
            points[(grid, xmode)].append((wbytes, t))
            row = {"out_features": n, "grid": grid, "x": xmode, "weight_MB": round(wbytes / 1e6, 2),
                   "median_us": round(t * 1e6, 2), "fraction_of_copy_bw": round(wbytes / t / copy_bw, 3),
                   "kernels": sorted(ran)}
            result["points"].append(row)
            print(json.dumps(row), file=sys.stderr)
        del lins, lin
        torch.cuda.empty_cache()
    for (grid, xmode), pts in points.items():
        row = slope_row(f"grid={grid} x={xmode}", pts, copy_bw)
        result["fits"].append(row)
        print(json.dumps(row), file=sys.stderr)
    print(json.dumps(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
