import torch

from voltserve.backends.cpu import CpuBackend


def test_linear_rows_do_not_depend_on_batch():
    """A row's result is bitwise the same alone or batched (greedy batching == sequential)."""
    torch.manual_seed(0)
    backend = CpuBackend(torch.float32)
    w = torch.randn(3001, 576)
    x = torch.randn(37, 576)
    full = backend.linear(x, w)
    for rows in (slice(0, 1), slice(5, 7), slice(3, 11), slice(20, 37)):
        assert torch.equal(backend.linear(x[rows], w), full[rows])
    assert torch.allclose(full, x @ w.t(), atol=1e-4, rtol=1e-5)


def test_rms_norm_with_residual():
    backend = CpuBackend(torch.float32)
    x, r, w = torch.randn(5, 8), torch.randn(5, 8), torch.randn(8)
    out, new_res = backend.rms_norm(x, w, 1e-6, r)
    s = x + r
    assert torch.equal(new_res, s)
    assert torch.allclose(out, s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w, atol=1e-6)


def test_rotary_styles_agree_up_to_layout():
    from voltserve.backends.cpu import rope_cos_sin

    backend = CpuBackend(torch.float32)
    cs = rope_cos_sin(8, 32, 10000.0)
    q = torch.randn(3, 2, 8)
    pos = torch.tensor([0, 5, 31])
    neox, _ = backend.rotary(q, q[:, :1], pos, cs, "neox")
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # interleaved pair i = (i, i + d/2) of neox
    inter, _ = backend.rotary(q[..., perm], q[:, :1, perm], pos, cs, "interleaved")
    assert torch.allclose(inter, neox[..., perm], atol=1e-6)
    assert torch.equal(neox[0], q[0])  # position 0 is the identity


def _meta(query_lens, seq_lens, tables):
    from voltserve.backends.base import AttentionMetadata

    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    return AttentionMetadata(qsl, torch.tensor(seq_lens, dtype=torch.int32), tables,
                             torch.zeros(sum(query_lens), dtype=torch.long), max(query_lens), max(seq_lens),
                             list(query_lens), list(seq_lens))


def test_attention_same_for_whole_chunked_and_batched():
    """A token's attention output is bitwise the same in one prefill, a prefill chunk, a decode step alone or a
    decode batch with longer neighbours, and matches the textbook causal formula."""
    torch.manual_seed(0)
    backend = CpuBackend(torch.float32)
    kv = torch.randn(2, 12, 4, 3, 16)  # 12 blocks of 4 tokens, 3 KV heads, head dim 16
    q = torch.randn(10, 6, 16)  # 10 tokens of one sequence, 6 query heads (GQA group 2)
    table = torch.tensor([[3, 7, 1]], dtype=torch.int32)
    whole = backend.attention(q, kv, _meta([10], [10], table), 0.25)
    chunk = backend.attention(q[6:], kv, _meta([4], [10], table), 0.25)
    decode = backend.attention(q[9:], kv, _meta([1], [10], table), 0.25)
    other = torch.tensor([[3, 7, 1], [0, 2, 4]], dtype=torch.int32)
    batch = backend.attention(torch.cat([q[9:], q[:1]]), kv, _meta([1, 1], [10, 12], other), 0.25)
    assert torch.equal(whole[6:], chunk) and torch.equal(whole[9:], decode) and torch.equal(batch[:1], decode)
    k = kv[0, table[0].long()].flatten(0, 1)[:10].repeat_interleave(2, dim=1)
    v = kv[1, table[0].long()].flatten(0, 1)[:10].repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.25
    scores = scores.masked_fill(torch.ones(10, 10).triu(1).bool(), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    assert torch.allclose(whole, ref, atol=1e-5)


def test_attention_row_does_not_depend_on_its_neighbours_lengths():
    """A decode row of 57 keys (default model heads: 3 KV heads, group 3, head dim 64) is bitwise the same alone,
    next to a 300-key neighbour, and as the last row of its sequence's prefill. Padding it to the neighbour's
    length changed its softmax and P @ V sums on AVX-512 CPUs (concurrent greedy streams differed from
    sequential ones)."""
    torch.manual_seed(1)
    backend = CpuBackend(torch.float32)
    kv = torch.randn(2, 40, 16, 3, 64)
    q = torch.randn(57, 9, 64)
    table = torch.arange(4, dtype=torch.int32)[None]
    tables = torch.cat([torch.cat([table, table.new_full((1, 15), -1)], 1),
                        torch.arange(20, 39, dtype=torch.int32)[None]])
    alone = backend.attention(q[56:], kv, _meta([1], [57], table), 0.125)
    batched = backend.attention(torch.cat([q[56:], q[:1]]), kv, _meta([1, 1], [57, 300], tables), 0.125)
    prefill = backend.attention(q, kv, _meta([57], [57], table), 0.125)
    assert torch.equal(batched[:1], alone) and torch.equal(prefill[56:], alone)
    k = kv[0, :4].flatten(0, 1)[:57].repeat_interleave(3, dim=1)
    v = kv[1, :4].flatten(0, 1)[:57].repeat_interleave(3, dim=1)
    ref = torch.einsum("hk,khd->hd", (torch.einsum("hd,khd->hk", q[56], k) * 0.125).softmax(-1), v)
    assert torch.allclose(alone[0], ref, atol=1e-5)


def test_cpu_threads_keep_a_core_for_the_server_unless_set():
    from actors.build import cpu_threads

    assert cpu_threads(0, 16, 1) == 15
    assert cpu_threads(0, 2, 1) == 1
    assert cpu_threads(0, 1, 1) == 1  # at least one
    assert cpu_threads(0, 8, 0) == 8  # offline tools: torch's default
    assert cpu_threads(3, 16, 1) == 3  # --num-threads wins
