import hashlib

import pytest

from voltserve.errors import ConfigError
from voltserve.kv_cache import BlockPool, NoFreeBlocksError, blocks_in_memory, hash_block, pool_max_model_len


def test_allocate_free_roundtrip():
    pool = BlockPool(4, 16)
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    pool.free(blocks)
    assert pool.num_free == 4
    pool.check_invariants()


def test_prefix_hit_takes_a_reference_and_survives_free():
    pool = BlockPool(4, 2)
    b = pool.allocate()
    h = hash_block(None, [1, 2])
    pool.register(b, h)
    pool.free([b])
    assert pool.num_free == 4 and pool.num_cached == 1
    assert pool.lookup(h) == b  # still cached while free
    assert pool.num_free == 3
    assert pool.lookup(h) == b  # shared: two references
    pool.free([b])
    assert pool.num_free == 3
    pool.free([b])
    assert pool.num_free == 4
    pool.check_invariants()


def test_lru_eviction_order_and_hash_dropped():
    pool = BlockPool(3, 2)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for blk, toks in ((a, [1, 1]), (b, [2, 2]), (c, [3, 3])):
        pool.register(blk, hash_block(None, toks))
    pool.free([a])
    pool.free([b])
    pool.free([c])
    assert pool.allocate() == a  # least recently freed goes first
    assert pool.lookup(hash_block(None, [1, 1])) is None
    assert pool.lookup(hash_block(None, [2, 2])) == b
    pool.check_invariants()


def test_chained_hash_depends_on_parent():
    assert hash_block(hash_block(None, [1]), [2]) != hash_block(hash_block(None, [3]), [2])


def test_block_hash_is_sha256_and_injective_where_pythons_hash_folds():
    # Python's hash() folds ints modulo 2**61 - 1, so hash((p, t)) == hash((p + 2**61 - 1, t)): two chains whose
    # parents differ by that much would share a cached block
    assert hash_block(5, [1, 2]) != hash_block(5 + 2**61 - 1, [1, 2])
    head, tokens = b"\x01" + (5).to_bytes(32, "big"), (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    assert hash_block(5, [1, 2]) == int.from_bytes(hashlib.sha256(head + tokens).digest(), "big")
    assert hash_block(None, [1, 2]) != hash_block(0, [1, 2])  # no parent is not a parent digest of 0


def test_prefix_caching_off():
    pool = BlockPool(2, 2, enable_prefix_caching=False)
    b = pool.allocate()
    pool.register(b, 5)
    pool.free([b])
    assert pool.lookup(5) is None and pool.num_cached == 0


def test_double_free_is_caught():
    pool = BlockPool(2, 2)
    b = pool.allocate()
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_bad_sizes():
    with pytest.raises(ConfigError):
        BlockPool(0, 16)


def test_pool_sizing_and_the_context_it_serves():
    """What the engine (`actors.build`) and `voltserve serve`'s check before the load both use: a set
    max_model_len the pool cannot hold is an error, the model's own is capped to the pool; no block is an error."""
    assert blocks_in_memory(1.0, 2**20) == 1024
    with pytest.raises(ConfigError, match=r"kv_cache_memory_gb 0.0001 GiB holds no KV block \(one takes 1.00 MiB\)"):
        blocks_in_memory(0.0001, 2**20)
    assert pool_max_model_len(0, 8192, 100, 16) == 1600  # the model's own, capped
    assert pool_max_model_len(0, 512, 100, 16) == 512
    assert pool_max_model_len(1600, 512, 100, 16) == 1600  # above the model's own: served (the engine warns)
    with pytest.raises(ConfigError, match="cannot hold one sequence of max_model_len 1601"):
        pool_max_model_len(1601, 8192, 100, 16)
