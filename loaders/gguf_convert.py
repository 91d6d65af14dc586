"""GGUF block types without kernels of their own, converted at load into the packed types the backends run
(`voltserve.quant`: Q4_0 / Q4_1 / Q8_0), so a Q4_K_M file runs on the quantized GEMVs rather than as fp16 weights
(2-3x the bytes per decode step, and 16 GB instead of ~5 GB for an 8B model).

- Q4_K -> Q4_1, near-lossless: a Q4_K super-block of 256 is 8 sub-blocks of 32 whose values are
  d * sc_i * q - dmin * m_i (6-bit sc_i, m_i); each sub-block is one Q4_1 block (value = d' * q + m') with the
  same nibbles, d' = fp16(d * sc_i) and m' = fp16(-dmin * m_i). The only change is those two roundings to fp16:
  an element moves by at most 2^-11 * (15 |d sc_i| + |dmin m_i|) (half an fp16 ulp of each term). Q4_1 is 5 bits
  a weight against Q4_K's 4.5.
- Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K and the i-quants (IQ4_NL, IQ4_XS, IQ3_*, IQ2_*, IQ1_*) -> Q8_0,
  requantized: the dequantized values of each 32-block take a new fp16 scale amax / 127 and int8 quants (gguf-py's
  Q8_0, bit-exact with ggml's reference). An element moves by at most ~0.57 of the new step (half a step, plus the
  scale's fp16 rounding over 127 steps): for Q6_K at most ~1/8 of its own step where a 32-block's two 16-weight
  sub-block scales are alike (the new step follows the larger, so the smaller one's weights move more), and the
  added rounding noise ~6% of the variance Q6_K already has. That bound needs a normal fp16 scale (amax >= 127 *
  2^-14, ~7.8e-3): a block of smaller weights has an fp16-subnormal scale that rounds by up to 2^-25, up to ~1
  step at amax 1e-3 (gguf-py's and ggml's Q8_0 alike). Q8_0 is 8.5 bits a weight: more than the 1.56-6.56 of
  these types (an IQ2 file takes ~4x its size in memory), less than fp16's 16.

The loader then keeps, as each tensor's fp32 reference, the converted blocks dequantized: every backend (the CPU
reference and the GPU kernels) computes with the same weights. `--gguf-convert off` keeps the file's exact values
as floats instead (the path before this module: fp16 weights on a GPU).

Source: block layouts and dequantization from ggml (ggml-common.h, ggml-quants.c), read through gguf-py
(`gguf.quants`: Q4_K.get_scale_min, quantize / dequantize).
"""

from __future__ import annotations

import numpy as np

from voltserve.quant import BLOCK_BYTES, QuantizedTensor, dequantize_rows, quantize_q8_0

__all__ = ["CONVERTED_TYPES", "convert_blocks", "packed_type", "q4_k_to_q4_1"]

# file type -> the packed type it runs as
CONVERTED_TYPES = {"Q4_K": "Q4_1", "Q5_0": "Q8_0", "Q5_1": "Q8_0", "Q2_K": "Q8_0", "Q3_K": "Q8_0", "Q5_K": "Q8_0",
                   "Q6_K": "Q8_0", "IQ4_NL": "Q8_0", "IQ4_XS": "Q8_0", "IQ3_XXS": "Q8_0", "IQ3_S": "Q8_0",
                   "IQ2_XXS": "Q8_0", "IQ2_XS": "Q8_0", "IQ2_S": "Q8_0", "IQ1_S": "Q8_0", "IQ1_M": "Q8_0"}
Q4_K_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: 256 weights


def packed_type(qtype: str, packed_types: tuple[str, ...], convert: bool) -> str | None:
    """The packed type a 2-D tensor of GGML type `qtype` loads as: itself where it has kernels (`packed_types`),
    its CONVERTED_TYPES target where `convert`, else None (loaded as floats only)."""
    if qtype in packed_types:
        return qtype
    return CONVERTED_TYPES.get(qtype) if convert else None


