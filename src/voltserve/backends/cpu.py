"""Torch CPU backend: the reference implementation of every op (the oracle CUDA kernels are tested against).

Weights are kept in the compute dtype (fp32 by default). With `use_int4` (`weight_format="auto"`), GGUF linears
of the fp32 backend run on faster kernels instead: Q4_0/Q4_1 on torch's int4 weight-only CPU kernel
(`aten._weight_int4pack_mm_for_cpu`, group size 32, the GGUF block size), which reads 8x fewer bytes than fp32
and batches well; the other quantized types (Q8_0: the default model's tied lm_head) as bf16 weights on oneDNN's
bf16 GEMM where torch reports it supported (`cpu_bf16`: the lm_head's logits that could be a row's largest are
recomputed exactly). A quantized lm_head takes that path too where it can (Q4: else the int4 kernel).
`weight_format="float"` keeps the fp32 reference path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from voltserve.backends.base import AttentionMetadata, rope_then_attention


def rope_cos_sin(head_dim: int, max_positions: int, theta: float) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos of each frequency in the first half, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


class CpuBackend:
    """Reference ops on torch CPU tensors. See `voltserve.backends.base.Backend` for each op's contract."""

    def __init__(self, dtype: torch.dtype = torch.float32, use_int4: bool = False, batch_invariant: bool = True):
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.use_int4 = use_int4
        self.batch_invariant = batch_invariant
        if use_int4 and dtype == torch.float32:  # other quantized linears and the lm_head on bf16 (`cpu_bf16`)
            from voltserve.backends.cpu_bf16 import bf16_gemm_supported

            self.use_bf16 = bf16_gemm_supported()
        else:
            self.use_bf16 = False

    # -- weights -------------------------------------------------------------------------------------------

    def prepare_linear(self, weight: torch.Tensor, quant: Any | None = None, swiglu: bool = False,
                       norm: torch.Tensor | None = None, logits: bool = False) -> Any:
        if self.use_int4 and quant is not None:
            from voltserve.backends.cpu_bf16 import Bf16Linear, Bf16Logits
            from voltserve.backends.cpu_int4 import Int4Linear, supports

            if logits and self.use_bf16:
                return Bf16Logits(weight)
            if supports(quant):
                return Int4Linear.from_quantized(quant, self.dtype)
            if self.use_bf16:
                return Bf16Linear(weight)
        return weight.to(self.dtype).contiguous()

    def prepare_embedding(self, weight: torch.Tensor, quant: Any | None = None) -> Any:
        return weight.to(self.dtype).contiguous()

    def prepare_norm(self, weight: torch.Tensor) -> torch.Tensor:
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
        """The RoPE half of rotary_write_kv (its argument conventions): rotated (q, k), new tensors."""
        half = cos_sin.shape[-1] // 2
        cs = cos_sin[positions]
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        return _apply_rotary(q, cos, sin, style), _apply_rotary(k, cos, sin, style)

    def linear(self, x, weight, residual=None):
        if not isinstance(weight, torch.Tensor):
            y = weight(x)  # Int4Linear, Bf16Linear: batch invariant already
        elif not self.batch_invariant:
            y = F.linear(x, weight)
        else:
            y = fixed_shape_linear(x, weight)
        return y if residual is None else y + residual

    def norm_linear(self, x, norm_weight, eps, weight, silu=False, then=None):
        y = self.linear(self.rms_norm(x, norm_weight, eps)[0], weight)
        return self.silu_and_mul(y) if silu else y

    def rotary_write_kv(self, q, k, v, positions, cos_sin, style, kv_layer, slot_mapping):
        q, k = self.rotary(q, k, positions, cos_sin, style)
        self.write_kv(k, v, kv_layer, slot_mapping)
        return q

    def rope_attention(self, q, k, v, positions, cos_sin, style, kv_layer, attn: AttentionMetadata, scale,
                       out_linear=None):
        return rope_then_attention(self, q, k, v, positions, cos_sin, style, kv_layer, attn, scale)

    def write_kv(self, k, v, kv_layer, slot_mapping):
        """The cache half of rotary_write_kv: k, v [num_tokens, num_kv_heads, head_dim] into kv_layer at
        slot_mapping (-1 skipped)."""
        num_blocks, block_size = kv_layer.shape[1], kv_layer.shape[2]
        flat = kv_layer.view(2, num_blocks * block_size, *kv_layer.shape[3:])
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
        flat[0, slot_mapping] = k.to(kv_layer.dtype)
        flat[1, slot_mapping] = v.to(kv_layer.dtype)

    def attention(self, q, kv_layer, attn: AttentionMetadata, scale):
        """Every query token is one row of the same batched math (decode and prefill alike), over a key span that
        depends only on its own number of keys (`key_span`), so a token's output does not depend on how its
        sequence was chunked or batched (see `_attend`)."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
        qg = q.view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = torch.empty_like(q)
        tables = attn.block_tables
        decodes: dict[int, list[tuple[int, int, int]]] = {}  # span -> (token row, sequence, keys)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(attn.query_lens_cpu, attn.seq_lens_cpu)):
            if q_len == 1:
                decodes.setdefault(key_span(seq_len), []).append((start, i, seq_len))
            elif q_len > 1:
                self._attend_chunk(qg, out, start, q_len, seq_len, kv_layer, tables[i:i + 1], scale)
            start += q_len
        # one-token rows (decodes) of all sequences, batched per span: gathered K/V rows are each their own
        for span, rows in decodes.items():
            idx = torch.tensor([r for r, _, _ in rows])
            k, v = _gather_kv(kv_layer, _span_tables(tables[[s for _, s, _ in rows]], span, block_size))
            lens = torch.tensor([n for _, _, n in rows])
            out[idx] = _attend(qg[idx], k[:, :, :span], v[:, :, :span], lens, scale).view(len(rows), num_heads,
                                                                                          head_dim)
        return out

    @staticmethod
    def _attend_chunk(qg, out, start, q_len, seq_len, kv_layer, table, scale) -> None:
        """The q_len >= 2 query rows of one sequence (token j sits at position seq_len - q_len + j and sees keys
        0..that position); rows of one span share the sequence's K/V, their scores ~16 MiB at a time."""
        num_heads, head_dim = out.shape[1], out.shape[2]
        block_size = kv_layer.shape[2]
        lens = torch.arange(seq_len - q_len + 1, seq_len + 1)
        k, v = _gather_kv(kv_layer, _span_tables(table, key_span(seq_len), block_size))
        j = 0
        while j < q_len:
            span = key_span(int(lens[j]))
            # lens grow by one a row: rows up to `span` keys share the span
            end = min(q_len, j + span - int(lens[j]) + 1, j + max(1, 2**22 // (num_heads * span)))
            o = _attend(qg[start + j:start + end], k[:, :, :span], v[:, :, :span], lens[j:end], scale)
            out[start + j:start + end] = o.view(end - j, num_heads, head_dim)
            j = end

    def silu_and_mul(self, x):
        inner = x.shape[-1] // 2
        return F.silu(x[:, :inner]) * x[:, inner:]

    def allocate_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim):
        return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=self.dtype)


