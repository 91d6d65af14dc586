"""Tensor-parallel LlamaModel on gloo CPU ranks == the same model at TP = 1: logits of a batched prefill and of
batched greedy decode steps, the greedy tokens, and the KV cache holding 1 / tp_size of the KV heads."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.tp_helpers import dequantized, prefill_decode
from tests.tp_ranks import run_ranks
from tools.make_synthetic_checkpoint import synthetic_model
from voltserve.backends.cpu import CpuBackend
from voltserve.models.llama import LlamaModel

PROMPTS = [[256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], [256, 84, 80, 33]]
NUM_DECODES = 4
# fp32: the row-parallel sums add two halves where TP = 1 adds one run, so logits move by a few ulps of the
# partial sums; measured max |diff| / max |logit| 2.5e-7..8.6e-7 (tiny, tiny_tp; fp32, Q8_0, Q4_1; TP 2 and 4)
FP32_RTOL = 1e-5


def loaded_model(shape: str, qtype: str | None):
    """The synthetic model; a quantized one gets its GGUF blocks dequantized into `tensors` too, so the fp32 path
    runs the quantized values (synthetic_model leaves zero placeholders there)."""
    loaded = synthetic_model(shape, qtype=qtype)
    for name, quant in loaded.quantized.items():
        loaded.tensors[name] = dequantized(quant)
    return loaded


def run_model(tp, shape: str, qtype: str | None, use_int4: bool) -> dict:
    """One rank's (or the TP = 1 reference's) prefill_decode results."""
    loaded = loaded_model(shape, qtype)
    backend = CpuBackend(use_int4=use_int4)
    model = LlamaModel(loaded.config, loaded.tensors, backend, loaded.quantized, max_positions=512, tp=tp)
    return prefill_decode(model, backend, PROMPTS, NUM_DECODES)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> float:
    """Every logit within rtol * max |logit| of the reference; returns the measured ratio."""
    ratio = float((got - want).abs().max() / want.abs().max())
    assert ratio <= rtol, f"max |diff| / max |logit| = {ratio:.3g} > {rtol}"
    return ratio


def check_tp(tmp_path, world_size: int, shape: str, qtype: str | None = None, use_int4: bool = False,
             rtol: float = FP32_RTOL) -> None:
    want = run_model(None, shape, qtype, use_int4)
    ranks = run_ranks(world_size, run_model, (shape, qtype, use_int4), tmp_path)
    kv_heads = synthetic_model(shape).config.num_kv_heads
    for got in ranks:
        assert_logits_close(got["prefill"], want["prefill"], rtol)
        assert_logits_close(got["decode"], want["decode"], rtol)
        assert got["tokens"] == want["tokens"]
        assert got["kv_shape"][4] == kv_heads // world_size and want["kv_shape"][4] == kv_heads
        # every rank holds the same whole logits (replicated lm_head on an all-reduced h)
        assert torch.equal(got["decode"], ranks[0]["decode"])


def test_tp2_fp32_tiny(tmp_path):
    check_tp(tmp_path, 2, "tiny")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_tp2_quantized_values_fp32(tmp_path, qtype):
    """GGUF-quantized linears (dequantized, fp32 math): the shards of `tensors` and of the blocks match."""
    check_tp(tmp_path, 2, "tiny_tp", qtype)


def test_tp2_q4_1_int4_kernel(tmp_path):
    """The CPU int4 kernel runs on the sharded GGUF blocks themselves (column slices of rows, row-parallel
    slices on block boundaries). Its activations and outputs are bf16, so each row-parallel partial sum is rounded
    to bf16 before the all-reduce: TP moves the logits by about as much as the kernel's own bf16 error (measured:
    TP = 2 vs TP = 1 ~9e-3 of the largest logit; TP = 1 int4 vs the fp32 reference ~1.1e-2)."""
    check_tp(tmp_path, 2, "tiny_tp", "Q4_1", use_int4=True, rtol=2e-2)


def test_tp4_fp32(tmp_path):
    """Four ranks on two cores (~3 s): one KV head each, two query heads sharing it (GQA inside a rank)."""
    check_tp(tmp_path, 4, "tiny_tp")