def q4_k_to_q4_1(raw: np.ndarray) -> np.ndarray | None:
    """Q4_K blocks as Q4_1 blocks (the module docstring gives the rounding bound).

    Args:
        raw: [rows, n * 144] uint8, each row n Q4_K super-blocks (256 weights each).

    Returns:
        [rows, n * 8 * 20] uint8 Q4_1 blocks of the same weights in the same order; None when a sub-block's
        d * sc or dmin * m does not fit fp16 (|x| > 65504: then requantize to Q8_0 instead).

    Raises:
        ValueError: raw is not 2-D or its rows are not whole super-blocks.
    """
    from gguf.quants import Q4_K

    if raw.ndim != 2 or raw.shape[1] % Q4_K_BYTES:
        raise ValueError(f"Q4_K rows must be whole {Q4_K_BYTES}-byte blocks, got shape {raw.shape}")
    rows, n = raw.shape[0], raw.shape[1] // Q4_K_BYTES
    blocks = np.ascontiguousarray(raw).reshape(rows * n, Q4_K_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)       # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())                # [B, 8] each, 0..63
    with np.errstate(over="ignore"):  # an overflow shows as inf, checked below
        scale = (d * sc.astype(np.float32)).astype(np.float16)            # exact in fp32, one rounding
        offset = (-(dmin * mn.astype(np.float32))).astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        return None
    # nibbles: bytes 32 j .. 32 j + 31 hold sub-block 2 j (low nibbles) and 2 j + 1 (high), element l at byte l
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(-1, 8, 32)                         # [B, 8 sub-blocks, 32 elements]
    packed = q[:, :, :16] | (q[:, :, 16:] << np.uint8(4))                # Q4_1: byte l = element l | element l + 16
    out = np.empty((rows * n, 8, BLOCK_BYTES["Q4_1"]), dtype=np.uint8)
    out[:, :, 0:2] = scale.view(np.uint8).reshape(-1, 8, 2)
    out[:, :, 2:4] = offset.view(np.uint8).reshape(-1, 8, 2)
    out[:, :, 4:] = packed
    return out.reshape(rows, n * 8 * BLOCK_BYTES["Q4_1"])


def convert_blocks(qtype: str, raw: np.ndarray, values: np.ndarray) -> tuple[QuantizedTensor, np.ndarray] | None:
    """One 2-D tensor of a CONVERTED_TYPES type as packed blocks, and their dequantized values.

    Args:
        qtype: its GGML type name (a CONVERTED_TYPES key).
        raw: [rows, row_bytes] uint8, its blocks as the file stores them.
        values: [rows, cols] fp32, its exact dequantized values (cols % 32 == 0).

    Returns:
        (QuantizedTensor of CONVERTED_TYPES[qtype], or Q8_0 where a Q4_K scale overflows fp16; [rows, cols]
        fp32 values of those blocks, the reference the backends then compute with); None when the values are not
        finite or a 32-block's amax / 127 does not fit fp16 either (keep the exact values as floats).

    Raises:
        ValueError: an unknown qtype, or cols not a multiple of 32.
    """
    if qtype not in CONVERTED_TYPES:
        raise ValueError(f"{qtype} has no conversion (convertible: {', '.join(CONVERTED_TYPES)})")
    rows, cols = values.shape
    if cols % 32:
        raise ValueError(f"a converted tensor needs whole 32-wide blocks, got {cols} columns")
    data = q4_k_to_q4_1(raw) if CONVERTED_TYPES[qtype] == "Q4_1" else None
    if data is not None:
        quant = QuantizedTensor("Q4_1", (rows, cols), data)
    elif not np.isfinite(values).all() or np.abs(values).max(initial=0.0) / 127 > np.finfo(np.float16).max:
        return None
    else:
        quant = quantize_q8_0(values)
    return quant, dequantize_rows(quant)
