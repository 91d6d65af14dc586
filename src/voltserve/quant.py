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
    """Stack weights of one type along rows (fused QKV, gate/up); None when the types differ."""
    qtypes = {p.qtype for p in parts}
    cols = {p.shape[1] for p in parts}
    if len(qtypes) != 1 or len(cols) != 1:
        return None
    rows = sum(p.shape[0] for p in parts)
    return QuantizedTensor(parts[0].qtype, (rows, cols.pop()), np.concatenate([p.data for p in parts], axis=0))
