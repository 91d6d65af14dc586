"""rotary_write_kv (ptx/rope_kv.cu: RoPE of q and k plus the paged KV write) vs CpuBackend.rotary_write_kv.

Bounds: q and the cached k within rel 2e-3 of the fp32 reference (one fp16 output rounding); the cached v is a
bit-exact copy; slots not written (incl. slot -1 tokens) keep their NaN.
"""

import pytest
import torch
from tests.kernels.kutils import rel_err

from voltserve.backends.cpu import rope_cos_sin

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_tokens", [1, 5, 37, 301])
@pytest.mark.parametrize("heads", [(9, 3, 64), (5, 1, 128), (3, 3, 96), (32, 8, 128), (4, 5, 40)])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rotary_write_kv(cuda_backend, cpu_backend, num_tokens, heads, style):
    num_heads, num_kv_heads, head_dim = heads
    num_blocks, block_size = 41, 16
    gen = torch.Generator().manual_seed(num_tokens * head_dim + num_heads)
    cos_sin = rope_cos_sin(head_dim, 6000, 1e5)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    # rows wider than q | k | v: the views have a token stride of their own (heads packed)
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size + 3, generator=gen).half()
    positions = torch.randint(0, 6000, (num_tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1

    def split(t):
        return (t[:, :q_size].view(num_tokens, num_heads, head_dim),
                t[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim),
                t[:, q_size + kv_size:q_size + 2 * kv_size].view(num_tokens, num_kv_heads, head_dim))

    kv0 = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch.float16)
    ref_kv = kv0.float()
    ref_q = cpu_backend.rotary_write_kv(*[t.float() for t in split(qkv)], positions, cos_sin, style, ref_kv, slots)
    got_kv = kv0.cuda()
    got_q = cuda_backend.rotary_write_kv(*split(qkv.cuda()), positions.cuda(), cos_sin.cuda(), style, got_kv,
                                         slots.cuda())
    assert rel_err(got_q, ref_q) <= 2e-3
    got_kv = got_kv.cpu()
    assert torch.equal(got_kv.isnan(), ref_kv.isnan())
    assert rel_err(got_kv[0].nan_to_num(), ref_kv[0].nan_to_num()) <= 2e-3
    assert torch.equal(got_kv[1].nan_to_num(), ref_kv[1].half().nan_to_num())  # v: a bit-exact copy
