"""kv_write vs CpuBackend.write_kv: bit-exact copy; slots not written (incl. slot -1 tokens) keep their NaN."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_tokens", [1, 37, 301])
@pytest.mark.parametrize("shape", [(3, 64), (1, 128), (5, 40)])
def test_write_kv(cuda_backend, cpu_backend, num_tokens, shape):
    num_kv_heads, head_dim = shape
    num_blocks, block_size = 41, 16
    gen = torch.Generator().manual_seed(num_tokens * head_dim)
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch.float16)
    kvfull = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 3, generator=gen).half()
    k = kvfull[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = kvfull[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    ref = kv.clone()
    cpu_backend.write_kv(k, v, ref, slots)
    got = kv.cuda()
    kvd = kvfull.cuda()
    cuda_backend.write_kv(kvd[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim),
                          kvd[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads,
                                                                                           head_dim),
                          got, slots.cuda())
    assert torch.equal(got.cpu().isnan(), ref.isnan())
    assert torch.equal(got.cpu().nan_to_num(), ref.nan_to_num())
