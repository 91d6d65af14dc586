import pytest

from voltserve.errors import ConfigError
from voltserve.kv_cache import BlockPool, NoFreeBlocksError, hash_block


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
