"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral dense) written against the Backend interface.

Reads top to bottom like the paper's block: RMSNorm -> fused QKV -> rotary -> paged attention -> o_proj, then
RMSNorm -> fused gate/up -> SiLU * up -> down (Touvron et al. 2023). The residual stream `h` is added in the
linear that ends each half, and each RMSNorm runs inside the linear that reads it (`norm_linear`), so a decode
layer is six launches on the GPU.

Tensor parallelism (`tp`, Megatron-LM: Shoeybi et al. 2019, section 3): each rank keeps whole attention heads and
whole KV heads (qkv column-parallel, o_proj row-parallel) and a slice of the MLP's inner features (gate_up
column-parallel, down row-parallel); the two row-parallel linears of a layer are each followed by one all-reduce
(`decoder_tail`). Its KV cache holds its own KV heads only. The embedding and the lm_head stay replicated (every
rank holds them whole and computes the full logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from voltserve.backends.base import Backend, StepInputs, decoder_tail
from voltserve.backends.cpu import rope_cos_sin
from voltserve.config import ModelConfig
from voltserve.distributed.group import SingleRank, TPGroup
from voltserve.distributed.sharding import column_shard, local_heads, row_shard, split_range
from voltserve.errors import UnsupportedModelError
from voltserve.quant import QuantizedTensor, concat_rows, dequantize_rows


SUPPORTED_ARCHITECTURES = ("llama", "mistral")


@dataclass
class LlamaLayer:
    input_norm: torch.Tensor  # [hidden_size]
    # per rank (TP): heads = num_heads / tp_size, kv heads = num_kv_heads / tp_size, inner = intermediate / tp_size
    qkv: Any  # backend linear, out = (heads + 2 * kv_heads) * head_dim, in = hidden_size
    o_proj: Any  # backend linear, out = hidden_size, in = heads * head_dim
    post_norm: torch.Tensor  # [hidden_size]
    gate_up: Any  # backend linear, out = 2 * inner ([gate; up] of this rank's inner features), in = hidden_size
    down: Any  # backend linear, out = hidden_size, in = inner


Part = tuple[torch.Tensor, QuantizedTensor | None]  # a linear's (fp32 weight, GGUF blocks or None)


def _fuse(parts: list[Part], backend: Backend, swiglu: bool = False, norm: torch.Tensor | None = None,
          mixed: bool = True):
    """Concatenate linears along out_features and hand them to the backend (quantized blocks too, if all are;
    parts of several packed types as Q8_0, `concat_rows`, the fp32 weight then those blocks' values so every
    backend computes with the same weights); `swiglu`: the pair is [gate; up]; `norm`: the RMSNorm weight every
    norm_linear on it applies first (Backend.prepare_linear); `mixed` False: parts of several packed types fuse as
    their exact fp32 values, unpacked (`--gguf-convert off`)."""
    quants = [q for _, q in parts]
    same = len({q.qtype for q in quants if q is not None}) == 1
    quant = concat_rows(quants) if all(q is not None for q in quants) and (mixed or same) else None
    if quant is not None and any(q.qtype != quant.qtype for q in quants):
        weight = torch.from_numpy(dequantize_rows(quant))
    else:
        weight = torch.cat([w for w, _ in parts], dim=0)
    return backend.prepare_linear(weight, quant, swiglu=swiglu, norm=norm)


class LlamaModel:
    """A Llama decoder whose ops run on `backend`, whole (TP = 1) or as one rank of a tensor-parallel group.

    Args:
        config: model hyper-parameters (of the whole model, also under TP).
        tensors: HF-named fp32 CPU weights (see loaders.model.LoadedModel), whole: each rank slices its share.
        backend: the ops implementation.
        quantized: HF-named raw GGUF blocks, optional.
        max_positions: rotary table length (positions the engine may use).
        tp: the tensor-parallel group this rank belongs to; None = TP = 1 (`SingleRank`).
        fuse_mixed: fused linears (qkv, gate_up) of several packed types run as Q8_0 (`quant.concat_rows`);
            False (`--gguf-convert off`): as the parts' exact values, unpacked.
    Attributes:
        num_heads / num_kv_heads: this rank's attention / KV heads (the whole model's at TP = 1); the KV cache
            passed to `forward` has `num_kv_heads` heads.
    Raises:
        UnsupportedModelError: an architecture other than Llama / Mistral.
        ConfigError: under TP, num_heads, num_kv_heads or intermediate_size does not divide by the TP size, or a
            quantized row-parallel weight's input slice does not fall on GGUF block boundaries
            (`voltserve.distributed.sharding`).
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], backend: Backend,
                 quantized: dict | None = None, max_positions: int | None = None, tp: TPGroup | None = None,
                 fuse_mixed: bool = True):
        if config.architecture not in SUPPORTED_ARCHITECTURES:
            # Qwen2's QKV bias and Qwen3's QK-norm would be silently skipped: refuse rather than answer wrongly
            raise UnsupportedModelError(f"architecture {config.architecture!r} is not supported yet "
                                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.config = config
        self.backend = backend
        self.tp = tp or SingleRank()
        self.num_heads, self.num_kv_heads = local_heads(config, self.tp.world_size)
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
            part = self._shard(tensors, quantized, p)
            self.layers.append(LlamaLayer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=_fuse([part(f"self_attn.{n}_proj") for n in "qkv"], backend,
                          norm=tensors[p + "input_layernorm.weight"], mixed=fuse_mixed),
                o_proj=_fuse([part("self_attn.o_proj")], backend),
                post_norm=norm(p + "post_attention_layernorm.weight"),
                gate_up=_fuse([part("mlp.gate_proj"), part("mlp.up_proj")], backend, swiglu=True,
                              norm=tensors[p + "post_attention_layernorm.weight"], mixed=fuse_mixed),
                down=_fuse([part("mlp.down_proj")], backend),
            ))
        positions = max_positions or config.max_position_embeddings
        self.cos_sin = rope_cos_sin(config.head_dim, positions, config.rope_theta).to(backend.device)
        self.scale = config.head_dim ** -0.5

    def _shard(self, tensors: dict, quantized: dict, prefix: str):
        """`part(name) -> (weight, quant)`: this rank's slice of layer linear `prefix + name + ".weight"`."""
        cfg, rank, world = self.config, self.tp.rank, self.tp.world_size
        d = cfg.head_dim
        q = (rank * self.num_heads * d, (rank + 1) * self.num_heads * d)  # this rank's heads' features
        kv = (rank * self.num_kv_heads * d, (rank + 1) * self.num_kv_heads * d)
        inner = split_range(cfg.intermediate_size, rank, world, "intermediate_size")
        # column-parallel: a slice of the output features; row-parallel: of the input features (then all-reduce)
        cuts = {"self_attn.q_proj": (column_shard, q), "self_attn.k_proj": (column_shard, kv),
                "self_attn.v_proj": (column_shard, kv), "self_attn.o_proj": (row_shard, q),
                "mlp.gate_proj": (column_shard, inner), "mlp.up_proj": (column_shard, inner),
                "mlp.down_proj": (row_shard, inner)}

        def part(name: str) -> Part:
            full = prefix + name + ".weight"
            if world == 1:
                return tensors[full], quantized.get(full)
            shard, (start, stop) = cuts[name]
            return shard(tensors[full], quantized.get(full), start, stop, name=full)

        return part

    def forward(self, step: StepInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run one step.

        Args:
            step: flat inputs of the step.
            kv_cache: [num_layers, 2, num_blocks, block_size, self.num_kv_heads, head_dim] (this rank's KV heads).
        Returns:
            logits [len(step.logits_indices), vocab_size] in the backend's dtype (fp16 on the GPU).
        """
        cfg, be = self.config, self.backend
        num_tokens = step.input_ids.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads  # this rank's
        q_size = heads * cfg.head_dim
        kv_size = kv_heads * cfg.head_dim
        h = be.embedding(step.input_ids, self.embed)  # the residual stream
        eps = cfg.rms_norm_eps
        every_row = step.logits_indices.numel() == num_tokens  # a decode step: the lm_head on all rows, no gather
        layers = self.layers
        # each layer's tail also computes the next layer's qkv (or the logits): decoder_tail may fuse them
        qkv = be.norm_linear(h, layers[0].input_norm, eps, layers[0].qkv)
        for i, layer in enumerate(layers):
            q = qkv[:, :q_size].view(num_tokens, heads, cfg.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(num_tokens, kv_heads, cfg.head_dim)
            v = qkv[:, q_size + kv_size:].view(num_tokens, kv_heads, cfg.head_dim)
            o = be.rope_attention(q, k, v, step.positions, self.cos_sin, cfg.rope_style, kv_cache[i], step.attn,
                                  self.scale, out_linear=layer.o_proj)
            if i + 1 < len(layers):
                then = (layers[i + 1].input_norm, layers[i + 1].qkv)
            else:
                then = (self.final_norm, self.lm_head) if every_row else None
            h, qkv = decoder_tail(be, o.reshape(num_tokens, q_size), h, layer.o_proj, layer.post_norm,
                                  layer.gate_up, layer.down, eps, then, tp=self.tp)
        if every_row:
            return qkv
        return be.norm_linear(h[step.logits_indices], self.final_norm, eps, self.lm_head)
