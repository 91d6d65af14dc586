"""Paged KV block pool with prefix caching.

Blocks are plain ints indexing the KV tensor's block axis. A full block can be registered under a hash of its
tokens chained with its parent block's hash, so a later request with the same prefix reuses it (the idea of vLLM's
automatic prefix caching, Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention").
Free blocks that still hold a registered prefix stay findable until they are evicted, least recently freed first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from voltserve.errors import ConfigError

if TYPE_CHECKING:
    from voltserve.config import ModelConfig

# bytes of one KV element on the CPU backend, whose KV pool has its compute dtype (`EngineConfig.dtype`)
CPU_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def pool_block_bytes(cfg: ModelConfig, block_size: int, dtype_bytes: int,
                     kv_heads: int | None = None) -> int:
    """Bytes of one KV block across all layers (K and V) holding `kv_heads` KV heads (None: all of the model's;
    a TP rank holds its share)."""
    heads = cfg.num_kv_heads if kv_heads is None else kv_heads
    return cfg.num_layers * 2 * block_size * heads * cfg.head_dim * dtype_bytes


def blocks_in_memory(memory_gb: float, one_block_bytes: int) -> int:
    """KV blocks that `memory_gb` GiB hold (the CPU backend's pool when `num_kv_blocks` is 0).

    Raises:
        ConfigError: not even one.
    """
    blocks = int(memory_gb * 2**30 // one_block_bytes)
    if blocks < 1:
        raise ConfigError(f"kv_cache_memory_gb {memory_gb:g} GiB holds no KV block (one takes "
                          f"{one_block_bytes / 2**20:.2f} MiB); give the pool more memory or set num_kv_blocks")
    return blocks


def pool_max_model_len(max_model_len: int, model_len: int, num_blocks: int, block_size: int) -> int:
    """The context window an engine with a pool of `num_blocks` blocks serves: `max_model_len` when set (> 0),
    else the model's own `model_len` capped to the pool's tokens.

    Raises:
        ConfigError: a `max_model_len` set above what the pool holds (one sequence must fit).
    """
    tokens = num_blocks * block_size
    if max_model_len > tokens:
        raise ConfigError(f"the KV pool ({num_blocks} blocks of {block_size} tokens = {tokens} tokens) cannot hold "
                          f"one sequence of max_model_len {max_model_len}; give it more memory or blocks, or lower "
                          "max_model_len")
    return max_model_len or min(model_len, tokens)


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block: its tokens chained with the hash of the block before it (None for the first).

    SHA-256 (FIPS 180-4) of the parent's digest and the token ids as little-endian int64, as a 256-bit int. Not
    Python's hash(): its tuple and int hashes are invertible and fold ints modulo 2**61 - 1, so a prompt could be
    crafted to collide with another request's block and read or poison its cached K/V (vLLM's CVE-2025-25183).
    Raises OverflowError for a parent_hash that is not such a digest (negative or over 256 bits).
    """
    head = b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(32, "big")
    data = head + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def chain_hashes(hashes: list[int], tokens_in: Callable[[int, int], Sequence[int]], num_blocks: int,
                 block_size: int) -> list[int]:
    """Extend `hashes`, the hash chain (`hash_block`) of a token sequence's leading full blocks, to `num_blocks`
    blocks and return it. The list is the sequence's cache: each block is hashed once, however often its hash is
    asked for (admission, re-admission after a preemption, registration once its K/V is computed), and the n
    choices of a request share their prompt's (`Sequence.block_hash_chain`); whoever changes tokens of a hashed
    block must cut the list there (`Sequence.truncate_output`).

    Args:
        hashes: the chain so far (extended in place).
        tokens_in: (start, end) -> the sequence's token ids at positions [start, end), all known.
        num_blocks / block_size: full blocks wanted / tokens per block.
    """
    while len(hashes) < num_blocks:
        start = len(hashes) * block_size
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens_in(start, start + block_size)))
    return hashes


# (num_blocks, block_size) -> a sequence's hash chain (`chain_hashes`) of at least its num_blocks leading full
# blocks: `voltserve.sequence.Sequence.block_hash_chain`
HashChain = Callable[[int, int], list[int]]


class NoFreeBlocksError(RuntimeError):
    """Internal: the pool ran dry (the scheduler preempts before this can reach a request)."""


class BlockPool:
    """Reference-counted KV blocks, a free list in LRU order and a prefix-hash index.

    Args:
        num_blocks: blocks in the KV tensor.
        block_size: tokens per block.
        enable_prefix_caching: keep freed full blocks findable by hash until evicted.
    Raises:
        ConfigError: num_blocks or block_size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"need at least one KV block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        # ref-count-0 blocks; first = least recently freed = evicted first
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached or not): what allocation can use."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self) -> int:
        """Take the least recently freed block, evicting its cached prefix. Raises NoFreeBlocksError."""
        if not self._free:
            raise NoFreeBlocksError("KV block pool is empty")
        block, _ = self._free.popitem(last=False)
        old_hash = self._block_hash[block]
        if old_hash is not None:
            del self._cached[old_hash]
            self._block_hash[block] = None
        self._ref_counts[block] = 1
        return block

    def lookup(self, block_hash: int) -> int | None:
        """Take a reference on the cached block holding `block_hash`, or return None."""
        if not self.enable_prefix_caching:
            return None
        block = self._cached.get(block_hash)
        if block is None:
            return None
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1
        return block

    def register(self, block: int, block_hash: int) -> None:
        """Publish a full block under its hash (no-op when caching is off or the hash is already published)."""
        if not self.enable_prefix_caching or block_hash in self._cached or self._block_hash[block] is not None:
            return
        self._cached[block_hash] = block
        self._block_hash[block] = block_hash

    def match_prefix(self, chain: HashChain, num_tokens: int) -> list[int]:
        """Take a reference on each cached block holding the leading full blocks of a sequence of `num_tokens`
        tokens, up to the first miss, leaving at least one token out (its row must be computed). Hashes nothing
        with prefix caching off.

        Args:
            chain: the sequence's block hash chain (`HashChain`), asked for only as far as the lookups go.
            num_tokens: its length.
        Returns:
            The ids of the blocks found, in order.
        """
        blocks: list[int] = []
        if not self.enable_prefix_caching:
            return blocks
        for b in range((num_tokens - 1) // self.block_size):
            block = self.lookup(chain(b + 1, self.block_size)[b])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def publish(self, block_ids: list[int], chain: HashChain, first: int, end: int) -> None:
        """Register blocks `first..end - 1` of a sequence (its `block_ids`, whose K/V hold its tokens there) under
        its block hash chain (`HashChain`). A no-op with prefix caching off."""
        if not self.enable_prefix_caching or first >= end:
            return
        hashes = chain(end, self.block_size)
        for b in range(first, end):
            self.register(block_ids[b], hashes[b])

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free list's most recent end.

        Blocks are released last-first so a sequence's tail blocks are evicted before its shared head.
        """
        for block in reversed(blocks):
            count = self._ref_counts[block] - 1
            assert count >= 0, f"double free of KV block {block}"
            self._ref_counts[block] = count
            if count == 0:
                self._free[block] = None

    def check_invariants(self) -> None:
        """Assert the pool is consistent (used by leak tests)."""
        assert all(c >= 0 for c in self._ref_counts)
        assert set(self._free) == {b for b, c in enumerate(self._ref_counts) if c == 0}
        assert all(self._block_hash[b] == h for h, b in self._cached.items())
