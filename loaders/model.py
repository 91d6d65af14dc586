"""What every loader returns: `LoadedModel` (config, reference weights, raw quantized blocks, tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from voltserve.config import ModelConfig
from voltserve.quant import QuantizedTensor

__all__ = ["LoadedModel", "QuantizedTensor"]


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
