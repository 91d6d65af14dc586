"""Torch CPU backend: the reference implementation of every op (the oracle CUDA kernels are tested against).

Weights are kept in the compute dtype (fp32 by default). Q4_0/Q4_1 GGUF linears can instead run on torch's
int4 weight-only CPU kernel (`aten._weight_int4pack_mm_for_cpu`, group size 32, the GGUF block size), which
reads 8x fewer bytes than fp32 and batches well; `weight_format="float"` keeps the fp32 reference path.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from voltserve.backends.base import AttentionMetadata


def rope_cos_sin(head_dim: int, max_positions: int, theta: float) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos of each frequency in the first half, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


class CpuBackend:
    """Reference ops on torch CPU tensors. See `voltserve.backends.base.Backend` for each op's contract."""

    def __init__(self, dtype: torch.dtype = torch.float32, use_int4: bool = False):
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.use_int4 = use_int4

    # -- weights -------------------------------------------------------------------------------------------

    def prepare_linear(self, weight: torch.Tensor, quant: Any | None = None) -> Any:
        if self.use_int4 and quant is not None:
            from voltserve.backends.cpu_int4 import Int4Linear, supports

            if supports(quant):
                return Int4Linear.from_quantized(quant, self.dtype)
        return weight.to(self.dtype).contiguous()

    def prepare_embedding(self, weight: torch.Tensor, quant: Any | None = None) -> Any:
        return weight.to(self.dtype).contiguous()

    # -- ops -----------------------------------------------------------------------------------------------

    def embedding(self, token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, table)

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * weight.float()).to(x.dtype), x

    def rotary(self, q, k, positions, cos_sin, style):
        half = cos_sin.shape[-1] // 2
        cs = cos_sin[positions]
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        return _apply_rotary(q, cos, sin, style), _apply_rotary(k, cos, sin, style)

    def linear(self, x, weight):
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight)
        return weight(x)

    def write_kv(self, k, v, kv_layer, slot_mapping):
        num_blocks, block_size = kv_layer.shape[1], kv_layer.shape[2]
        flat = kv_layer.view(2, num_blocks * block_size, *kv_layer.shape[3:])
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
        flat[0, slot_mapping] = k.to(kv_layer.dtype)
        flat[1, slot_mapping] = v.to(kv_layer.dtype)

    def attention(self, q, kv_layer, attn: AttentionMetadata, scale):
        if attn.is_decode_only:
            return self._decode_attention(q, kv_layer, attn, scale)
        block_size = kv_layer.shape[2]
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(attn.query_lens_cpu, attn.seq_lens_cpu)):
            blocks = attn.block_tables[i, :-(-seq_len // block_size)].long()
            k = kv_layer[0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, d]
            v = kv_layer[1, blocks].flatten(0, 1)[:seq_len]
            qs = q[start:start + q_len].transpose(0, 1)  # [heads, q_len, d]
            # new token j sits at position seq_len - q_len + j and sees keys 0..that position
            mask = None
            if q_len > 1:
                rows = torch.arange(seq_len - q_len, seq_len)[:, None]
                mask = torch.arange(seq_len)[None, :] <= rows
            o = F.scaled_dot_product_attention(qs.to(k.dtype), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:start + q_len] = o.transpose(0, 1).to(q.dtype)
            start += q_len
        return out

    def _decode_attention(self, q, kv_layer, attn: AttentionMetadata, scale):
        """All sequences at once (one query each): gather their blocks, mask past seq_len, grouped heads."""
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_layer.shape[3]
        max_blocks = -(-attn.max_seq_len // kv_layer.shape[2])
        tables = attn.block_tables[:, :max_blocks].long().clamp_min(0)
        k = kv_layer[0, tables].flatten(1, 2).transpose(1, 2)  # [seqs, kv_heads, ctx, d]
        v = kv_layer[1, tables].flatten(1, 2).transpose(1, 2)
        qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).to(k.dtype)
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [seqs, kv_heads, group, ctx]
        ctx = torch.arange(k.shape[2])
        scores.masked_fill_((ctx[None, :] >= attn.seq_lens.cpu()[:, None].long())[:, None, None, :], float("-inf"))
        o = torch.matmul(torch.softmax(scores, -1).to(v.dtype), v)  # [seqs, kv_heads, group, d]
        return o.reshape(num_seqs, num_heads, head_dim).to(q.dtype)

    def silu_and_mul(self, x):
        inner = x.shape[-1] // 2
        return F.silu(x[:, :inner]) * x[:, inner:]

    def allocate_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim):
        return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=self.dtype)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    xf = x.float()
    if style == "neox":
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
