"""attn_prefill's flat grid of q tiles (kernels.prefill_tile_slots and the kernel's slot -> sequence search, as
ptx/attention_prefill.cu does it): every query row of every split of a step's tokens is covered exactly once; and
which steps take the attention kernels' fused rotary (kernels.rope_fused). Host arithmetic, no GPU."""

import random

import pytest

from voltserve.backends.cuda import kernels

BQ = 16


def _owner(slot: int, query_start: list[int]) -> tuple[int, int]:
    """The kernel's search: the last sequence s with query_start[s] // BQ + s <= slot, and that slot's first row in
    it (>= its query length: an idle slot)."""
    seq = sum(1 for s in range(len(query_start) - 1) if query_start[s] // BQ + s <= slot) - 1
    return seq, (slot - query_start[seq] // BQ - seq) * BQ


def _covered(query_lens: list[int], num_tokens: int) -> list[list[int]]:
    """Per sequence, the first rows of the tiles the grid's slots give it."""
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    tiles: list[list[int]] = [[] for _ in query_lens]
    for slot in range(kernels.prefill_tile_slots(num_tokens, len(query_lens))):
        seq, q0 = _owner(slot, query_start)
        assert q0 >= 0
        if q0 < query_lens[seq]:
            tiles[seq].append(q0)
    return tiles


def _assert_exact(query_lens: list[int], num_tokens: int) -> None:
    for n, got in zip(query_lens, _covered(query_lens, num_tokens)):
        assert got == list(range(0, n, BQ)), (query_lens, n, got)


@pytest.mark.parametrize("query_lens", [
    [1] * 64 + [64],               # a mixed graph (64, 64) with one 64-token prompt: 72 slots a head
    [64] + [1] * 64,
    [15, 17, 16, 1, 33, 2, 31],    # tile edges on both sides
    [512],                         # pp512: 33 slots, one idle
    [1],
])
def test_every_row_once(query_lens):
    _assert_exact(query_lens, sum(query_lens))


def test_mixed_graph_grid_is_sized_by_tokens():
    """(64 sequences, a 64-token bucket): 128 token slots -> 8 + 64 tile slots, against 4 x 64 before."""
    assert kernels.prefill_tile_slots(64 + 64, 64) == 72
    assert kernels.prefill_tile_slots(64 + 512, 64) == 100


def test_random_splits_and_graph_padding():
    """Random steps, each also laid into a graph bucket with more token slots than it uses (padding)."""
    rng = random.Random(3)
    for _ in range(300):
        lens = [rng.choice([1, 1, 1, rng.randint(1, 40), rng.randint(1, 600)]) for _ in range(rng.randint(1, 70))]
        _assert_exact(lens, sum(lens))
        _assert_exact(lens, sum(lens) + rng.randint(1, 100))


@pytest.mark.parametrize("mode,decode_only,tokens,seqs,want", [
    ("auto", True, 64, 64, True),
    ("decode", True, 64, 64, True),
    ("off", True, 64, 64, False),
    ("auto", False, 64 + 64, 64, True),      # the (64, 64) mixed graph
    ("decode", False, 64 + 64, 64, False),
    ("auto", False, 64 + 512, 64, False),    # the (64, 512) graph: its prompts may reach 512 tokens
    ("auto", False, 1 + 64, 1, True),        # a (1, 64) graph: a lone prompt or a verify at batch 1
    ("auto", False, 2 + 64, 2, True),
    ("auto", False, 2 + 65, 2, False),       # an eager step one prompt token past the cap
    ("auto", False, 5, 1, True),             # an eager verify of 4 drafts, or a lone 5-token prompt
    ("off", False, 5, 1, False),
    ("auto", False, 66, 1, False),           # a lone 66-token prompt
])
def test_rope_fused_steps(mode, decode_only, tokens, seqs, want):
    """Which steps run the rotary inside the attention kernels (CudaBackend.rope_attention's rule)."""
    assert kernels.rope_fused(mode, decode_only, tokens, seqs) is want
