"""Helpers of the kernel tests: allocator poisoning, GGUF block makers, error metrics."""

from __future__ import annotations

import numpy as np
import torch

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
