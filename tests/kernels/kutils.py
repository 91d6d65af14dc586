"""Helpers of the kernel tests: allocator poisoning, GGUF block makers, error metrics, backend settings."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from voltserve.backends.base import AttentionMetadata
from voltserve.backends.cuda.kernels import QUANT_BLOCK_BYTES


def poison_allocator() -> None:
    """Allocate and free NaN-filled blocks of many sizes: later `torch.empty` calls reuse NaN memory."""
    held = []
    for shift in range(8, 27, 2):
        for _ in range(4):
            held.append(torch.full((1 << shift,), float("nan"), dtype=torch.float16, device="cuda"))
    del held


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (fp64); NaN anywhere gives inf."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def make_quant(qtype: str, rows: int, cols: int, gen: torch.Generator):
    """Random GGUF blocks and their dequantized values.

    Returns:
        (QuantizedTensor, [rows, cols] fp32 dequantized weight) following ggml's layouts: byte i of a block's
        nibbles holds element i (low) and i + 16 (high).
    """
    from loaders.model import QuantizedTensor

    nb = cols // 32
    d = (torch.rand(rows, nb, generator=gen) * 0.02 + 0.005).half()
    if qtype == "Q8_0":
        q = torch.randint(-128, 128, (rows, nb, 32), generator=gen, dtype=torch.int8)
        deq = d.float()[..., None] * q.float()
        raw = np.concatenate([d.numpy().view(np.uint8).reshape(rows, nb, 2), q.numpy().view(np.uint8)], axis=2)
    else:
        q = torch.randint(0, 16, (rows, nb, 32), generator=gen, dtype=torch.int32)
        packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8).numpy()
        if qtype == "Q4_0":
            deq = d.float()[..., None] * (q.float() - 8)
            raw = np.concatenate([d.numpy().view(np.uint8).reshape(rows, nb, 2), packed], axis=2)
        else:
            m = (torch.randn(rows, nb, generator=gen) * 0.05).half()
            deq = d.float()[..., None] * q.float() + m.float()[..., None]
            raw = np.concatenate([d.numpy().view(np.uint8).reshape(rows, nb, 2),
                                  m.numpy().view(np.uint8).reshape(rows, nb, 2), packed], axis=2)
    raw = np.ascontiguousarray(raw.reshape(rows, nb * QUANT_BLOCK_BYTES[qtype]))
    return QuantizedTensor(qtype, (rows, cols), raw), deq.reshape(rows, cols)


def make_linear(backend, fmt: str, n: int, k: int, gen: torch.Generator, scale: float = 0.05):
    """A random [n, k] linear on `backend`: fp16 (values scale * N(0, 1), fp16-exact) or GGUF blocks (make_quant).

    Returns:
        ([n, k] fp32 weight the CPU reference uses, the backend's prepared weight).
    """
    if fmt == "F16":
        weight = (torch.randn(n, k, generator=gen) * scale).half().float()
        return weight, backend.prepare_linear(weight)
    quant, weight = make_quant(fmt, n, k, gen)
    return weight, backend.prepare_linear(weight, quant)


def repacked_weight(backend, fmt: str, n: int, k: int, seed: int):
    """(QuantizedTensor, fp32 dequantized weight, CudaLinear) of a random [n, k] quant weight prepared by
    `backend`, asserted stored repacked (the caller's settings ask for it: quant_repack="on")."""
    quant, weight = make_quant(fmt, n, k, torch.Generator().manual_seed(seed))
    lin = backend.prepare_linear(weight, quant)
    assert lin.layout == "repacked"
    return quant, weight, lin


def decode_blocks(quant) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The fields of a QuantizedTensor's GGUF blocks (Q4_0 / Q4_1 / Q8_0).

    Returns:
        (d [rows, nb] fp32, m [rows, nb] fp32 or None (Q4_1 only), q [rows, nb, 32] int64: the raw quants,
        nibbles 0..15 for Q4, -128..127 for Q8_0, in element order).
    """
    rows, cols = quant.shape
    nb = cols // 32
    raw = torch.from_numpy(np.ascontiguousarray(quant.data)).view(rows, nb, QUANT_BLOCK_BYTES[quant.qtype])
    d = raw[..., :2].contiguous().view(torch.float16).float().reshape(rows, nb)
    if quant.qtype == "Q8_0":
        return d, None, raw[..., 2:].contiguous().view(torch.int8).long()
    mins = raw[..., 2:4].contiguous().view(torch.float16).float().reshape(rows, nb) if quant.qtype == "Q4_1" else None
    packed = raw[..., 4 if quant.qtype == "Q4_1" else 2:].long()
    return d, mins, torch.cat([packed & 15, packed >> 4], dim=2)


def quantize_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] quantized per 32 elements as gemv_s8.cu does (llama.cpp's Q8_1): amax = max |x|,
    q = rint(x * (127 / amax)) (0 where amax = 0), d = amax / 127, all in fp32 as the kernel computes them.

    Returns:
        (q [m, k / 32, 32] int64, d [m, k / 32] fp32, sum of q [m, k / 32] int64).
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    amax = xb.abs().amax(dim=2)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).long()  # round half to even, as cvt.rni
    return q, amax / 127.0, q.sum(dim=2)


def s8_reference(x: torch.Tensor, quant) -> torch.Tensor:
    """What gemv_s8 computes, in fp64 from exact integer block sums: x quantized by `quantize_q8_1`, each block
    of each row adding d_w * d_x * sum(q_w q_x) (Q4_0: with q_w - 8; Q4_1: plus m_w * d_x * sum(q_x)).
    Differs from the kernel only by its fp32 accumulation and fp16 output rounding.

    Args:
        x: [m, k] (fp16 values), CPU.
        quant: the weight's QuantizedTensor ([n, k]).
    Returns:
        [m, n] fp64.
    """
    dw, mw, qw = decode_blocks(quant)
    qx, dx, sx = quantize_q8_1(x)
    dots = torch.einsum("rbj,nbj->rnb", qx.double(), qw.double())  # exact: |sum| < 2^53
    if quant.qtype == "Q4_0":
        dots = dots - 8.0 * sx.double()[:, None, :]
    dx = dx.double()[:, None, :]
    y = (dw.double()[None] * dx * dots)
    if mw is not None:
        y = y + mw.double()[None] * dx * sx.double()[:, None, :]
    return y.sum(dim=2)


@contextlib.contextmanager
def backend_settings(backend, **settings):
    """Set attributes of the backend (gemv_kernel="mma", quant_repack="on", ...) for the block; restored after."""
    saved = {name: getattr(backend, name) for name in settings}
    for name, value in settings.items():
        setattr(backend, name, value)
    try:
        yield backend
    finally:
        for name, value in saved.items():
            setattr(backend, name, value)


def capture(backend, fn):
    """Capture `fn()` in a CUDA graph on torch's current stream (the backend launches on it while capturing, and
    on the stream it had once done). Warm `fn` up before: kernels load, the allocator grows.

    Returns:
        (the torch.cuda.CUDAGraph, what `fn` returned: tensors in the graph's memory, written by each replay).
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.refresh_stream()
        out = fn()
    backend.refresh_stream()
    return graph, out


def assert_replay_equals_eager(backend, step, change_inputs) -> None:
    """Warm `step` up (modules load), capture it in a CUDA graph, `change_inputs()` in place, then assert that
    replaying the graph gives `step()`'s eager outputs (a list of tensors) bit for bit."""
    step()
    torch.cuda.synchronize()
    graph, captured = capture(backend, step)
    change_inputs()
    eager = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager, strict=True):
        assert torch.equal(a, b)


@contextlib.contextmanager
def _recorded_launches(backend, entry):
    """Record entry(kernel, spec) of every launch `backend` makes inside the block (a list, in launch order)."""
    got: list = []
    launch = backend._launch

    def record(op, kernel, spec, *args, **kwargs):
        got.append(entry(kernel, spec))
        return launch(op, kernel, spec, *args, **kwargs)

    backend._launch = record
    try:
        yield got
    finally:
        del backend._launch  # the class's method again


def launched_kernels(backend):
    """Record the name of every kernel `backend` launches inside the block (a list, in launch order): tests that
    must know which of two kernels computing the same values ran."""
    return _recorded_launches(backend, lambda kernel, spec: kernel)


def launched_builds(backend):
    """Record (kernel name, its -D spec) of every launch `backend` makes inside the block: tests that must know
    which build of a kernel ran."""
    return _recorded_launches(backend, lambda kernel, spec: (kernel, dict(spec or {})))


def paged_kv_case(seq_lens, query_lens, num_kv_heads, head_dim, block_size, gen):
    """Random paged KV (NaN in the slots past each context), shuffled block tables and metadata for the given
    contexts and query lengths: (kv [2, num_blocks, block_size, num_kv_heads, head_dim] fp16, AttentionMetadata
    on the CPU with an empty slot_mapping)."""
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq)
    tables = torch.full((len(seq_lens), max_blocks + 2), -1, dtype=torch.int32)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).half()
    used = 0
    for i, (s, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[i, :nb] = perm[used:used + nb].int()
        last = int(perm[used + nb - 1])
        kv[:, last, s - (nb - 1) * block_size:] = float("nan")  # slots past the context must never be read
        used += nb
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    attn = AttentionMetadata(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_tables=tables, slot_mapping=torch.zeros(0, dtype=torch.int64),
                             max_query_len=max(query_lens), max_seq_len=max(seq_lens),
                             query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    return kv, attn


def metadata_to_cuda(attn: AttentionMetadata, max_seq_len=None, split_decode=False,
                     max_query_len=None, rows_as_decodes=False) -> AttentionMetadata:
    """`attn` with its tensors on the GPU; max_seq_len / max_query_len: a graph bucket's capacities."""
    return AttentionMetadata(attn.query_start_loc.cuda(), attn.seq_lens.cuda(), attn.block_tables.cuda(),
                             attn.slot_mapping.cuda(), max_query_len or attn.max_query_len,
                             max_seq_len or attn.max_seq_len, attn.query_lens_cpu, attn.seq_lens_cpu, split_decode,
                             rows_as_decodes=rows_as_decodes)


def assert_nan_and_zero_blocks(backend, tol: float) -> None:
    """For the int8 decode GEMVs on repacked rows: an all-zero x block (d = 0) and blocks of very different
    magnitudes stay within `tol` of `s8_reference` and finite; a NaN in x makes every output NaN. Uses a Q4_1
    [64, 1024] weight (the caller's backend settings pick the kernel)."""
    quant, _, lin = repacked_weight(backend, "Q4_1", 64, 1024, 13)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(14)).half()
    x[0, 64:96] = 0
    x[0, 96:128] *= 1000
    x[0, 128:160] *= 1e-3
    got = backend.linear(x.cuda(), lin)
    assert torch.isfinite(got.float()).all() and rel_err(got, s8_reference(x, quant)) <= tol
    x[0, 100] = float("nan")
    assert torch.isnan(backend.linear(x.cuda(), lin).float()).all()
