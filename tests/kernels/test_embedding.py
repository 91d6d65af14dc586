"""embedding_f16 / embedding_q8_0 vs CpuBackend.embedding. Bound: fp16 output of exact table values: rel 1e-3."""

import pytest
import torch
from tests.kernels.kutils import make_quant, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("hidden", [200, 576, 1003])
def test_embedding_f16(cuda_backend, cpu_backend, num_tokens, hidden):
    gen = torch.Generator().manual_seed(num_tokens * hidden)
    table = torch.randn(1001, hidden, generator=gen).half().float()
    ids = torch.randint(0, 1001, (num_tokens,), generator=gen)
    got = cuda_backend.embedding(ids.cuda(), cuda_backend.prepare_embedding(table))
    assert rel_err(got, cpu_backend.embedding(ids, table)) <= 1e-3


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("hidden", [32, 576, 2080])
def test_embedding_q8_0(cuda_backend, cpu_backend, num_tokens, hidden):
    gen = torch.Generator().manual_seed(7 + num_tokens * hidden)
    quant, table = make_quant("Q8_0", 1003, hidden, gen)
    ids = torch.randint(0, 1003, (num_tokens,), generator=gen)
    emb = cuda_backend.prepare_embedding(table, quant)
    assert emb.fmt == "Q8_0"
    got = cuda_backend.embedding(ids.cuda(), emb)
    assert rel_err(got, cpu_backend.embedding(ids, table)) <= 1e-3


def test_embedding_out_of_range_ids_give_zero_rows(cuda_backend):
    table = torch.randn(10, 64)
    got = cuda_backend.embedding(torch.tensor([-1, 3, 10], device="cuda"), cuda_backend.prepare_embedding(table))
    assert torch.equal(got[0].cpu(), torch.zeros(64, dtype=torch.float16))
    assert torch.equal(got[2].cpu(), torch.zeros(64, dtype=torch.float16))
