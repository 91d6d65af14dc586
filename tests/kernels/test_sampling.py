"""Greedy sampling (argmax + its log-probability) vs torch.argmax / log_softmax on the CPU.

Bounds: token ids exact (first index on ties); logprob abs 1e-4 (fp32 logits) / 1e-3 (fp16 logits).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("vocab", [49152, 151937, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_logprob(cuda_backend, rows, vocab, dtype):
    gen = torch.Generator().manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    logits[0, vocab // 3] = logits[0, vocab // 2] = 40.0  # tie: the lower index wins
    ids, logprobs = cuda_backend.sample_greedy(logits.cuda())
    ref_ids = logits.float().argmax(-1)
    assert torch.equal(ids.cpu(), ref_ids)
    assert int(ids[0]) == vocab // 3
    ref_lp = torch.log_softmax(logits.float(), -1).gather(1, ref_ids[:, None])[:, 0]
    tol = 1e-4 if dtype == torch.float32 else 1e-3
    assert torch.allclose(logprobs.cpu(), ref_lp, atol=tol, rtol=0)
