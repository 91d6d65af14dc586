"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral dense) written against the Backend interface.

Reads top to bottom like the paper's block: RMSNorm -> fused QKV -> rotary -> paged attention -> o_proj, then
RMSNorm -> fused gate/up -> SiLU * up -> down (Touvron et al. 2023). The residual stream `h` is added in the
linear that ends each half, and each RMSNorm runs inside the linear that reads it (`norm_linear`), so a decode
layer is six launches on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from voltserve.backends.base import Backend, StepInputs, decoder_tail
from voltserve.backends.cpu import rope_cos_sin
from voltserve.config import ModelConfig
from voltserve.errors import UnsupportedModelError
from voltserve.quant import concat_rows


SUPPORTED_ARCHITECTURES = ("llama", "mistral")


@dataclass
class LlamaLayer:
    input_norm: torch.Tensor  # [hidden_size]
    qkv: Any  # backend linear, out = (num_heads + 2 * num_kv_heads) * head_dim
    o_proj: Any  # backend linear, out = hidden_size
    post_norm: torch.Tensor  # [hidden_size]
    gate_up: Any  # backend linear, out = 2 * intermediate_size
    down: Any  # backend linear, out = hidden_size


def _fuse(tensors: dict, quantized: dict, names: list[str], backend: Backend, swiglu: bool = False,
          norm: str | None = None):
    """Concatenate linears along out_features and hand them to the backend (quantized blocks too, if all are);
    `swiglu`: the pair is [gate; up]; `norm`: the RMSNorm weight every norm_linear on it applies first
    (Backend.prepare_linear)."""
    weight = torch.cat([tensors[n] for n in names], dim=0)
    quant = None
    if quantized and all(n in quantized for n in names):
        quant = concat_rows([quantized[n] for n in names])
    return backend.prepare_linear(weight, quant, swiglu=swiglu, norm=tensors[norm] if norm else None)


class LlamaModel:
    """A Llama decoder whose ops run on `backend`.

    Args:
        config: model hyper-parameters.
        tensors: HF-named fp32 CPU weights (see loaders.model.LoadedModel).
        backend: the ops implementation.
        quantized: HF-named raw GGUF blocks, optional.
        max_positions: rotary table length (positions the engine may use).
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], backend: Backend,
                 quantized: dict | None = None, max_positions: int | None = None):
        if config.architecture not in SUPPORTED_ARCHITECTURES:
            # Qwen2's QKV bias and Qwen3's QK-norm would be silently skipped: refuse rather than answer wrongly
            raise UnsupportedModelError(f"architecture {config.architecture!r} is not supported yet "
                                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.config = config
        self.backend = backend
        quantized = quantized or {}
        norm = lambda name: backend.prepare_norm(tensors[name])  # noqa: E731
        self.embed = backend.prepare_embedding(tensors["model.embed_tokens.weight"],
                                               quantized.get("model.embed_tokens.weight"))
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = backend.prepare_linear(tensors[head], quantized.get(head), norm=tensors["model.norm.weight"],
                                              logits=True)
        self.final_norm = norm("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(LlamaLayer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=_fuse(tensors, quantized, [p + f"self_attn.{n}_proj.weight" for n in "qkv"], backend,
                          norm=p + "input_layernorm.weight"),
                o_proj=_fuse(tensors, quantized, [p + "self_attn.o_proj.weight"], backend),
                post_norm=norm(p + "post_attention_layernorm.weight"),
                gate_up=_fuse(tensors, quantized, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], backend,
                              swiglu=True, norm=p + "post_attention_layernorm.weight"),
                down=_fuse(tensors, quantized, [p + "mlp.down_proj.weight"], backend),
            ))
        positions = max_positions or config.max_position_embeddings
        self.cos_sin = rope_cos_sin(config.head_dim, positions, config.rope_theta).to(backend.device)
        self.scale = config.head_dim ** -0.5

    def forward(self, step: StepInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step.

        Args:
            step: flat inputs of the step.
            kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        Returns:
            logits [len(step.logits_indices), vocab_size] in the backend's dtype (fp16 on the GPU).
        """
        cfg, be = self.config, self.backend
        num_tokens = step.input_ids.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        h = be.embedding(step.input_ids, self.embed)  # the residual stream
        eps = cfg.rms_norm_eps
        every_row = step.logits_indices.numel() == num_tokens  # a decode step: the lm_head on all rows, no gather
        layers = self.layers
        # each layer's tail also computes the next layer's qkv (or the logits): decoder_tail may fuse them
        qkv = be.norm_linear(h, layers[0].input_norm, eps, layers[0].qkv)
        for i, layer in enumerate(layers):
            q = qkv[:, :q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, q_size + kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            o = be.rope_attention(q, k, v, step.positions, self.cos_sin, cfg.rope_style, kv_cache[i], step.attn,
                                  self.scale, out_linear=layer.o_proj)
            if i + 1 < len(layers):
                then = (layers[i + 1].input_norm, layers[i + 1].qkv)
            else:
                then = (self.final_norm, self.lm_head) if every_row else None
            h, qkv = decoder_tail(be, o.reshape(num_tokens, q_size), h, layer.o_proj, layer.post_norm,
                                  layer.gate_up, layer.down, eps, then)
        if every_row:
            return qkv
        return be.norm_linear(h[step.logits_indices], self.final_norm, eps, self.lm_head)
