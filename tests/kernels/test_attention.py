"""Paged attention (decode split-K and prefill) vs CpuBackend.attention (fp32 SDPA on the same fp16 values).

Bound: max |got - ref| <= 4e-3 * max |ref| (fp16 output rounding; fp32 scores and softmax; __expf).
Contexts from 1 to 5000+ tokens, batch 1 and 37, GQA groups 1 / 3 / 4 / 8, block tables shuffled; decode runs both
paths of attn_decode (tensor cores on SM80+, and the CUDA-core path V100 runs) through the `attn_choice` fixture.
"""

import contextlib
import math

import pytest
import torch
from tests.kernels.kutils import launched_kernels, metadata_to_cuda, paged_kv_case, rel_err

pytestmark = pytest.mark.gpu
TOL = 4e-3


def _run(cuda_backend, cpu_backend, seq_lens, query_lens, heads, block_size, seed, max_seq_len=None,
         split_decode=False, max_query_len=None, q_pad=8, rows_as_decodes=False):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    kv, attn = paged_kv_case(seq_lens, query_lens, num_kv_heads, head_dim, block_size, gen)
    num_tokens = sum(query_lens)
    qwide = torch.randn(num_tokens, num_heads * head_dim + q_pad, generator=gen).half()
    q = qwide[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    # the CPU oracle gets the unused slots zeroed (torch's CPU SDPA turned NaN there into NaN outputs for
    # query_len == 1); the GPU keeps the NaN, so a kernel that reads past a context shows up as NaN output
    ref = cpu_backend.attention(q.float(), kv.float().nan_to_num(), attn, scale)
    qd = qwide.cuda()[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    meta = metadata_to_cuda(attn, max_seq_len, split_decode, max_query_len, rows_as_decodes)
    got = cuda_backend.attention(qd, kv.cuda(), meta, scale)
    return rel_err(got, ref)


HEADS = [(9, 3, 64), (8, 1, 128), (4, 4, 64), (32, 8, 128)]  # the last: Llama-3-8B


# head_dim 96: the CUDA-core path on every GPU; GROUP 16: also the merge's smaller register prefetch (4 splits)
@pytest.mark.parametrize("heads", HEADS + [(6, 2, 96), (16, 1, 128)])
@pytest.mark.parametrize("num_seqs", [1, 37])
def test_decode(cuda_backend, cpu_backend, heads, num_seqs, attn_choice):
    gen = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 5200, (num_seqs,), generator=gen).tolist()
    lens[0] = 5003 if num_seqs == 1 else 1
    if num_seqs > 2:
        lens[1], lens[2] = 5003, 512  # longest context, and exactly one partition
    assert _run(cuda_backend, cpu_backend, lens, [1] * num_seqs, heads, 16, seed=num_seqs + heads[2]) <= TOL


@pytest.mark.parametrize("heads", HEADS[:2])
def test_decode_context_one(cuda_backend, cpu_backend, heads, attn_choice):
    assert _run(cuda_backend, cpu_backend, [1], [1], heads, 16, seed=3) <= TOL


def test_decode_grid_sized_for_capacity(cuda_backend, cpu_backend, attn_choice):
    """A graph bucket sizes the split grid for the max context: empty partitions must contribute nothing."""
    assert _run(cuda_backend, cpu_backend, [1, 700, 33], [1, 1, 1], (9, 3, 64), 16, seed=5,
                max_seq_len=8192) <= TOL


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("split_decode", [False, True])
def test_prefill_chunked_and_prefix_hits(cuda_backend, cpu_backend, heads, block_size, split_decode):
    # (context after the step, new tokens): full prefill, chunk after a 5000-token prefix, 1-token query, decode
    # rows mixed in, odd lengths everywhere; split_decode: the 1-token rows through attn_decode
    seq_lens = [37, 5077, 301, 1, 900, 19]
    query_lens = [37, 77, 1, 1, 300, 18]
    assert _run(cuda_backend, cpu_backend, seq_lens, query_lens, heads, block_size, seed=11,
                split_decode=split_decode) <= TOL


@pytest.mark.parametrize("split_decode", [False, True])
def test_prefill_batch_37(cuda_backend, cpu_backend, split_decode):
    gen = torch.Generator().manual_seed(37)
    query_lens = torch.randint(1, 60, (37,), generator=gen).tolist()
    query_lens[::3] = [1] * len(query_lens[::3])  # decodes among the prefills
    seq_lens = [q + int(c) for q, c in zip(query_lens, torch.randint(0, 400, (37,), generator=gen))]
    assert _run(cuda_backend, cpu_backend, seq_lens, query_lens, (9, 3, 64), 16, seed=37,
                split_decode=split_decode) <= TOL


def test_mixed_graph_grid(cuda_backend, cpu_backend, attn_choice):
    """A mixed CUDA graph's launch: a max_query_len of 64 and attn_decode's grid for an 8192-token context
    (attn_prefill's flat grid follows the tokens), decodes through attn_decode, prefills (one after a cached
    prefix) through attn_prefill, padded sequences of one token."""
    seq_lens = [700, 40, 1, 300, 129, 1, 1]
    query_lens = [1, 40, 1, 23, 1, 1, 1]
    assert _run(cuda_backend, cpu_backend, seq_lens, query_lens, (9, 3, 64), 16, seed=8, max_seq_len=8192,
                split_decode=True, max_query_len=64) <= TOL


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("lens", [[1], [15], [16], [17], [100], [513], [8192], [100, 1, 4000, 31, 2]])
def test_decode_short_contexts_spread_over_capacity_grid(cuda_backend, cpu_backend, heads, lens, attn_choice):
    """Graph-sized grids (capacity 8192): each context is spread over the splits (split_len in the kernel);
    boundaries around 16 keys, one direct-write split, splits past the context and the full capacity."""
    assert _run(cuda_backend, cpu_backend, lens, [1] * len(lens), heads, 16, seed=len(lens) + lens[0],
                max_seq_len=8192) <= TOL


def _host_word(value: int) -> torch.Tensor:
    """A [1] int32 device word written by a host-to-device copy, as the graphs' upload writes decode_splits:
    attn_decode reads it before its PDL wait, where a device kernel's write would not be visible yet."""
    word = torch.tensor([value], dtype=torch.int32).cuda()
    torch.cuda.synchronize()
    return word


@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("lens", [[1], [100], [513], [5003], [700, 1, 33, 64], [512] * 64])
@pytest.mark.parametrize("mixed", [False, True])
def test_decode_capacity_grid_plans_the_steps_longest_context(cuda_backend, cpu_backend, heads, lens, mixed,
                                                              attn_choice, monkeypatch):
    """A CUDA graph's launch: the grid sized for 131,072 keys, the split count the host planned for the step's
    longest context in `decode_splits` (CudaBackend.graph_decode_splits, from the plan the first launch with the
    word registered). The kernel then splits as a launch sized for the step itself, so both give the same output
    bit for bit, within TOL of the reference. mixed: a mixed graph's launch (split_decode, 64 query tokens): the
    first sequence (context >= 2) has 2 new tokens and goes through attn_prefill, the others through attn_decode."""
    monkeypatch.setattr(cuda_backend, "attn_step_splits", "auto")
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(len(lens) + lens[0])
    query_lens = [1] * len(lens)
    if mixed and lens[0] >= 2:
        query_lens[0] = 2
    kv, attn = paged_kv_case(lens, query_lens, num_kv_heads, head_dim, 16, gen)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).half()
    scale = 1.0 / math.sqrt(head_dim)
    ref = cpu_backend.attention(q.float(), kv.float().nan_to_num(), attn, scale)
    qd, kvd = q.cuda(), kv.cuda()
    exact = cuda_backend.attention(qd, kvd, metadata_to_cuda(attn, split_decode=mixed), scale)
    graph = metadata_to_cuda(attn, 131072, mixed, 64 if mixed else None)
    graph.decode_splits = _host_word(0)  # 0: the grid's splits
    grid = cuda_backend.attention(qd, kvd, graph, scale)  # registers the plan, as a graph's eager run does
    planned = cuda_backend.graph_decode_splits(131072, len(lens), max(lens))
    assert planned >= 1
    graph.decode_splits = _host_word(planned)
    got = cuda_backend.attention(qd, kvd, graph, scale)
    assert torch.equal(got, exact) and rel_err(got, ref) <= TOL and rel_err(grid, ref) <= TOL
    assert int(cuda_backend.attn_counters.abs().sum()) == 0


