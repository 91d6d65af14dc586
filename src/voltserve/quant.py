"""Block-quantized weights as stored in GGUF files, kept packed so backends can run on the blocks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# bytes per block of 32 weights (ggml-common.h): Q4_0 = fp16 d + 16 nibble bytes; Q4_1 = fp16 d, fp16 m + 16;
# Q8_0 = fp16 d + 32 int8
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BLOCK_SIZE = 32


@dataclass(frozen=True)
class QuantizedTensor:
    """A GGUF block-quantized 2-D weight.

    Attributes:
        qtype: GGUF type name: "Q4_0", "Q4_1" or "Q8_0".
        shape: (rows, cols) logical shape; rows = out_features, blocks of 32 run along cols.
        data: [rows, cols // 32 * block_bytes] uint8, the raw GGUF blocks of each row, rows already in the
            same order as the dequantized weight (e.g. after undoing llama.cpp's Q/K row permutation).
    Source: ggml block layouts (ggml-common.h): Q4_0 = fp16 d + 16 bytes of nibbles; Q4_1 = fp16 d, fp16 m +
        16 bytes; Q8_0 = fp16 d + 32 int8. Nibble layout of byte i: low nibble = element i, high = element i + 16;
        value = d * q (+ m for Q4_1; q - 8 for Q4_0).
    """

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor | None:
    """Stack weights along rows (fused QKV, gate/up): of one type as they are; of several (a Q4_K_M file's Q8_0
    v_proj beside Q4_1 q / k_proj, `loaders.gguf_convert`) as Q8_0, its Q8_0 parts as they are and the others
    requantized (`requantize_q8_0`), so the fused weight stays packed rather than falling back to fp16.
    None when the in_features differ."""
    cols = {p.shape[1] for p in parts}
    if len(cols) != 1:
        return None
    target = fused_qtype({p.qtype for p in parts})
    parts = [p if p.qtype == target else requantize_q8_0(p) for p in parts]
    rows = sum(p.shape[0] for p in parts)
    return QuantizedTensor(target, (rows, cols.pop()), np.concatenate([p.data for p in parts], axis=0))


def fused_qtype(qtypes: set[str]) -> str:
    """The packed type a fused weight of parts of these types runs as (`concat_rows`): their one type, else Q8_0."""
    return next(iter(qtypes)) if len(qtypes) == 1 else "Q8_0"


def requantize_q8_0(quant: QuantizedTensor) -> QuantizedTensor:
    """`quant`'s values as Q8_0 blocks (`quantize_q8_0`; for a Q4 block a weight moves by at most about 1/17 of
    its own step). Raises ValueError for a type other than BLOCK_BYTES'."""
    if quant.qtype not in BLOCK_BYTES:
        raise ValueError(f"cannot requantize {quant.qtype} (packed types: {', '.join(BLOCK_BYTES)})")
    return quantize_q8_0(dequantize_rows(quant))


def quantize_q8_0(values: np.ndarray) -> QuantizedTensor:
    """[rows, cols] values (cols % 32 == 0) as Q8_0 blocks: each 32-block's values with a new fp16 scale amax / 127
    and int8 quants (gguf-py's Q8_0, bit-exact with ggml's reference); a weight moves by at most ~0.57 of that
    step where the block's amax >= 127 * 2^-14 (a normal fp16 scale)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    data = quantize(np.ascontiguousarray(values, dtype=np.float32), GGMLQuantizationType.Q8_0)
    return QuantizedTensor("Q8_0", tuple(values.shape), data.reshape(values.shape[0], -1))


def dequantize_rows(quant: QuantizedTensor) -> np.ndarray:
    """[rows, cols] fp32 values of `quant`'s blocks (gguf-py's dequantization)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(np.ascontiguousarray(quant.data), GGMLQuantizationType[quant.qtype])
    return values.reshape(quant.shape).astype(np.float32, copy=False)
