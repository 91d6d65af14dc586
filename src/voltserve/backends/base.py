"""The Backend interface the model code is written against, and the per-step inputs it consumes.

Layouts (shared by every backend):
- KV cache of one layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 = K, 1 = V).
- slot = block_id * block_size + offset_in_block; slot -1 = do not write (padding).
- Tokens of a step are flat: sequence i owns rows query_start_loc[i]:query_start_loc[i+1]; its new tokens are
  the last `query_len` positions of its `seq_len` context (chunked prefill and decode look the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


# The longest query span of an eager verify step whose rows run as decodes (`AttentionMetadata.rows_as_decodes`):
# a verify's 1 + k tokens, not a prompt chunk beside it (each row reads its whole context, where a prefill
# kernel shares its key tiles among up to 16 rows).
ROWS_AS_DECODES_MAX_QUERY = 16


@dataclass
class AttentionMetadata:
    """Where each sequence's queries and keys live for one step.

    Attributes:
        query_start_loc: [num_seqs + 1] int32; row offsets of each sequence's new tokens.
        seq_lens: [num_seqs] int32; context length of each sequence after this step (cached + new tokens).
        block_tables: [num_seqs, max_blocks_per_seq] int32; KV block ids, -1 padded.
        slot_mapping: [num_tokens] int64; KV slot each new token's K/V is written to.
        max_query_len: max of the query lengths (1 for a decode-only step).
        max_seq_len: max of seq_lens, or a bound on it (a CUDA graph's capacity, max_model_len).
        query_lens_cpu / seq_lens_cpu: the same lengths as Python lists (host-side loops, no device sync).
        split_decode: a step mixing decodes with prefills: a backend may run the sequences with one query token
            through its decode kernel and the others through its prefill kernel (values are the same either
            way, up to rounding).
        decode_splits: [1] int32 on the device, or None: where `max_seq_len` is only a bound (a CUDA graph's
            capacity, max_model_len), the split count the backend's decode attention planned on the host for this
            step's longest context (`CudaBackend.graph_decode_splits`; <= 0: none, plan for `max_seq_len`).
            Written only by host-to-device copies: the kernel reads it before its PDL wait.
        rows_as_decodes: a step of short query spans (a verify of drafts, decodes beside it; a verify CUDA
            graph): a backend may run every query row as a decode of the keys up to its own position (values
            the same up to rounding).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    split_decode: bool = False
    decode_splits: torch.Tensor | None = None
    rows_as_decodes: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class StepInputs:
    """Flat inputs of one forward step.

    Attributes:
        input_ids: [num_tokens] int64; token ids of every sequence's new tokens, concatenated.
        positions: [num_tokens] int64; absolute position of each token in its sequence.
        attn: AttentionMetadata for the step.
        logits_indices: [num_logits] int64; rows of the final hidden state whose logits are needed
            (the last new token of each sequence that samples this step).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor


class Backend(Protocol):
    """Ops the model calls. Each backend keeps its own weight representation (`prepare_*`).

    All activations are `[num_tokens, ...]` tensors in the backend's `dtype` on its `device`.
    """

    device: torch.device
    dtype: torch.dtype

    def prepare_linear(self, weight: torch.Tensor, quant: Any | None = None, swiglu: bool = False,
                       norm: torch.Tensor | None = None, logits: bool = False) -> Any:
        """Turn a checkpoint weight into this backend's linear operand.

        Args:
            weight: [out_features, in_features] fp32, CPU (dequantized reference values).
            quant: the raw quantized tensor (loaders.gguf.QuantizedTensor) when the checkpoint had one,
                so a backend can run on the packed blocks instead of `weight`.
            swiglu: the weight is a fused [gate; up] pair that `norm_linear(..., silu=True)` will read (a backend
                may store it in the layout its SwiGLU kernel reads best).
            norm: [in_features] fp32, CPU: the weight of the RMSNorm that every `norm_linear` on this linear applies
                first (the caller passes that same norm weight there). A backend may fold it into the weight
                (the CUDA backend's fp16 GEMVs then scale by 1/rms after the product); such a linear is read by
                norm_linear only. Backends that do not fold ignore it.
            logits: the model's lm_head, whose outputs sampling reads: a backend that computes linears in a
                lower precision keeps the logits that decide greedy sampling exact (the CPU's `cpu_bf16`).
        """

    def prepare_embedding(self, weight: torch.Tensor, quant: Any | None = None) -> Any:
        """Token embedding table: weight [vocab_size, hidden_size] fp32, CPU."""

    def prepare_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm weight [hidden_size] fp32, CPU, as the backend's rms_norm reads it."""

    def embedding(self, token_ids: torch.Tensor, table: Any) -> torch.Tensor:
        """token_ids [num_tokens] int64 -> [num_tokens, hidden_size]."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm fused with the residual add.

        Returns (rms_norm(x + residual) * weight, x + residual); with residual None, (rms_norm(x) * weight, x).
        """

    def linear(self, x: torch.Tensor, weight: Any, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [num_tokens, in_features] @ weight^T (+ residual [num_tokens, out_features]) -> [num_tokens,
        out_features], a new tensor. The product is rounded to the activation dtype before the residual add."""

    def norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: Any,
                    silu: bool = False, then: Any = None) -> torch.Tensor:
        """linear(rms_norm(x, norm_weight, eps)[0], weight), and with `silu` then silu_and_mul: one fused op on
        backends that can (the decode GEMV normalizes x in its prologue).

        Args:
            x: [num_tokens, in_features]; norm_weight: [in_features] (from prepare_norm); where prepare_linear
                folded this norm into `weight` (its `norm`), the backend does not read it again (pass the same
                norm), and `linear` on such a weight raises ValueError.
            weight: a linear; with `silu` the fused [gate; up] weight.
            then: the linear the caller applies next to the output, or None: a hint a backend may use to hand
                that next op its input in the form it reads (the CUDA backend's quantized x); ignored elsewhere.
        Returns:
            [num_tokens, out_features], or [num_tokens, out_features / 2] with `silu`.
        """

    def rotary_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, style: str, kv_layer: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotary position embedding (RoFormer, Su et al. 2021) of q and k, and the rotated k and v scattered into
        the paged KV cache of one layer.

        Args:
            q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
            positions: [num_tokens] int64.
            cos_sin: [max_positions, head_dim] fp32; first half cos, second half sin of each frequency.
            style: "neox" rotates (x[:d/2], x[d/2:]); "interleaved" rotates pairs (x[2i], x[2i+1]).
            kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; written at slot_mapping.
            slot_mapping: [num_tokens] int64; -1 = do not write (padding).
        Returns:
            the rotated q, [num_tokens, num_heads, head_dim].
        """

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        """Causal attention of the new tokens over each sequence's paged context (GQA).

        Args:
            q: [num_tokens, num_heads, head_dim].
            kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim], already holding this step's K/V.
        Returns:
            [num_tokens, num_heads, head_dim].
        """

    def rope_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos_sin: torch.Tensor, style: str, kv_layer: torch.Tensor, attn: AttentionMetadata,
                       scale: float, out_linear: Any = None) -> torch.Tensor:
        """rotary_write_kv (at attn.slot_mapping) then attention: one fused op on backends that can (the CUDA
        decode kernel rotates q and the new key itself); `rope_then_attention` is the unfused composition.

        Args:
            q: [num_tokens, num_heads, head_dim], not rotated; k, v: [num_tokens, num_kv_heads, head_dim].
            positions, cos_sin, style, kv_layer: as rotary_write_kv; attn, scale: as attention.
            out_linear: the linear the caller applies next to the output viewed as [num_tokens, num_heads *
                head_dim] (o_proj), a hint: a backend may prepare that call's input while writing the output
                (CUDA: int8 x for gemv_s8); the result is the same either way.
        Returns:
            [num_tokens, num_heads, head_dim]; kv_layer holds the rotated k and v at attn.slot_mapping.
        """

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, 2 * inner] -> silu(x[:, :inner]) * x[:, inner:]."""

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] zeros in the KV dtype."""


def rope_then_attention(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, style: str, kv_layer: torch.Tensor, attn: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """`Backend.rope_attention` as two ops, rotary_write_kv then attention: the reference the fused op matches."""
    q = backend.rotary_write_kv(q, k, v, positions, cos_sin, style, kv_layer, attn.slot_mapping)
    return backend.attention(q, kv_layer, attn, scale)


def decoder_tail(backend: Backend, o: torch.Tensor, h: torch.Tensor, o_proj: Any, post_norm: torch.Tensor,
                 gate_up: Any, down: Any, eps: float, then: tuple[torch.Tensor, Any] | None = None,
                 tp: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pre-norm SwiGLU decoder block after attention (Llama), and optionally the linear after the next RMSNorm:
    h1 = h + o . Wo^T, h2 = h1 + silu_and_mul(norm_linear(h1, post_norm, gate_up)) . Wd^T, and with `then` =
    (norm weight, linear) also norm_linear(h2, *then) (the next layer's qkv, or the lm_head). A backend with
    `fused_decoder_tail` (same arguments, None where it cannot) runs it as one op (the CUDA backend: one persistent
    launch at one row, ptx/gemv_chain.cu); this composition is the reference.

    With a tensor-parallel group `tp` of more than one rank, o_proj and down are row-parallel (Megatron-LM,
    Shoeybi et al. 2019): each product is this rank's partial sum, all-reduced before the residual add, so h
    stays whole and equal on every rank; the fused op (which has no all-reduce inside) is not used then.

    Args:
        o: [num_tokens, heads * head_dim] attention output (this rank's heads); h: [num_tokens, hidden] the
            residual stream.
        tp: a `voltserve.distributed.TPGroup`, or None (TP = 1).
    Returns:
        (h2 [num_tokens, hidden], then's output [num_tokens, then's out_features] or None).
    """
    if tp is not None and tp.world_size > 1:
        h = h + tp.all_reduce(backend.linear(o, o_proj))
        h = h + tp.all_reduce(backend.linear(backend.norm_linear(h, post_norm, eps, gate_up, silu=True), down))
        return h, None if then is None else backend.norm_linear(h, then[0], eps, then[1])
    fused = getattr(backend, "fused_decoder_tail", None)
    out = fused(o, h, o_proj, post_norm, gate_up, down, eps, then) if fused is not None else None
    if out is not None:
        return out
    h = backend.linear(o, o_proj, residual=h)
    h = backend.linear(backend.norm_linear(h, post_norm, eps, gate_up, silu=True, then=down), down, residual=h)
    return h, None if then is None else backend.norm_linear(h, then[0], eps, then[1])
