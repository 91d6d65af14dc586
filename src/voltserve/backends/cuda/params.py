"""ctypes mirrors of the kernels' params structs (ptx/*.cu), field for field.

Each launcher passes `-D<NAME>=ctypes.sizeof(mirror)`; the kernel's `static_assert` then fails to compile if the
two layouts drift apart (STYLE.md 8.3). Field order and types follow the C structs exactly.
"""

from __future__ import annotations

import ctypes

P = ctypes.c_void_p
I64 = ctypes.c_int64
I32 = ctypes.c_int32
F32 = ctypes.c_float
U64 = ctypes.c_uint64


def _struct(name: str, fields: list[tuple[str, type]]) -> type[ctypes.Structure]:
    return type(name, (ctypes.Structure,), {"_fields_": fields})


EmbeddingParams = _struct("EmbeddingParams", [
    ("token_ids", P), ("table", P), ("out", P), ("num_tokens", I32), ("hidden", I32), ("vocab", I32),
    ("row_bytes", I32)])

RmsNormParams = _struct("RmsNormParams", [
    ("x", P), ("residual", P), ("weight", P), ("out", P), ("residual_out", P), ("x_stride", I64),
    ("residual_stride", I64), ("num_tokens", I32), ("hidden", I32), ("eps", F32), ("vec_ok", I32)])

RopeKvParams = _struct("RopeKvParams", [
    ("q", P), ("k", P), ("v", P), ("q_out", P), ("kv", P), ("positions", P), ("slot_mapping", P), ("cos_sin", P),
    ("q_token_stride", I64), ("k_token_stride", I64), ("v_token_stride", I64), ("kv_plane", I64),
    ("num_tokens", I32), ("num_heads", I32), ("num_kv_heads", I32), ("head_dim", I32), ("interleaved", I32),
    ("max_positions", I32)])

SiluMulParams = _struct("SiluMulParams", [
    ("x", P), ("out", P), ("x_stride", I64), ("num_tokens", I32), ("inner", I32)])

DecodeParams = _struct("DecodeParams", [
    ("q", P), ("kv", P), ("block_tables", P), ("seq_lens", P), ("query_start_loc", P), ("out", P),
    ("part_acc", P), ("part_ml", P), ("counters", P), ("q_token_stride", I64), ("q_head_stride", I64),
    ("kv_plane", I64), ("num_seqs", I32), ("num_heads", I32), ("num_kv_heads", I32), ("block_size", I32),
    ("max_blocks", I32), ("num_splits", I32), ("scale", F32), ("min_part", I32), ("k_new", P), ("v_new", P),
    ("positions", P), ("slot_mapping", P), ("cos_sin", P), ("k_token_stride", I64), ("v_token_stride", I64),
    ("max_positions", I32), ("interleaved", I32), ("xq", P), ("xq_fmt", I32), ("xq_rows", I32),
    ("step_splits", P), ("mixed", I32)])

PrefillParams = _struct("PrefillParams", [
    ("q", P), ("kv", P), ("block_tables", P), ("seq_lens", P), ("query_start_loc", P), ("out", P),
    ("q_token_stride", I64), ("q_head_stride", I64), ("kv_plane", I64), ("num_seqs", I32), ("num_heads", I32),
    ("num_kv_heads", I32), ("block_size", I32), ("max_blocks", I32), ("scale", F32), ("min_query_len", I32),
    ("k_new", P), ("v_new", P), ("positions", P), ("slot_mapping", P), ("cos_sin", P), ("k_token_stride", I64),
    ("v_token_stride", I64), ("max_positions", I32), ("interleaved", I32)])

GemvParams = _struct("GemvParams", [
    ("x", P), ("w", P), ("y", P), ("res", P), ("norm_w", P), ("x_stride", I64), ("y_stride", I64),
    ("w_row_bytes", I64), ("m", I32), ("n", I32), ("k", I32), ("vec_ok", I32), ("eps", F32), ("prefetch_bytes", I32),
    ("xq", P), ("stages", I32), ("stage_spans", I32), ("part", P), ("kb_begin", I32), ("kb_end", I32),
    ("part_in", I32), ("part_out", I32), ("xq_out", P), ("xq_out_fmt", I32)])

# gemv_chain.cu: ChainParams holds CHAIN_MAX_PHASES ChainPhase by value
ChainPhase = _struct("ChainPhase", [
    ("x", P), ("w", P), ("y", P), ("res", P), ("n", I32), ("k", I32), ("norm_post", I32), ("silu_out", I32)])

CHAIN_MAX_PHASES = 4

ChainParams = _struct("ChainParams", [
    ("phase", ChainPhase * CHAIN_MAX_PHASES), ("barrier", P), ("trace", P), ("num_phases", I32), ("stages", I32),
    ("stage_spans", I32), ("max_k", I32), ("eps", F32)])

GemmParams = _struct("GemmParams", [
    ("x", P), ("w", P), ("y", P), ("x_stride", I64), ("y_stride", I64), ("w_row_bytes", I64), ("m", I32),
    ("n", I32), ("k", I32), ("pad_", I32)])

GemmTcParams = _struct("GemmTcParams", [
    ("x", P), ("w", P), ("y", P), ("part", P), ("counters", P), ("x_stride", I64), ("y_stride", I64),
    ("w_row_bytes", I64), ("m", I32), ("n", I32), ("k", I32), ("k_split", I32), ("splits", I32), ("pad_", I32)])

ArgmaxParams = _struct("ArgmaxParams", [
    ("logits", P), ("out_ids", P), ("out_logprobs", P), ("part", P), ("counters", P), ("row_stride", I64),
    ("num_rows", I32), ("vocab", I32), ("chunk", I32), ("pad_", I32)])

# sample_topk_topp.cu: one SampleRowParams per row (device array), SampleParams by value
SampleRowParams = _struct("SampleRowParams", [
    ("seed", U64), ("offset", U64), ("temperature", F32), ("top_p", F32), ("min_p", F32), ("top_k", I32),
    ("num_logprobs", I32), ("draft", I32)])

SampleParams = _struct("SampleParams", [
    ("logits", P), ("rows", P), ("out_ids", P), ("out_logprobs", P), ("out_top_ids", P), ("out_top_logprobs", P),
    ("row_stride", I64), ("num_rows", I32), ("vocab", I32), ("out_passed", P), ("part", P), ("counters", P),
    ("hist", P)])
