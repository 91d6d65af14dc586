"""attn_decode's split plan (kernels.decode_plan) and shared-memory size: host-side arithmetic, no GPU."""

import pytest

from voltserve.backends.cuda import kernels


@pytest.mark.parametrize("cap", [1, 16, 100, 512, 513, 8192, 32768, 262144])
@pytest.mark.parametrize("seqs", [1, 8, 64, 256])
@pytest.mark.parametrize("kvh", [1, 3, 8])
@pytest.mark.parametrize("bps", [1, 3, 4])
def test_plan_covers_capacity(cap, seqs, kvh, bps):
    """Every context up to the capacity fits its splits (split_len <= PARTITION), no split is shorter than
    min_part unless the context is, and the in-kernel merge's limit holds for the engine's head dims."""
    part = kernels.DECODE_PARTITION
    splits, min_part = kernels.decode_plan(cap, seqs, kvh, part, 132, bps)
    assert splits * part >= cap
    assert min_part == min(kernels.DECODE_MIN_PART, part) and min_part % 16 == 0
    assert splits <= max(-(-cap // part), -(-cap // min_part), 1)


# (capacity, sequences, blocks per SM) -> splits, 8 KV heads, 132 SMs (H200): measured cases of the sweep
@pytest.mark.parametrize("cap,seqs,bps,want", [
    (4096, 16, 4, 4),     # 512 blocks: 0.97 of one wave of 528
    (4096, 32, 4, 2),     # 512 blocks
    (4096, 32, 3, 3),     # CUDA-core path (3 blocks/SM): 768 blocks = 1.94 waves of 396
    (32768, 1, 4, 63),    # a short grid spreads one long context: 504 blocks
    (512, 1, 4, 8),       # short context: as many splits as min_part allows
    (512, 8, 4, 8),
    (600, 256, 4, 1),     # 2048 blocks already fill 0.97 of their 4 waves
])
def test_plan_fills_waves(cap, seqs, bps, want):
    assert kernels.decode_plan(cap, seqs, 8, kernels.DECODE_PARTITION, 132, bps)[0] == want


@pytest.mark.parametrize("cap", [16, 600, 8192, 131072])
@pytest.mark.parametrize("seqs,kvh", [(1, 8), (8, 8), (64, 8), (1, 3), (64, 3)])
@pytest.mark.parametrize("min_part", [64, 256])
def test_split_table_is_the_plan_of_each_longest_context(cap, seqs, kvh, min_part):
    """Entry (L - 1) // min_part is decode_plan's split count for a longest context of L keys, for every L up to
    the capacity (the kernel's step_splits), capped by the capacity's grid; the grid still covers every L."""
    part = kernels.DECODE_PARTITION
    table = kernels.decode_split_table(cap, seqs, kvh, part, 132, 4, min_part)
    grid = kernels.decode_plan(cap, seqs, kvh, part, 132, 4, min_part)[0]
    assert len(table) == -(-cap // min_part)
    for longest in sorted({1, 2, min_part - 1, min_part, min_part + 1, 513, 4096, 4097, cap // 3, cap - 1, cap}):
        if not 1 <= longest <= cap:
            continue
        splits = table[(longest - 1) // min_part]
        assert splits == min(grid, kernels.decode_plan(longest, seqs, kvh, part, 132, 4, min_part)[0]), longest
        assert splits * part >= longest and splits <= grid


def test_split_table_for_a_long_capacity():
    """Llama-3-8B at 64 sequences in a graph for 131,072 keys: 32 splits in the grid, one for 512-key contexts
    (what a grid sized for 560 keys runs); at one sequence, 8 splits of 64 keys for 512."""
    table = kernels.decode_split_table(131072, 64, 8, kernels.DECODE_PARTITION, 132, 4)
    assert kernels.decode_plan(131072, 64, 8, kernels.DECODE_PARTITION, 132, 4)[0] == 32
    assert table[(512 - 1) // 64] == 1 == kernels.decode_plan(560, 64, 8, kernels.DECODE_PARTITION, 132, 4)[0]
    assert kernels.decode_split_table(131072, 1, 8, kernels.DECODE_PARTITION, 132, 4)[(512 - 1) // 64] == 8


def test_split_table_rejects_an_empty_capacity():
    with pytest.raises(ValueError, match="capacity"):
        kernels.decode_split_table(0, 1, 8, kernels.DECODE_PARTITION, 132)


def test_plan_is_memoised():
    """It runs per layer per step: the second call is a cache hit."""
    kernels.decode_plan.cache_clear()
    kernels.decode_plan(4096, 16, 8, 4096, 132, 4)
    kernels.decode_plan(4096, 16, 8, 4096, 132, 4)
    assert kernels.decode_plan.cache_info().hits == 1


def test_smem_holds_the_block_table_slice():
    """q, 4 warps' partial outputs and max / sum, and PARTITION / block_size + 2 block ids (4 bytes each)."""
    assert kernels.decode_smem_bytes(128, 4, 16, 4096) == 4 * (512 + 4 * 512 + 4 * 4 * 2 + 256 + 2)
    assert kernels.decode_smem_bytes(64, 1, 1, 4096) == 4 * (64 + 4 * 64 + 8 + 4096 + 2)
    assert kernels.decode_max_merged_splits(128) == 256


def test_spec_simt_forces_the_cuda_core_path():
    assert kernels.decode_spec(128, 4) == {"HEAD_DIM": 128, "GROUP": 4, "PARTITION": kernels.DECODE_PARTITION}
    assert kernels.decode_spec(128, 4, simt=True)["ATTN_SIMT"] == 1
    assert kernels.decode_spec(64, 3, simt=True, per_row=True) == {"HEAD_DIM": 64, "GROUP": 3, "ATTN_SIMT": 1,
                                                                   "PER_ROW": 1, "PARTITION": kernels.DECODE_PARTITION}


def test_plan_without_sequences():
    assert kernels.decode_plan(100, 0, 8, 4096, 132, 4) == (1, 64)


def test_graph_decode_splits_from_the_registered_plan():
    """CudaBackend's per-step planning (host arithmetic, no GPU): a graph's launch registers its plan; each step
    then gets the table's entry for its longest context; without a plan, 0 (the grid's splits); a later launch's
    plan under the same (capacity, sequences) key replaces it."""
    from voltserve.backends.cuda.backend import CudaBackend

    be = CudaBackend.__new__(CudaBackend)  # the host-side methods only
    be._graph_plans = {}
    part = kernels.DECODE_PARTITION
    assert be.graph_decode_splits(131072, 64, 512) == 0
    be._register_graph_plan((131072, 64, 8, part, 132, 4, 64), 64)
    assert be.graph_decode_splits(131072, 64, 512) == 1
    assert be.graph_decode_splits(131072, 64, 131072) == kernels.decode_plan(131072, 64, 8, part, 132, 4)[0] == 32
    be._register_graph_plan((131072, 1, 8, part, 132, 4, 64), 64)
    assert [be.graph_decode_splits(131072, 1, n) for n in (1, 64, 65, 512, 5000)] == [1, 1, 2, 8, 63]
    be._register_graph_plan((131072, 64, 3, part, 132, 4, 64), 64)  # another shape (3 KV heads): its table
    assert be.graph_decode_splits(131072, 64, 512) == kernels.decode_plan(512, 64, 3, part, 132, 4)[0] == 8
    assert be.graph_decode_splits(131072, 1, 512) == 8
    # two models on one backend (a draft model's graphs captured after the target's): each asks for its own shape
    be._register_graph_plan((131072, 64, 8, part, 132, 4, 64), 64, (8, 128, 4))
    be._register_graph_plan((131072, 64, 3, part, 132, 4, 64), 64, (3, 64, 3))
    assert be.graph_decode_splits(131072, 64, 131072, shape=(8, 128, 4)) == 32
    assert be.graph_decode_splits(131072, 64, 131072, shape=(3, 64, 3)) == \
        kernels.decode_plan(131072, 64, 3, part, 132, 4)[0]
    assert be.graph_decode_splits(131072, 64, 512, shape=(1, 64, 9)) == 8  # none of its own: the latest
