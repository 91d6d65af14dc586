"""GGUF Q4_0 / Q4_1 linears on torch's int4 weight-only CPU kernel (`aten._weight_int4pack_mm_for_cpu`).

The kernel dequantizes w = (q - 8) * scale + zero per group of 32 input features, which is exactly the GGUF block
(ggml-common.h): Q4_1 w = d * q + m  ->  scale d, zero m + 8 d;  Q4_0 w = d * (q - 8)  ->  scale d, zero 0.
It reads 4.5-5 bits per weight instead of 32 and scales well with batch; activations run in bf16 (the kernel's
fast path on these CPUs), so results differ from the fp32 reference by bf16 rounding.
"""

from __future__ import annotations

import numpy as np
import torch

from voltserve.quant import BLOCK_BYTES, QuantizedTensor


def supports(quant: QuantizedTensor) -> bool:
    """True when `quant` can run on the int4 kernel (Q4_0/Q4_1, and the kernel op exists in this torch)."""
    return (quant.qtype in ("Q4_0", "Q4_1") and quant.shape[1] % 32 == 0
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def unpack_q4(quant: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split raw Q4 blocks into (q [rows, cols] int32 in 0..15, d [rows, cols/32] fp32, m [rows, cols/32] fp32).

    m is zero for Q4_0 (whose offset -8 is applied by the caller's formula).
    """
    rows, cols = quant.shape
    nb = cols // 32
    blocks = np.ascontiguousarray(quant.data).reshape(rows, nb, BLOCK_BYTES[quant.qtype])
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if quant.qtype == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[:, :, 4:20]
    else:
        m = np.zeros_like(d)
        qs = blocks[:, :, 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # low nibbles first, then high
    return torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m)


class Int4Linear:
    """A callable linear: x [num_tokens, in_features] -> [num_tokens, out_features] in x's dtype."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int):
        self.packed = packed
        self.scales_zeros = scales_zeros  # [in_features / 32, out_features, 2] bf16
        self.out_features = out_features

    @classmethod
    def from_quantized(cls, quant: QuantizedTensor, dtype: torch.dtype = torch.float32) -> "Int4Linear":
        q, d, m = unpack_q4(quant)
        zero = m + 8 * d if quant.qtype == "Q4_1" else torch.zeros_like(d)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scales_zeros = torch.stack([d.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)
        return cls(packed, scales_zeros, quant.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed, 32,
                                                       self.scales_zeros)
        return y.to(x.dtype)
