"""Decode-path ops captured in a CUDA graph replay bitwise equal to eager (no host sync, stable allocations)."""

import math

import pytest
import torch
from tests.kernels.kutils import capture, make_quant

from voltserve.backends.base import AttentionMetadata

pytestmark = pytest.mark.gpu


def test_decode_step_graph_replay_matches_eager(cuda_backend):
    be = cuda_backend
    gen = torch.Generator().manual_seed(0)
    num_seqs, hidden, num_heads, num_kv_heads, head_dim, block_size = 5, 576, 9, 3, 64, 16
    quant, weight = make_quant("Q4_1", num_heads * head_dim, hidden, gen)
    wq = be.prepare_linear(weight, quant)
    norm_w = be.prepare_norm(torch.rand(hidden) + 0.5)
    seq_lens = [1, 700, 33, 4099, 2]
    max_blocks = math.ceil(8192 / block_size)
    kv = torch.randn(2, num_seqs * max_blocks, block_size, num_kv_heads, head_dim, device="cuda").half()
    tables = torch.arange(num_seqs * max_blocks, device="cuda", dtype=torch.int32).view(num_seqs, max_blocks)
    attn = AttentionMetadata(torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32),
                             torch.tensor(seq_lens, device="cuda", dtype=torch.int32), tables,
                             torch.zeros(num_seqs, device="cuda", dtype=torch.int64), 1, 8192, [1] * num_seqs,
                             seq_lens)
    x = torch.randn(num_seqs, hidden, device="cuda").half()
    lm = be.prepare_linear(torch.randn(1000, hidden) * 0.05)

    def step():
        h, _ = be.rms_norm(x, norm_w, 1e-5)
        q = be.linear(h, wq).view(num_seqs, num_heads, head_dim)
        o = be.attention(q, kv, attn, head_dim ** -0.5).view(num_seqs, -1)
        return be.sample_greedy(be.linear(o[:, :hidden], lm).float())

    eager = step()  # also loads every module before capture
    torch.cuda.synchronize()
    graph, captured = capture(be, step)
    x.copy_(torch.randn(num_seqs, hidden, device="cuda").half())
    eager2 = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager2[0]) and torch.equal(captured[1], eager2[1])
    assert not torch.equal(eager[1], eager2[1])
