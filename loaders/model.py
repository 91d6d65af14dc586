"""What every loader returns: `LoadedModel` (config, reference weights, raw quantized blocks, tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from voltserve.config import ModelConfig


@dataclass(frozen=True)
class QuantizedTensor:
    """A GGUF block-quantized 2-D weight, kept packed so backends can run on the blocks.

    Attributes:
        qtype: GGUF type name: "Q4_0", "Q4_1" or "Q8_0".
        shape: (rows, cols) logical shape; rows = out_features, blocks of 32 run along cols.
        data: [rows, cols // 32 * block_bytes] uint8, the raw GGUF blocks of each row, rows already in the
            same order as the dequantized weight (e.g. after undoing llama.cpp's Q/K row permutation).
    Source: ggml block layouts (ggml-common.h): Q4_0 = fp16 d + 16 bytes of nibbles; Q4_1 = fp16 d, fp16 m +
        16 bytes; Q8_0 = fp16 d + 32 int8. Nibble j of byte i: low nibble = element i, high = element i + 16.
    """

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray


@dataclass
class LoadedModel:
    """A model ready for the engine.

    Attributes:
        config: hyper-parameters (Q/K already in the `config.rope_style` layout).
        tensors: HF-style names (`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`,
            `...k_proj`, `...v_proj`, `...o_proj`, `model.layers.{i}.mlp.gate_proj/up_proj/down_proj.weight`,
            `model.layers.{i}.input_layernorm.weight`, `...post_attention_layernorm.weight`, `model.norm.weight`,
            `lm_head.weight` unless tied) -> dequantized fp32 CPU tensors, [out_features, in_features] for linears.
        quantized: same names -> QuantizedTensor for tensors stored block-quantized in the file.
        tokenizer: voltserve.tokenizer.Tokenizer.
        chat_template: Jinja2 template text, or None.
        source: file or directory the model was read from.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: "object"
    chat_template: str | None
    source: str
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)