@pytest.mark.parametrize("word", [-1, 0, 1, 2, 7, 10**6])
def test_decode_any_planned_split_count_covers_every_key(cuda_backend, cpu_backend, word, attn_choice, monkeypatch):
    """Whatever the plan word holds, each sequence takes at most the grid's splits (so the splits it uses and
    merges exist; word 10**6) and at least ceil(seq_len / PARTITION): no key is dropped or read twice, the
    arrival counters end at zero. Contexts past one partition (5003, 8192) among short ones."""
    monkeypatch.setattr(cuda_backend, "attn_step_splits", "auto")
    gen = torch.Generator().manual_seed(word % 97)
    lens = [5003, 1, 8192, 100, 700]
    kv, attn = paged_kv_case(lens, [1] * len(lens), 8, 128, 16, gen)
    q = torch.randn(len(lens), 32, 128, generator=gen).half()
    ref = cpu_backend.attention(q.float(), kv.float().nan_to_num(), attn, 0.088)
    graph = metadata_to_cuda(attn, 131072)
    graph.decode_splits = _host_word(word)
    assert rel_err(cuda_backend.attention(q.cuda(), kv.cuda(), graph, 0.088), ref) <= TOL
    assert int(cuda_backend.attn_counters.abs().sum()) == 0


def test_decode_in_kernel_merge_matches_reduce_kernel(cuda_backend, attn_choice):
    """The last split block's merge (arrival counters) equals the attn_decode_reduce path bit for bit, repeated
    launches are bitwise equal (fixed merge order), and the counters are back at zero."""
    gen = torch.Generator().manual_seed(9)
    lens = [700, 1, 5003, 64, 129]
    kv, attn = paged_kv_case(lens, [1] * len(lens), 3, 64, 16, gen)
    q = torch.randn(len(lens), 9, 64, generator=gen).half().cuda()
    kv, meta = kv.cuda(), metadata_to_cuda(attn, 8192)
    merged = [cuda_backend.attention(q, kv, meta, 0.125) for _ in range(3)]
    assert all(torch.equal(m, merged[0]) for m in merged[1:])
    assert int(cuda_backend.attn_counters.abs().sum()) == 0
    saved = cuda_backend.attn_counters
    cuda_backend.attn_counters = saved[:0]  # no counters: the reduce kernel merges
    try:
        assert torch.equal(cuda_backend.attention(q, kv, meta, 0.125), merged[0])
    finally:
        cuda_backend.attn_counters = saved


