"""Kernel benchmarks on the GPU: achieved GB/s (or TFLOP/s) per kernel vs the measured device-to-device copy
bandwidth, median of repeats, plus bytes / FLOPs and the projected V100 time (900 GB/s, 125 TFLOP/s fp16 TC).

Usage:
    PYTHONPATH=src:. python tools/bench_kernels.py [--out bench.json] [--repeats 20] [--only REGEX]
        [--gemv-kernel scalar,auto]   # decode_* rows once per GEMV kernel choice, tagged @choice
        [--gemv-tma on,off]           # ... and once per gemv_tma choice (VOLTSERVE_GEMV_TMA), tagged @tma=choice
        [--gemv-tma-s8 on,off]        # ... and once per gemv_tma_s8 choice (VOLTSERVE_GEMV_TMA_S8), @tma_s8=choice
        [--gemv-tma-ring 16x4,8x4] [--gemv-tma-blocks 1,2]  # gemv_tma's ring and blocks per SM, @ring= / @blocks=
                                      # (then, where gemv_tma is on, only rows it took: the others print "skipped")
        [--gemv-s8 auto,on]           # ... and once per int8 GEMV choice (VOLTSERVE_GEMV_S8), @s8=choice
        [--gemv-s8-tiles auto,32]     # ... and once per gemv_s8 tile rows (VOLTSERVE_GEMV_S8_TILES), @tiles=choice
Shapes are Llama-3-8B-like (hidden 4096, 32 heads / 8 KV heads, head_dim 128, FFN 14336) unless named.

Two kinds of rows:
  - eager rows (`gemv_F16_m1`, ...): one Python call per timed run on one weight buffer; for short kernels the
    ~20 us of host launch cost and the 60 MB L2 (a Q4 14336x4096 weight is 33 MB) both show in the figure.
  - `gemm_{fmt}_{n}x{k}_m{m}@{path}` rows (eager): Llama-3-8B's prefill GEMMs at 64-2,048 x rows, quantized
    weights through gemm_tc (@tc) and dequant_f16 + cuBLAS (@dequant), fp16 weights through cuBLAS (@f16);
    `dequant_f16_*` rows: the dequantization alone (CUDA-graph timed).
  - `decode_fused_*` / `decode_unfused_*` rows: the decode fusions (norm + GEMV, GEMV + SwiGLU, GEMV + residual)
    and the op sequences they replace, measured the same way.
  - `decode_*` rows (`decode_gemv_Q4_0_14336x4096_m1`: out x in): how decode sees the GEMV, a CUDA graph of
    launches replayed over enough distinct copies of the weight (>= 4x the L2) that every launch streams its
    weight from HBM; time per launch = graph time / copies. Bytes = weight + x + y.
  - `decode_boundary_*` rows: the same 235 MB of fp16 rows in one launch and in two (what a launch boundary
    costs a decode GEMV; the two-launch row's time is per pair).
  - `decode_attn_*` rows: paged decode attention, CUDA-graph timed over rotated KV caches the same way;
    `decode_rope_attn_*` rows: the same with the rotary and KV write fused in (`rope_attention`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import re
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests.kernels.kutils from any cwd

V100_BYTES_S = 900e9
V100_FLOP_S = 125e12


def _picked(only: str, name: str) -> bool:
    """Whether --only (a regular expression, searched in the row name) picks row `name`."""
    return re.search(only, name) is not None


def _time(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` timed runs (CUDA events), after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB buffers)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 2 / t


def _graph_time(be, fns, repeats: int) -> float:
    """Median seconds of one replay of a CUDA graph that calls each of `fns` once (captured on torch's stream)."""
    for fn in fns:  # compile / load kernels, warm the allocator
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.refresh_stream()
        for fn in fns:
            fn()
    be.refresh_stream()
    t = _time(g.replay, repeats)
    del g
    return t


def _kernels_of(be, fn) -> frozenset[str]:
    """The names of the kernels one call of `fn` launches (the launcher's own choice, e.g. whether gemv_tma took
    the weight under the ring / blocks being timed)."""
    from tests.kernels.kutils import launched_kernels

    with launched_kernels(be) as names:
        fn()
    return frozenset(names)


def _timed(be, fns, repeats: int, copies: int, keep):
    """(seconds per launch of `_graph_time(fns)` / copies, the kernels one call launches); with `keep` (a predicate
    on those kernels) that rejects them, (None, kernels) without timing."""
    if keep is None:
        return _graph_time(be, fns, repeats) / copies, frozenset()
    ran = _kernels_of(be, fns[0])
    return (_graph_time(be, fns, repeats) / copies if keep(ran) else None), ran


def _rotated_weights(be, fmt: str, out_f: int, in_f: int, gen: torch.Generator, swiglu: bool = False,
                     norm: torch.Tensor | None = None):
    """(weight, copies of it filling >= 256 MB (>= 4x the L2), weight bytes, number of copies): replaying one
    launch per copy streams every launch's weight from HBM. `norm` (fp16 only): an RMSNorm weight to fold in
    where the backend folds it (`linear.folds_norm`)."""
    from dataclasses import replace

    from tests.kernels.kutils import make_quant

    if fmt == "F16":
        lin = be.prepare_linear(torch.randn(out_f, in_f, generator=gen) * 0.02, norm=norm)
    else:
        quant, deq = make_quant(fmt, out_f, in_f, gen)
        lin = be.prepare_linear(deq, quant, swiglu=swiglu)
    wbytes = lin.data.numel() * lin.data.element_size()
    copies = max(4, math.ceil(256e6 / wbytes))
    return lin, [lin] + [replace(lin, data=lin.data.clone()) for _ in range(copies - 1)], wbytes, copies


def _decode_gemv_cases(be, repeats: int, only: str | None, keep=None):
    """GEMV at the Llama-3-8B decode shapes (out x in), m = 1, 2, 4, 8 (quant also 16, 32), weights rotated so
    they come from HBM; yields (name, seconds or None where `keep` rejects the kernels, bytes, kernels)
    (`_timed`)."""
    gen = torch.Generator().manual_seed(1)
    for fmt in ("F16", "Q4_0", "Q4_1", "Q8_0"):
        for out_f, in_f in ((4096, 4096), (14336, 4096), (4096, 14336)):
            rows = (1, 2, 4, 8) + (() if fmt == "F16" else (16, 32))  # quant: gemv_s8 launches up to 32 rows
            names = [f"decode_gemv_{fmt}_{out_f}x{in_f}_m{m}" for m in rows]
            if only and not any(_picked(only, n) for n in names):
                continue
            lin, lins, wbytes, copies = _rotated_weights(be, fmt, out_f, in_f, gen)
            for m, name in zip(rows, names):
                if only and not _picked(only, name):
                    continue
                xm = torch.randn(m, in_f, device="cuda", dtype=torch.float16)
                t, ran = _timed(be, [(lambda li=li: be.linear(xm, li)) for li in lins], repeats, copies, keep)
                yield name, t, wbytes + m * (in_f + out_f) * 2, ran
            del lins, lin
            torch.cuda.empty_cache()


def _decode_fused_cases(be, repeats: int, only: str | None, keep=None):
    """The decode fusions at the Llama-3-8B shapes (m = 1), fused and as the unfused op sequence, weights rotated
    as in `_decode_gemv_cases`: `decode_fused_*` rows next to `decode_unfused_*` rows of the same work, and for
    fp16 qkv / gate_up `decode_folded_*` rows: the norm folded into the weight (gemv's NORM_POST build, what the
    engine runs for these weights under VOLTSERVE_NORM_FOLD=auto).

    qkv: RMSNorm + 6144x4096; gate_up: RMSNorm + 28672x4096 + SwiGLU; down: 4096x14336 + residual add. Yields as
    `_decode_gemv_cases`."""
    gen = torch.Generator().manual_seed(2)
    norm_cpu = torch.rand(4096, generator=gen) + 0.5
    norm_w = be.prepare_norm(norm_cpu)
    for fmt in ("F16", "Q4_1"):
        for part, (out_f, in_f) in (("qkv", (6144, 4096)), ("gate_up", (28672, 4096)), ("down", (4096, 14336))):
            names = [f"decode_{kind}_{part}_{fmt}_{out_f}x{in_f}_m1" for kind in ("fused", "unfused")]
            folded = f"decode_folded_{part}_{fmt}_{out_f}x{in_f}_m1"
            picked = [not only or _picked(only, n) for n in names]
            want_folded = fmt == "F16" and part != "down" and (not only or _picked(only, folded))
            if not any(picked) and not want_folded:
                continue
            x = torch.randn(1, in_f, device="cuda", dtype=torch.float16)
            res = torch.randn(1, out_f, device="cuda", dtype=torch.float16)
            if part == "down":
                fused = lambda li: be.linear(x, li, residual=res)  # noqa: E731
                unfused = lambda li: torch.add(be.linear(x, li), res)  # noqa: E731
            else:
                silu = part == "gate_up"
                fused = lambda li, silu=silu: be.norm_linear(x, norm_w, 1e-5, li, silu=silu)  # noqa: E731

                def unfused(li, silu=silu):
                    y = be.linear(be.rms_norm(x, norm_w, 1e-5)[0], li)
                    return be.silu_and_mul(y) if silu else y
            if any(picked):
                lin, lins, wbytes, copies = _rotated_weights(be, fmt, out_f, in_f, gen, swiglu=part == "gate_up")
                for name, fn, pick in zip(names, (fused, unfused), picked):
                    if pick:
                        t, ran = _timed(be, [(lambda li=li, fn=fn: fn(li)) for li in lins], repeats, copies, keep)
                        yield name, t, wbytes + (in_f + out_f) * 2, ran
                del lins, lin
                torch.cuda.empty_cache()
            if not want_folded:
                continue
            lin, lins, wbytes, copies = _rotated_weights(be, fmt, out_f, in_f, gen, norm=norm_cpu)
            t, ran = _timed(be, [(lambda li=li: fused(li)) for li in lins], repeats, copies, keep)
            yield folded, t, wbytes + (in_f + out_f) * 2, ran
            del lins, lin
            torch.cuda.empty_cache()


def _decode_boundary_cases(be, repeats: int, only: str | None, keep=None):
    """What a launch boundary costs a one-row decode GEMV: the same 235 MB of fp16 rows (Llama-3-8B's gate_up
    bytes, an RMSNorm folded in, as the engine stores qkv and gate_up) streamed by one launch over 28,672 rows and
    by two back-to-back launches over 14,336 rows each (docs/performance.md, session 14: the persistent-kernel
    question). Weights rotated as in `_decode_gemv_cases`; yields as it does, the two-launch row per pair."""
    one, two = "decode_boundary_F16_28672x4096_one_launch_m1", "decode_boundary_F16_28672x4096_two_launches_m1"
    if only and not (_picked(only, one) or _picked(only, two)):
        return  # nothing on the device for rows not asked for
    gen = torch.Generator().manual_seed(4)
    norm_cpu = torch.rand(4096, generator=gen) + 0.5
    norm_w = be.prepare_norm(norm_cpu)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    call = lambda li: be.norm_linear(x, norm_w, 1e-5, li)  # noqa: E731
    if not only or _picked(only, one):
        lin, lins, wbytes, copies = _rotated_weights(be, "F16", 28672, 4096, gen, norm=norm_cpu)
        t, ran = _timed(be, [(lambda li=li: call(li)) for li in lins], repeats, copies, keep)
        yield one, t, wbytes + (4096 + 28672) * 2, ran
        del lins, lin
        torch.cuda.empty_cache()
    if not only or _picked(only, two):
        lin, lins, wbytes, _ = _rotated_weights(be, "F16", 14336, 4096, gen, norm=norm_cpu)
        pairs = list(zip(lins[0::2], lins[1::2]))  # >= 4 copies: >= 2 pairs, every launch from HBM
        t, ran = _timed(be, [(lambda a=a, b=b: (call(a), call(b))) for a, b in pairs], repeats, len(pairs), keep)
        yield two, t, 2 * (wbytes + (4096 + 14336) * 2), ran
        del lins, lin, pairs
        torch.cuda.empty_cache()


def _decode_chain_cases(be, repeats: int, only: str | None, keep=None):
    """A Llama-3-8B decoder layer's one-row GEMVs after attention plus the next layer's qkv (o_proj + residual,
    gate_up with its norm folded in, SwiGLU, down + residual, qkv folded: 436 MB of fp16 rows) through
    `base.decoder_tail`: as one gemv_chain launch (`_chain_m1`, VOLTSERVE_GEMV_CHAIN=on) and as the engine's
    launches one by one under the backend's other settings (`_separate_m1`). Two weight sets alternate, so every
    call streams from HBM (one set is > 8x the L2); yields as `_decode_gemv_cases`, time per layer."""
    from voltserve.backends.base import decoder_tail

    rows = {"on": "decode_chain_8b_layer_chain_m1", "off": "decode_chain_8b_layer_separate_m1"}
    if only and not any(_picked(only, r) for r in rows.values()):
        return
    gen = torch.Generator().manual_seed(5)
    norms = [torch.rand(4096, generator=gen) + 0.5 for _ in range(2)]
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731
    sets = [(be.prepare_linear(rand(4096, 4096)), be.prepare_linear(rand(28672, 4096), swiglu=True, norm=norms[0]),
             be.prepare_linear(rand(4096, 14336)), be.prepare_linear(rand(6144, 4096), norm=norms[1]))
            for _ in range(2)]
    wbytes = sum(li.data.numel() * 2 for li in sets[0])
    post, then_norm = be.prepare_norm(norms[0]), be.prepare_norm(norms[1])
    o = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    h = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    fns = [(lambda w=w: decoder_tail(be, o, h, w[0], post, w[1], w[2], 1e-5, (then_norm, w[3]))) for w in sets]
    saved = be.gemv_chain
    for mode, name in rows.items():
        if only and not _picked(only, name):
            continue
        be.gemv_chain = mode
        ran = _kernels_of(be, fns[0])
        if mode != "off" and "gemv_chain" not in ran:
            yield name, None, 0, ran
            continue
        yield name, _graph_time(be, fns, repeats) / len(fns), wbytes + 5 * 4096 * 2, ran
    be.gemv_chain = saved
    del sets, fns
    torch.cuda.empty_cache()


def _decode_attention_cases(be, repeats: int, only: str | None):
    """Paged decode attention at Llama-3-8B shapes (32 query / 8 KV heads, head_dim 128, 16-token KV blocks) for
    (sequences x context) pairs, CUDA-graph timed like the `decode_*` GEMV rows; KV caches are rotated over >= 4
    copies of >= 256 MB in all so every launch streams its keys and values from HBM. Bytes = K + V + q + out.
    `decode_rope_attn_*` rows: the same through `rope_attention` (q and the new key rotated, the key written:
    attn_decode's fused rotary), bytes also counting the new K / V rows read and written."""
    from voltserve.backends.base import AttentionMetadata
    from voltserve.backends.cpu import rope_cos_sin

    nh, kvh, d = 32, 8, 128
    cases = [("attn", s, c) for s, c in ((16, 4096), (32, 4096), (1, 32768), (1, 512), (8, 512))]
    cases += [("rope_attn", s, c) for s, c in ((16, 4096), (1, 512), (8, 512))]
    for kind, num_seqs, ctx in cases:
        name = f"decode_{kind}_b{num_seqs}_ctx{ctx}"
        if only and not _picked(only, name):
            continue
        blocks = math.ceil(ctx / 16)
        kv_bytes = num_seqs * ctx * 2 * kvh * d * 2
        copies = max(4, math.ceil(256e6 / kv_bytes))  # >= 4: a one-launch graph would time the launch too
        caches = [torch.randn(2, num_seqs * blocks, 16, kvh, d, device="cuda", dtype=torch.float16)
                  for _ in range(copies)]
        tables = torch.randperm(num_seqs * blocks, device="cuda").to(torch.int32).view(num_seqs, blocks)
        slots = (tables[:, (ctx - 1) // 16].long() * 16 + (ctx - 1) % 16).contiguous()
        meta = AttentionMetadata(torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32),
                                 torch.full((num_seqs,), ctx, device="cuda", dtype=torch.int32), tables, slots, 1,
                                 ctx, [1] * num_seqs, [ctx] * num_seqs)
        if kind == "attn":
            q = torch.randn(num_seqs, nh, d, device="cuda", dtype=torch.float16)
            fns = [(lambda c=c: be.attention(q, c, meta, d ** -0.5)) for c in caches]
            extra = 2 * num_seqs * nh * d * 2
        else:
            qkv = torch.randn(num_seqs, (nh + 2 * kvh) * d, device="cuda", dtype=torch.float16)
            q, k, v = (qkv[:, a:b].view(num_seqs, -1, d) for a, b in ((0, nh * d), (nh * d, (nh + kvh) * d),
                                                                      ((nh + kvh) * d, (nh + 2 * kvh) * d)))
            positions = torch.full((num_seqs,), ctx - 1, device="cuda", dtype=torch.int64)
            cos_sin = rope_cos_sin(d, ctx, 5e5).cuda()
            fns = [(lambda c=c: be.rope_attention(q, k, v, positions, cos_sin, "neox", c, meta, d ** -0.5))
                   for c in caches]
            extra = 2 * num_seqs * nh * d * 2 + 4 * num_seqs * kvh * d * 2
        t = _graph_time(be, fns, repeats) / copies
        yield name, t, kv_bytes + extra, 4 * num_seqs * nh * ctx * d
        del caches
        torch.cuda.empty_cache()


def _cases(be):
    from voltserve.backends.base import AttentionMetadata
    from voltserve.backends.cpu import rope_cos_sin

    from tests.kernels.kutils import make_quant

    dev, h = "cuda", torch.float16
    gen = torch.Generator().manual_seed(0)
    T, H, NH, KVH, D, FF = 4096, 4096, 32, 8, 128, 14336
    x = torch.randn(T, H, device=dev, dtype=h)
    res = torch.randn(T, H, device=dev, dtype=h)
    w = torch.rand(H, device=dev)
    yield "rmsnorm_residual", lambda: be.rms_norm(x, w, 1e-6, res), 5 * T * H * 2, 0
    q = torch.randn(T, NH, D, device=dev, dtype=h)
    k = torch.randn(T, KVH, D, device=dev, dtype=h)
    cs = rope_cos_sin(D, 8192, 5e5).to(dev)
    pos = torch.arange(T, device=dev)
    kv = torch.zeros(2, T // 16 + 1, 16, KVH, D, device=dev, dtype=h)
    slots = torch.arange(T, device=dev)
    yield "rope_kv_write", lambda: be.rotary_write_kv(q, k, k, pos, cs, "neox", kv, slots), \
        2 * (NH + 2 * KVH) * T * D * 2 + T * D * 4, 0
    g = torch.randn(T, 2 * FF // 4, device=dev, dtype=h)
    yield "silu_mul", lambda: be.silu_and_mul(g), 3 * T * FF // 4 * 2, 0
    table = be.prepare_embedding(torch.randn(32000, H))
    ids = torch.randint(0, 32000, (T,), device=dev)
    yield "embedding_f16", lambda: be.embedding(ids, table), 2 * T * H * 2, 0
    qt, wt = make_quant("Q8_0", 32000, H, gen)
    qtable = be.prepare_embedding(wt, qt)
    yield "embedding_q8_0", lambda: be.embedding(ids, qtable), T * H * (34 / 32 + 2), 0
    for fmt in ("F16", "Q4_0", "Q4_1", "Q8_0"):
        if fmt == "F16":
            lin = be.prepare_linear(torch.randn(FF, H) * 0.02)
        else:
            quant, deq = make_quant(fmt, FF, H, gen)
            lin = be.prepare_linear(deq, quant)
        wbytes = lin.data.numel() * lin.data.element_size()
        for m in (1, 8):
            xm = torch.randn(m, H, device=dev, dtype=h)
            yield f"gemv_{fmt}_m{m}", (lambda xm=xm, lin=lin: be.linear(xm, lin)), wbytes + m * (H + FF) * 2, 0
        if fmt != "F16":
            xm = torch.randn(512, H, device=dev, dtype=h)
            yield f"gemm_tiled_{fmt}_m512", (lambda xm=xm, lin=lin: be.linear(xm, lin)), wbytes, 2 * 512 * FF * H

    def attn_case(num_seqs, ctx, q_len):
        blocks = math.ceil(ctx / 16)
        kvc = torch.randn(2, num_seqs * blocks, 16, KVH, D, device=dev, dtype=h)
        tables = torch.arange(num_seqs * blocks, device=dev, dtype=torch.int32).view(num_seqs, blocks)
        qsl = torch.arange(num_seqs + 1, device=dev, dtype=torch.int32) * q_len
        meta = AttentionMetadata(qsl, torch.full((num_seqs,), ctx, device=dev, dtype=torch.int32), tables,
                                 torch.zeros(0, device=dev, dtype=torch.int64), q_len, ctx, [q_len] * num_seqs,
                                 [ctx] * num_seqs)
        qq = torch.randn(num_seqs * q_len, NH, D, device=dev, dtype=h)
        return lambda: be.attention(qq, kvc, meta, D ** -0.5)

    yield "attn_prefill_q2048", attn_case(1, 2048, 2048), 2048 * (2 * KVH + 2 * NH) * D * 2, 2 * NH * 2048 * 2048 * D
    logits = torch.randn(256, 128256, device=dev)
    yield "argmax_logprob_256x128256", lambda: be.sample_greedy(logits), logits.numel() * 4, 0
    # sampling at temperature 1 (plain) and top-p 0.95 (bytes: one read of the logits; top-p passes over them 6
    # times), and speculative sampling's draft checks on the same rows, the kernel alone (row params already up,
    # one launch a graph replay): 1 and 5 rows (batch-1 decode, a verify of 4 drafts) of the default model's vocab,
    # 64 of it, 8 of Llama-3's
    for rows, vocab in ((1, 49152), (5, 49152), (64, 49152), (8, 128256)):
        lg = (torch.randn(rows, vocab, device=dev) * 3).to(h)
        for name, top_p, drafts in (("plain", 1.0, False), ("topp", 0.95, False), ("verify_topp", 0.95, True)):
            yield f"sample_{name}_{rows}x{vocab}", _lazy(_captured_sample, be, lg, top_p, drafts), lg.numel() * 2, 0


def _lazy(make, *args):
    """A function that calls make(*args) once, at its first call (after --only picked the row), and from then on
    calls what that returned."""
    made = []

    def run():
        if not made:
            made.append(make(*args))
        return made[0]()
    return run


def _captured_sample(be, logits: torch.Tensor, top_p: float, drafts: bool):
    """A CUDA graph of one sampler launch over `logits` (temperature 1, `top_p`; with `drafts` every row but each
    fifth checks a draft, as a verify of 4 does), the kernel the backend routes the rows to (sample_chunks as
    `DeviceSampling._sample_chunks` plans it; `VOLTSERVE_SAMPLE_CHUNKS=off`: sample_topk_topp; `plain`: top-p rows on
    sample_topk_topp); returns its replay."""
    from voltserve.backends.cuda.params import SampleRowParams
    from voltserve.transfer import to_device

    rows = logits.shape[0]
    params = (SampleRowParams * rows)(*[SampleRowParams(7, i, 1.0, top_p, 0.0, 0, 0, i % 5 if drafts and i % 5 < 4
                                                        else -1) for i in range(rows)])
    dev_rows = to_device(torch.frombuffer(bytearray(params), dtype=torch.uint8), be.device)
    checked = torch.empty(2, rows, dtype=torch.int64, device=be.device) if drafts else None
    if drafts:
        be.sample_verify(logits, params)  # compile, warm
    outputs = be.sample(logits, params)  # its output tensors are the graph's
    if drafts:
        outputs = (checked[0], *outputs[1:])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.refresh_stream()
        be._launch_sample(logits, dev_rows, outputs, checked, be._sample_chunks(rows, logits.shape[1], top_p < 1.0),
                          top_p < 1.0)
    be.refresh_stream()
    keep = (g, dev_rows, outputs, checked, logits)  # the graph reads and writes these by address
    return lambda: keep[0].replay()


# Llama-3-8B's prefill GEMMs (out x in: qkv, o_proj, gate_up, down) and the x rows they are timed at
PREFILL_GEMM_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
PREFILL_GEMM_ROWS = (64, 128, 256, 512, 2048)


def _prefill_gemm_cases(be, repeats: int, only: str | None):
    """`gemm_{fmt}_{n}x{k}_m{m}@{path}` rows (eager): quantized weights (random GGUF blocks, the engine's layout:
    repacked where `prepare_linear` repacks) through gemm_tc ("tc") and dequant_f16 + cuBLAS ("dequant"), and an
    fp16 weight of the same shape through cuBLAS ("f16": the ceiling the dequant path approaches); bytes = weight
    + x + y. `dequant_f16_{fmt}_{n}x{k}` rows: dequant_f16 alone on the whole weight (one chunk of rows), CUDA-graph
    timed over 4 launches; bytes = the quantized rows read + the fp16 rows written."""
    saved = be.quant_gemm
    try:
        yield from _prefill_gemm_rows(be, repeats, only)
    finally:
        be.quant_gemm = saved


def _prefill_gemm_rows(be, repeats: int, only: str | None):
    """`_prefill_gemm_cases`' rows; sets be.quant_gemm per row."""
    import numpy as np
    from loaders.model import QuantizedTensor
    from tools.make_synthetic_checkpoint import quant_blocks
    from voltserve.backends.cuda.dequant_gemm import dequantize_rows

    rng = np.random.default_rng(0)
    for n, k in PREFILL_GEMM_SHAPES:
        for fmt in ("F16", "Q4_1", "Q8_0"):
            paths = ("f16",) if fmt == "F16" else ("tc", "dequant")
            names = [f"gemm_{fmt}_{n}x{k}_m{m}@{path}" for m in PREFILL_GEMM_ROWS for path in paths]
            names += [f"dequant_f16_{fmt}_{n}x{k}"] if fmt != "F16" else []
            if only and not any(_picked(only, name) for name in names):
                continue
            if fmt == "F16":
                lin = be.prepare_linear(torch.randn(n, k, device="cuda") * 0.02)
            else:
                quant = QuantizedTensor(fmt, (n, k), quant_blocks(fmt, n, k, rng))
                lin = be.prepare_linear(torch.zeros(1, 1).expand(n, k), quant)
            wbytes = lin.data.numel() * lin.data.element_size()
            for m in PREFILL_GEMM_ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                for path in paths:
                    name = f"gemm_{fmt}_{n}x{k}_m{m}@{path}"
                    if only and not _picked(only, name):
                        continue
                    if path != "f16":
                        be.quant_gemm = path
                    yield name, _time(lambda: be.linear(x, lin), repeats), wbytes + 2 * m * (n + k), 2 * m * n * k
            name = f"dequant_f16_{fmt}_{n}x{k}"
            if fmt != "F16" and (not only or _picked(only, name)):
                out = torch.empty(n, k, dtype=torch.float16, device="cuda")
                t = _graph_time(be, [lambda: dequantize_rows(be, lin, 0, out)] * 4, repeats) / 4
                yield name, t, wbytes + 2 * n * k, 0
            lin = out = None  # freed before the next shape's weight
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--only", default=None, help="run only the rows whose name this regular expression matches "
                    "(re.search: a plain substring works)")
    ap.add_argument("--pdl", choices=["on", "off"], default="on", help="programmatic dependent launch (SM90+)")
    ap.add_argument("--gemv-kernel", default="auto",
                    help="decode GEMV kernels for the decode_* rows: auto, scalar, mma, or a list (rows get @choice)")
    ap.add_argument("--gemv-tma", default=None,
                    help="gemv_tma choice for the decode_* rows: off, folded, on, or a list (rows get @tma=choice)")
    ap.add_argument("--gemv-tma-s8", default=None,
                    help="gemv_tma_s8 choice for the decode_* rows: off, on, or a list (rows get @tma_s8=choice)")
    ap.add_argument("--gemv-tma-ring", default=None,
                    help="gemv_tma ring (stages x 2 KB spans) for the decode_* rows: 16x4, 8x4, ... or a list (rows "
                    "get @ring=choice)")
    ap.add_argument("--gemv-tma-blocks", default=None,
                    help="gemv_tma blocks per SM (VOLTSERVE_GEMV_TMA_BLOCKS) for the decode_* rows: 1, 2 or a list "
                    "(rows get @blocks=choice)")
    ap.add_argument("--gemv-s8", default=None,
                    help="int8 decode GEMV choice (VOLTSERVE_GEMV_S8) for the decode_* rows: auto, on, off, or a list "
                    "(rows get @s8=choice; on: gemv_s8w takes every one-row call on repacked rows)")
    ap.add_argument("--gemv-s8-tiles", default=None,
                    help="gemv_s8's weight rows per block (VOLTSERVE_GEMV_S8_TILES) for the decode_* rows: auto, 32, "
                    "16, or a list (rows get @tiles=choice)")
    ap.add_argument("--gemv-s8-preload", default=None,
                    help="gemv_s8's load groups issued before the PDL wait (VOLTSERVE_GEMV_S8_PRELOAD) for the "
                    "decode_* rows: auto, 1, 2, or a list (rows get @preload=choice)")
    ap.add_argument("--gemv-s8-xcopy", default=None,
                    help="gemv_s8's copy of x quantized per launch (VOLTSERVE_GEMV_S8_XCOPY) for the decode_* rows: "
                    "split, block, warp, or a list (rows get @xcopy=choice)")
    ap.add_argument("--gemv-s8-warps", default=None,
                    help="gemv_s8's warps a block where one 8-warp block fits an SM (VOLTSERVE_GEMV_S8_WARPS) for "
                    "the decode_* rows: auto, 8, or a list (rows get @warps=choice)")
    args = ap.parse_args()
    from voltserve.backends.cuda.backend import CudaBackend

    be = CudaBackend(0, pdl=args.pdl == "on")
    copy_bw = copy_bandwidth(args.repeats)
    rows = []

    def add(name, t, num_bytes, flops):
        gbs = num_bytes / t / 1e9
        row = {"kernel": name, "median_us": round(t * 1e6, 2), "bytes": int(num_bytes), "flops": int(flops),
               "achieved_GBps": round(gbs, 1), "fraction_of_copy_bw": round(gbs * 1e9 / copy_bw, 3),
               "achieved_TFLOPs": round(flops / t / 1e12, 2) if flops else None,
               "projected_v100_us": round(max(num_bytes / V100_BYTES_S, flops / V100_FLOP_S) * 1e6, 2)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    for name, fn, num_bytes, flops in _cases(be):
        if args.only and not _picked(args.only, name):
            continue
        add(name, _time(fn, args.repeats), num_bytes, flops)
    for name, t, num_bytes, flops in _prefill_gemm_cases(be, args.repeats, args.only):
        add(name, t, num_bytes, flops)
    for name, t, num_bytes, flops in _decode_attention_cases(be, args.repeats, args.only):
        add(name, t, num_bytes, flops)
    # (backend attribute, tag, choices, value -> attribute): every combination runs the decode_* rows once
    ring = lambda v: tuple(int(n) for n in v.split("x"))  # noqa: E731
    knobs = [("gemv_kernel", "@", args.gemv_kernel, str),
             ("gemv_tma", "@tma=", args.gemv_tma, str),
             ("gemv_tma_s8", "@tma_s8=", args.gemv_tma_s8, str),
             ("gemv_tma_ring", "@ring=", args.gemv_tma_ring, ring),
             ("gemv_tma_blocks", "@blocks=", args.gemv_tma_blocks, int),
             ("gemv_s8", "@s8=", args.gemv_s8, str),
             ("gemv_s8_tiles", "@tiles=", args.gemv_s8_tiles, str),
             ("gemv_s8_preload", "@preload=", args.gemv_s8_preload, str),
             ("gemv_s8_xcopy", "@xcopy=", args.gemv_s8_xcopy, str),
             ("gemv_s8_warps", "@warps=", args.gemv_s8_warps, str)]
    knobs = [(attr, prefix, values.split(",") if values else [getattr(be, attr)], conv)
             for attr, prefix, values, conv in knobs]
    defaults = {attr: getattr(be, attr) for attr, _, _, _ in knobs}
    # rows timed under several gemv_tma rings / block counts with gemv_tma asked for: only those where gemv_tma ran
    # (asked of the launcher per row, before timing: whether it takes a weight depends on the shape, the ring, x
    # and the partials); the others would time another kernel under the tag. Rows of `--gemv-tma off` or a forced
    # `--gemv-kernel` are all kept (baselines).
    ring_rows = any(len(values) > 1 for attr, _, values, _ in knobs if attr in ("gemv_tma_ring", "gemv_tma_blocks"))
    for combo in itertools.product(*(values for _, _, values, _ in knobs)):
        tag = ""
        for (attr, prefix, values, conv), value in zip(knobs, combo):
            setattr(be, attr, conv(value) if isinstance(value, str) else value)
            tag += f"{prefix}{value}" if len(values) > 1 else ""
        keep = None
        if ring_rows and be.gemv_tma != "off" and be.gemv_kernel == "auto":
            keep = lambda ran: "gemv_tma" in ran  # noqa: E731
        for cases in (_decode_gemv_cases, _decode_fused_cases, _decode_boundary_cases, _decode_chain_cases):
            for name, t, num_bytes, ran in cases(be, args.repeats, args.only, keep):
                if t is None:
                    print(f"skipped {name}{tag}: its kernel did not take it (ran {', '.join(sorted(ran))})",
                          file=sys.stderr)
                    continue
                add(name + tag, t, num_bytes, 0)
    for attr, value in defaults.items():
        setattr(be, attr, value)
    result = {"device": torch.cuda.get_device_name(), "arch": be.loader.arch, "pdl": be.pdl, "repeats": args.repeats,
              "copy_bandwidth_GBps": round(copy_bw / 1e9, 1), "kernels": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
