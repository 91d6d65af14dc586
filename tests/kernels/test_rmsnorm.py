"""rms_norm (+ residual add) vs CpuBackend.rms_norm on fp16 CPU inputs.

Bounds: residual sum bit-exact (both round the fp16 sum once); normalised output rel 2e-3 (fp16 rounding of the
output plus fp32 reduction order). Both kernel paths: 2-byte loads (a strided, misaligned view of x) and 16-byte
loads (aligned rows, hidden % 8 == 0: within the register cache, and wider than it: 12,296 > 8,192).
"""

import pytest
import torch
from tests.kernels.kutils import rel_err

pytestmark = pytest.mark.gpu


def _check(cuda_backend, cpu_backend, x_dev, x, weight, residual):
    ref_out, ref_res = cpu_backend.rms_norm(x, weight, 1e-6, residual)
    out, res = cuda_backend.rms_norm(x_dev, weight, 1e-6, residual.cuda() if residual is not None else None)
    assert rel_err(out, ref_out) <= 2e-3
    assert torch.equal(res.cpu(), ref_res)


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("hidden", [64, 577, 4099])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(cuda_backend, cpu_backend, num_tokens, hidden, with_residual):
    gen = torch.Generator().manual_seed(num_tokens * 7 + hidden)
    wide = torch.randn(num_tokens, hidden + 5, generator=gen).half()
    x = wide[:, 3:3 + hidden]  # a strided view, as a slice of a fused projection would be
    residual = torch.randn(num_tokens, hidden, generator=gen).half() if with_residual else None
    weight = torch.rand(hidden, generator=gen) + 0.5
    _check(cuda_backend, cpu_backend, wide.cuda()[:, 3:3 + hidden], x, weight, residual)


@pytest.mark.parametrize("num_tokens", [1, 8, 37])
@pytest.mark.parametrize("hidden", [576, 4096, 12296])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_vectorized(cuda_backend, cpu_backend, num_tokens, hidden, with_residual):
    gen = torch.Generator().manual_seed(num_tokens * 11 + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).half()
    residual = torch.randn(num_tokens, hidden, generator=gen).half() if with_residual else None
    weight = torch.rand(hidden, generator=gen) + 0.5
    _check(cuda_backend, cpu_backend, x.cuda(), x, weight, residual)