@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_decode_block_sizes(cuda_backend, cpu_backend, block_size, attn_choice):
    """KV blocks of any size: a split's block-table slice (staged in shared memory) and each key's slot."""
    assert _run(cuda_backend, cpu_backend, [700, 1, 5003, 31], [1] * 4, (32, 8, 128), block_size, seed=block_size,
                max_seq_len=8192) <= TOL


def test_decode_unaligned_q_rows(cuda_backend, cpu_backend, attn_choice):
    """q rows 3 columns wider than its heads (head rows not 16-byte aligned): attention copies q first."""
    assert _run(cuda_backend, cpu_backend, [700, 1, 33], [1, 1, 1], (9, 3, 64), 16, seed=12, q_pad=3) <= TOL


@contextlib.contextmanager
def _nan_outputs(monkeypatch):
    """fp16 `torch.empty` allocations (the attention output) start as NaN inside the block: rows no kernel
    writes stay NaN."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype == torch.float16 else t

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", nan_empty)
        yield


@pytest.mark.parametrize("merge", ["in_kernel", "reduce"])
def test_decode_launch_leaves_multi_token_sequences_to_prefill(cuda_backend, cpu_backend, merge, attn_choice,
                                                               monkeypatch):
    """A mixed step's attn_decode (and its reduce) computes the one-token sequences only: with attn_prefill's
    launch dropped, the rows of sequences of >= 2 query tokens (a verify's drafts, a prompt chunk) keep the NaN
    the output buffer was allocated with, the decode rows equal the reference, and the split counters are back
    at zero. Long contexts: several splits a sequence (the merge under test)."""
    lens, qlens = [5003, 40, 3000, 9, 700], [5, 1, 3, 9, 1]
    gen = torch.Generator().manual_seed(21)
    kv, attn = paged_kv_case(lens, qlens, 3, 64, 16, gen)
    q = torch.randn(sum(qlens), 9, 64, generator=gen).half()
    ref = cpu_backend.attention(q.float(), kv.float().nan_to_num(), attn, 0.125)
    q, kv, meta = q.cuda(), kv.cuda(), metadata_to_cuda(attn, 8192, split_decode=True, max_query_len=64)
    launch, saved = cuda_backend._launch, cuda_backend.attn_counters
    cuda_backend._launch = lambda op, kernel, *a, **k: None if kernel == "attn_prefill" else launch(op, kernel, *a, **k)
    if merge == "reduce":
        cuda_backend.attn_counters = saved[:0]  # no counters: attn_decode_reduce merges
    try:
        with _nan_outputs(monkeypatch):
            got = cuda_backend.attention(q, kv, meta, 0.125).cpu()
    finally:
        del cuda_backend._launch
        cuda_backend.attn_counters = saved
    decode_rows = [int(attn.query_start_loc[i]) for i, n in enumerate(qlens) if n == 1]
    other_rows = [r for r in range(sum(qlens)) if r not in decode_rows]
    assert torch.isnan(got[other_rows]).all()
    assert rel_err(got[decode_rows], ref[decode_rows]) <= TOL
    assert int(cuda_backend.attn_counters.abs().sum()) == 0


# a verify step: spans of 1 + k tokens (k = 1..8) beside decodes; contexts of a few keys to several splits
VERIFY_LENS, VERIFY_QUERIES = [5003, 40, 9, 700, 3000, 5, 129], [5, 1, 9, 2, 1, 5, 4]


@pytest.mark.parametrize("heads", HEADS + [(6, 2, 96)])
@pytest.mark.parametrize("capacity", [None, 8192])
def test_verify_rows_as_decodes(cuda_backend, cpu_backend, heads, capacity, attn_choice):
    """rows_as_decodes: attn_decode alone, over every query row (each a decode of the keys up to its position),
    eager and in a verify graph's capacity grid (mixed metadata, max_query_len 64)."""
    with launched_kernels(cuda_backend) as names:
        err = _run(cuda_backend, cpu_backend, VERIFY_LENS, VERIFY_QUERIES, heads, 16, seed=heads[2] + 3,
                   max_seq_len=capacity, split_decode=capacity is not None, max_query_len=64 if capacity else None,
                   rows_as_decodes=True)
    assert err <= TOL
    assert set(names) <= {"attn_decode", "attn_decode_reduce"} and names[0] == "attn_decode", names


@pytest.mark.parametrize("merge", ["in_kernel", "reduce"])
def test_verify_rows_as_decodes_past_the_tokens_and_merges(cuda_backend, cpu_backend, merge, attn_choice,
                                                            monkeypatch):
    """q holds 6 token slots more than the step's tokens (a verify graph's capacity): those rows are left alone
    (their NaN stays); the splits merge in the kernel or in attn_decode_reduce, bit for bit the same, and the
    counters are back at zero; a second launch is bitwise equal (fixed merge order)."""
    gen = torch.Generator().manual_seed(33)
    kv, attn = paged_kv_case(VERIFY_LENS, VERIFY_QUERIES, 3, 64, 16, gen)
    tokens = sum(VERIFY_QUERIES)
    q = torch.randn(tokens + 6, 9, 64, generator=gen).half()
    ref = cpu_backend.attention(q[:tokens].float(), kv.float().nan_to_num(), attn, 0.125)
    q, kv = q.cuda(), kv.cuda()
    meta = metadata_to_cuda(attn, 8192, split_decode=True, max_query_len=64, rows_as_decodes=True)
    saved = cuda_backend.attn_counters
    if merge == "reduce":
        cuda_backend.attn_counters = saved[:0]  # no counters: attn_decode_reduce merges
    try:
        with _nan_outputs(monkeypatch), launched_kernels(cuda_backend) as names:
            got = [cuda_backend.attention(q, kv, meta, 0.125).cpu() for _ in range(2)]
    finally:
        cuda_backend.attn_counters = saved
    assert ("attn_decode_reduce" in names) == (merge == "reduce")
    assert torch.equal(got[0][:tokens], got[1][:tokens])
    assert rel_err(got[0][:tokens], ref) <= TOL
    assert torch.isnan(got[0][tokens:]).all()
    assert int(cuda_backend.attn_counters.abs().sum()) == 0


def test_verify_rows_as_decodes_off_takes_prefill(cuda_backend, cpu_backend, monkeypatch):
    """VOLTSERVE_ATTN_VERIFY=prefill (attn_verify): the same step through attn_prefill, within TOL."""
    monkeypatch.setattr(cuda_backend, "attn_verify", "prefill")
    with launched_kernels(cuda_backend) as names:
        err = _run(cuda_backend, cpu_backend, VERIFY_LENS, VERIFY_QUERIES, (9, 3, 64), 16, seed=5,
                   rows_as_decodes=True)
    assert err <= TOL and names == ["attn_prefill"], names