# A query row attends over a key span (its own keys, the rest masked) that depends on its number of keys alone:
# the softmax and P @ V reductions of a row then have a length no other row of the step can change. Padding a row
# to the longest context of the step instead changed its sums with the vector kernels of AVX-512 CPUs (a batched
# decode's greedy tokens differed from the same request run alone). Powers of two keep a step's decode rows in a
# few span groups (one gather and one batched product each) for at most 2x the keys.
MIN_KEY_SPAN = 64


def key_span(num_keys: int) -> int:
    """The key span of a query row that sees `num_keys` keys: the next power of two, at least MIN_KEY_SPAN."""
    return max(MIN_KEY_SPAN, 1 << (num_keys - 1).bit_length())


def _span_tables(tables: torch.Tensor, span: int, block_size: int) -> torch.Tensor:
    """The first blocks of `tables` [rows, max_blocks] int32 that cover `span` keys, padded with -1 columns
    where the table is narrower (`_gather_kv` reads block 0 there; those keys are masked)."""
    need = -(-span // block_size)
    if need <= tables.shape[1]:
        return tables[:, :need]
    return torch.cat([tables, tables.new_full((tables.shape[0], need - tables.shape[1]), -1)], dim=1)


def _gather_kv(kv_layer: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tables [rows, blocks] int32 (-1 padded) -> K, V [rows, kv_heads, blocks * block_size, head_dim], contiguous."""
    rows, blocks = tables.shape
    ids = tables.long().clamp_min(0).flatten()  # padded entries are masked by length later
    num_blocks, block_size, kv_heads, head_dim = kv_layer.shape[1:]
    k, v = (kv_layer[i].view(num_blocks, -1).index_select(0, ids)
            .view(rows, blocks * block_size, kv_heads, head_dim).transpose(1, 2).contiguous() for i in (0, 1))
    return k, v


def _attend(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v for rows that each attend to their first `lens[row]` keys.

    Args:
        qg: [rows, kv_heads, group, head_dim] queries, grouped by the KV head they share (GQA).
        k, v: [rows, kv_heads, ctx, head_dim] contiguous, or [1, kv_heads, ctx, head_dim]: one sequence's K/V
            shared by all rows (its prefill chunk).
        lens: [rows] int64, valid keys per row (<= ctx).
    Returns:
        [rows, kv_heads, group, head_dim] in qg's dtype. Each row's products are matrices of their own whose shapes
        depend only on ctx, and the callers pass ctx = `key_span` of the row's own keys, so a row's result is the
        same whatever else is in the batch.
    """
    rows, kv_heads = qg.shape[0], qg.shape[1]
    mask = (torch.arange(k.shape[2])[None, :] >= lens[:, None])[:, None, None, :]
    if k.shape[0] == rows:
        scores = torch.matmul(qg.to(k.dtype), k.transpose(-1, -2)).float() * scale
        scores.masked_fill_(mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v).to(qg.dtype)
    # shared K/V: one bmm per KV head over K/V expanded to the rows, each row's product on its own (torch.matmul
    # would fold the rows into one GEMM, whose sums then depend on the row count)
    out = torch.empty(qg.shape, dtype=qg.dtype)
    for h in range(kv_heads):
        kh, vh = k[:, h].expand(rows, -1, -1), v[:, h].expand(rows, -1, -1)
        scores = torch.bmm(qg[:, h].to(k.dtype), kh.transpose(1, 2)).float() * scale
        scores.masked_fill_(mask[:, 0], float("-inf"))
        out[:, h] = torch.bmm(torch.softmax(scores, -1).to(v.dtype), vh).to(qg.dtype)
    return out


LINEAR_ROW_CHUNK = 4


def fixed_shape_linear(x: torch.Tensor, weight: torch.Tensor, rows: int = LINEAR_ROW_CHUNK) -> torch.Tensor:
    """x @ weight^T computed `rows` rows at a time (last chunk zero-padded).

    BLAS picks its kernel and blocking by shape, so a row's result would otherwise depend on how many other rows
    share the step; one fixed shape makes every row's logits the same whether it runs alone or batched (greedy
    output of concurrent requests equals that of sequential ones).
    """
    num_rows = x.shape[0]
    pad = -num_rows % rows
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([F.linear(chunk, weight) for chunk in x.split(rows)])
    return out[:num_rows]


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    xf = x.float()
    if style == "neox":
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)
