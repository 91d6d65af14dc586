"""Megatron-style tensor-parallel slicing of linear weights, dense and GGUF block-quantized.

Source: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", section 3. A column-parallel linear keeps a slice of the output features (rows of the
[out_features, in_features] weight): its output is this rank's slice, no communication. A row-parallel linear keeps
a slice of the input features (columns): its output is a partial sum that one all-reduce completes. Pairing them
(qkv column -> attention per head -> o_proj row; gate_up column -> SwiGLU -> down row) costs one all-reduce per
half-block.

GGUF blocks run along the input features (voltserve.quant), so slicing output rows is exact for any row range,
and slicing input columns is exact when both ends fall on a block boundary (32 weights for the types kept packed).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from voltserve.config import ModelConfig
from voltserve.errors import ConfigError
from voltserve.quant import BLOCK_BYTES, BLOCK_SIZE, QuantizedTensor

if TYPE_CHECKING:  # annotations only: `split_range` / `local_heads` serve the torch-free preflight too
    import torch


def split_range(size: int, rank: int, world_size: int, what: str) -> tuple[int, int]:
    """[start, stop) of rank's equal share of `size` items.

    Raises:
        ConfigError: `size` does not divide by `world_size` (`what` names the dimension).
    """
    if size % world_size:
        raise ConfigError(f"tensor parallel: {what} ({size}) must divide by tensor_parallel_size ({world_size})")
    share = size // world_size
    return rank * share, (rank + 1) * share


def local_heads(config: ModelConfig, world_size: int) -> tuple[int, int]:
    """(attention heads, KV heads) of one rank: whole heads only, so attention runs per rank unchanged.

    Raises:
        ConfigError: num_heads or num_kv_heads does not divide by world_size (a KV head shared by two ranks
            would need its K/V on both, which this scheme does not do).
    """
    _, heads = split_range(config.num_heads, 0, world_size, "num_attention_heads")
    _, kv_heads = split_range(config.num_kv_heads, 0, world_size, "num_key_value_heads")
    return heads, kv_heads


# the linears whose input features (GGUF blocks' direction) are split over the ranks: row-parallel (the model's cuts)
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def check_block_split(name: str, qtype: str, in_features: int, world_size: int) -> None:
    """Check before the load that a row-parallel GGUF block-quantized weight splits into whole blocks: each rank
    takes in_features / world_size input features, which `row_shard` can cut only on block boundaries.

    Args:
        name: the weight's name, for the error.
        qtype: its GGUF type (a packed one: "Q4_0", "Q4_1", "Q8_0", blocks of BLOCK_SIZE weights).
        in_features: its input features (GGUF blocks run along them).
        world_size: tensor_parallel_size.
    Raises:
        ConfigError: in_features does not divide by world_size, or a rank's share is not a whole number of blocks.
    """
    start, stop = split_range(in_features, 0, world_size, f"{name}'s input features")
    if (stop - start) % BLOCK_SIZE:
        raise ConfigError(f"tensor parallel: {name} is {qtype} with blocks of {BLOCK_SIZE} input features; its "
                          f"{in_features} input features over tensor_parallel_size {world_size} give each rank "
                          f"{stop - start}, not whole blocks (the input size / tensor_parallel_size must be a "
                          f"multiple of {BLOCK_SIZE})")


def column_shard(weight: torch.Tensor, quant: QuantizedTensor | None, start: int,
                 stop: int, name: str = "weight") -> tuple[torch.Tensor, QuantizedTensor | None]:
    """Output rows start:stop of a linear (column-parallel); any rows: GGUF blocks never span two rows.

    Args:
        weight: [out_features, in_features] fp32, CPU.
        quant: its GGUF blocks [out_features, in_features / 32 * block_bytes] uint8, or None.
        name: the weight's name (`row_shard`'s signature; nothing here can fail).
    Returns:
        (weight [stop - start, in_features], quant of the same rows or None); views where possible.
    """
    if quant is None:
        return weight[start:stop], None
    return weight[start:stop], replace(quant, shape=(stop - start, quant.shape[1]), data=quant.data[start:stop])


def row_shard(weight: torch.Tensor, quant: QuantizedTensor | None, start: int,
              stop: int, name: str = "weight") -> tuple[torch.Tensor, QuantizedTensor | None]:
    """Input columns start:stop of a linear (row-parallel).

    Args:
        weight: [out_features, in_features] fp32, CPU.
        quant: its GGUF blocks, or None.
        name: the weight's name, for the error.
    Returns:
        (weight [out_features, stop - start] contiguous, quant of the same columns or None).
    Raises:
        ConfigError: `quant` is given and start or stop is not a multiple of its block size (32 weights): a block
            cannot be split, its scale covers all of it.
    """
    dense = weight[:, start:stop].contiguous()
    if quant is None:
        return dense, None
    if start % BLOCK_SIZE or stop % BLOCK_SIZE:
        raise ConfigError(f"tensor parallel: {name} is {quant.qtype} with blocks of {BLOCK_SIZE} input features; "
                          f"this rank's input slice {start}:{stop} does not fall on block boundaries (the input "
                          f"size / tensor_parallel_size must be a multiple of {BLOCK_SIZE})")
    nbytes = BLOCK_BYTES[quant.qtype]
    data = np.ascontiguousarray(quant.data[:, start // BLOCK_SIZE * nbytes:stop // BLOCK_SIZE * nbytes])
    return dense, replace(quant, shape=(quant.shape[0], stop - start), data=data)
