"""Megatron-style slicing of dense and GGUF block-quantized linears (voltserve.distributed.sharding), and the
ConfigErrors of shapes that cannot be split."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tests.e2e.tp_helpers import dequantized
from tools.make_synthetic_checkpoint import quant_blocks, synthetic_model
from voltserve.backends.cpu import CpuBackend
from voltserve.distributed.sharding import column_shard, local_heads, row_shard, split_range
from voltserve.errors import ConfigError
from voltserve.models.llama import LlamaModel
from voltserve.quant import QuantizedTensor


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_shards_dequantize_to_dense_shards(qtype):
    quant = QuantizedTensor(qtype, (6, 128), quant_blocks(qtype, 6, 128, np.random.default_rng(0)))
    dense = dequantized(quant)
    w, q = column_shard(dense, quant, 2, 5)
    assert q.shape == (3, 128) and torch.equal(dequantized(q), dense[2:5]) and torch.equal(w, dense[2:5])
    w, q = row_shard(dense, quant, 64, 128)
    assert q.shape == (6, 64) and torch.equal(dequantized(q), dense[:, 64:]) and torch.equal(w, dense[:, 64:])
    assert w.is_contiguous() and q.data.flags.c_contiguous


def test_row_shard_off_block_boundary_raises():
    quant = QuantizedTensor("Q8_0", (2, 64), quant_blocks("Q8_0", 2, 64, np.random.default_rng(0)))
    with pytest.raises(ConfigError, match=r"down_proj is Q8_0 .* slice 16:48 .* multiple of 32"):
        row_shard(torch.zeros(2, 64), quant, 16, 48, name="down_proj")
    assert row_shard(torch.ones(2, 64), None, 16, 48)[0].shape == (2, 32)  # dense: any cut


def test_split_range_and_heads():
    assert [split_range(12, r, 3, "x") for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    cfg = synthetic_model("tiny").config  # 4 heads, 2 KV heads
    assert local_heads(cfg, 2) == (2, 1)
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(2\) must divide by tensor_parallel_size \(4\)"):
        local_heads(cfg, 4)


def test_model_refuses_unsplittable_quantized_down():
    """tiny's intermediate_size 160 gives each of 2 ranks 80 inputs of down_proj: not whole blocks of 32."""
    loaded = synthetic_model("tiny", qtype="Q4_1")
    rank0 = types.SimpleNamespace(rank=0, world_size=2)  # building a model runs no collective
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.down_proj.weight is Q4_1 .* slice 0:80"):
        LlamaModel(loaded.config, loaded.tensors, CpuBackend(), loaded.quantized, max_positions=64, tp=rank0)


def test_rank_holds_its_share_of_heads_and_inner_features():
    loaded = synthetic_model("tiny_tp")  # 8 heads, 4 KV heads, head_dim 16, hidden 128, inner 256
    model = LlamaModel(loaded.config, loaded.tensors, CpuBackend(), max_positions=64,
                       tp=types.SimpleNamespace(rank=1, world_size=2))
    assert (model.num_heads, model.num_kv_heads) == (4, 2)
    layer, t = model.layers[0], loaded.tensors
    p = "model.layers.0."
    q, k, v = (t[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(layer.qkv, torch.cat([q[64:128], k[32:64], v[32:64]]))
    assert torch.equal(layer.o_proj, t[p + "self_attn.o_proj.weight"][:, 64:128])
    assert torch.equal(layer.gate_up, torch.cat([t[p + "mlp.gate_proj.weight"][128:],
                                                 t[p + "mlp.up_proj.weight"][128:]]))
    assert torch.equal(layer.down, t[p + "mlp.down_proj.weight"][:, 128:])
