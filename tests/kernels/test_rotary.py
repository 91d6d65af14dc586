"""rotary (neox and interleaved, position ids) vs CpuBackend.rotary. Bound: rel 2e-3 (fp16 output rounding)."""

import pytest
import torch
from tests.kernels.kutils import rel_err

from voltserve.backends.cpu import rope_cos_sin

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("heads", [(9, 3, 64), (5, 1, 128), (3, 3, 96)])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rotary(cuda_backend, cpu_backend, num_tokens, heads, style):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    cos_sin = rope_cos_sin(head_dim, 6000, 1e5)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).half()
    positions = torch.randint(0, 6000, (num_tokens,), generator=gen)
    q_cpu = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k_cpu = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    ref_q, ref_k = cpu_backend.rotary(q_cpu.float(), k_cpu.float(), positions, cos_sin, style)
    qkv_d = qkv.cuda()
    q = qkv_d[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv_d[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    got_q, got_k = cuda_backend.rotary(q, k, positions.cuda(), cos_sin.cuda(), style)
    assert rel_err(got_q, ref_q) <= 2e-3
    assert rel_err(got_k, ref_k) <= 2e-3
