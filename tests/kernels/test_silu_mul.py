"""silu_mul vs CpuBackend.silu_and_mul on fp32. Bound: rel 2e-3 (one fp16 rounding, __expf)."""

import pytest
import torch
from tests.kernels.kutils import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("inner", [1, 259, 1537])
def test_silu_and_mul(cuda_backend, cpu_backend, num_tokens, inner):
    gen = torch.Generator().manual_seed(num_tokens + inner)
    x = (torch.randn(num_tokens, 2 * inner, generator=gen) * 3).half()
    got = cuda_backend.silu_and_mul(x.cuda())
    assert got.shape == (num_tokens, inner)
    assert rel_err(got, cpu_backend.silu_and_mul(x.float())) <= 2e-3
