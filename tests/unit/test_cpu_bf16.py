"""The CPU backend's bf16 linears (`voltserve.backends.cpu_bf16`): error bounds against float64 on fresh random
inputs, batch invariance, the lm_head's exact greedy argmax (near-ties included), and the backend's routing."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.kutils import make_quant

from voltserve.backends.cpu import CpuBackend
from voltserve.backends.cpu_bf16 import Bf16Linear, Bf16Logits, bf16_gemm_supported

needs_bf16 = pytest.mark.skipif(not bf16_gemm_supported(), reason="torch reports no oneDNN bf16 GEMM on this CPU")


def _near_ties(vocab: int, hidden: int, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose rows come in pairs that differ by ~1e-4 of their norm, and x rows that put a different
    pair on top each: the two logits of the top pair are closer than bf16 can tell apart."""
    w = torch.randn(vocab, hidden, generator=gen) * 0.08
    w[1::2] = w[0::2] + torch.randn(vocab // 2, hidden, generator=gen) * 1e-5
    x = torch.randn(rows, hidden, generator=gen) * 2
    x += 3 * w[torch.randint(0, vocab // 2, (rows,), generator=gen) * 2] / w[0].norm() ** 2 * 8
    return w, x


@needs_bf16
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logits_argmax_is_the_float64_argmax_even_on_near_ties(seed):
    gen = torch.Generator().manual_seed(seed)
    w, x = _near_ties(4096, 576, 24, gen)
    head = Bf16Logits(w)
    y = head(x)
    exact = x.double() @ w.double().t()
    assert torch.equal(y.argmax(-1), exact.argmax(-1))
    plain = Bf16Linear(w)(x).float()
    assert not torch.equal(plain.argmax(-1), exact.argmax(-1))  # the ties are real: bf16 alone gets some wrong


@needs_bf16
@pytest.mark.parametrize("seed", [3, 4])
def test_logits_within_their_stated_bound(seed):
    """Every logit is within the bound B_v of the docstring of the float64 value; the recomputed ones (those
    that could be the largest) within 1e-6 relative."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(8192, 576, generator=gen) * 0.08
    x = torch.randn(16, 576, generator=gen) * 3
    head = Bf16Logits(w)
    y, exact = head(x).double(), x.double() @ w.double().t()
    bound = (head.input_error * x.double().norm(dim=-1, keepdim=True) * head.row_norms.double()
             + head.output_error * y.abs())
    assert ((y - exact).abs() <= bound).all()
    rows, cols = head._screen(x)[2:4]
    assert len(rows) >= x.shape[0]  # each row's own largest at least
    assert torch.allclose(y[rows, cols], exact[rows, cols], rtol=1e-6, atol=1e-6)
    assert (head.candidates(x) >= 1).all() and int(head.candidates(x).sum()) == len(rows)


@needs_bf16
@pytest.mark.parametrize("exponent", [-125, -85, -40, 0, 40, 100])
def test_argmax_holds_at_any_scale_of_x(exponent):
    """x scaled by 2^e: the bf16 products would flush subnormals and the norms under- or overflow; the argmax
    stays the float64 one (up to fp32 rounding of the top logits: ties in fp32 are excluded here)."""
    gen = torch.Generator().manual_seed(8)
    w, x = _near_ties(2048, 576, 12, gen)
    x = x.double() * 2.0 ** exponent
    exact = x @ w.double().t()
    y = Bf16Logits(w)(x.float())
    top2 = exact.topk(2, dim=-1).values.float()
    clear = top2[:, 0] != top2[:, 1]  # the two largest differ after fp32 rounding
    assert clear.sum() >= 8
    assert torch.equal(y.argmax(-1)[clear], exact.argmax(-1)[clear])


@needs_bf16
def test_rows_of_zeros_and_overflow_are_computed_whole():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(4096, 64, generator=gen)
    head = Bf16Logits(w)
    x = torch.randn(3, 64, generator=gen)
    x[1] = 0
    x[2] = 1e38 * w[7] / w[7].norm()  # its largest logit, ~8e38, overflows fp32 (inf)
    y = head(x)
    assert torch.equal(y[1], torch.zeros(4096))
    assert head.candidates(x)[1:].tolist() == [4096, 4096]
    assert torch.equal(y[2], torch.mv(w, x[2]))  # as the fp32 lm_head computes it
    assert torch.equal(y[0], head(x[:1])[0])


@needs_bf16
def test_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(5)
    w, x = _near_ties(4096, 576, 37, gen)
    head, linear = Bf16Logits(w), Bf16Linear(w)
    full_logits, full = head(x), linear(x)
    for rows in (slice(0, 1), slice(5, 7), slice(3, 11), slice(20, 37)):
        assert torch.equal(head(x[rows]), full_logits[rows])
        assert torch.equal(linear(x[rows]), full[rows])


@needs_bf16
def test_linear_error_is_bf16_rounding():
    """x and the weight rounded to bf16 (u = 2^-8 each), y rounded to bf16: relative error well under 2%."""
    gen = torch.Generator().manual_seed(6)
    w, x = torch.randn(1536, 576, generator=gen), torch.randn(9, 576, generator=gen)
    y, exact = Bf16Linear(w)(x), x.double() @ w.double().t()
    assert y.dtype == torch.float32 and y.shape == (9, 1536)
    assert ((y - exact).abs().max() / exact.abs().max()).item() < 2e-2


@needs_bf16
def test_backend_routes_q8_0_to_bf16_and_keeps_float_for_the_reference():
    gen = torch.Generator().manual_seed(7)
    quant, weight = make_quant("Q8_0", 256, 128, gen)
    auto, reference = CpuBackend(torch.float32, use_int4=True), CpuBackend(torch.float32, use_int4=False)
    assert isinstance(auto.prepare_linear(weight, quant), Bf16Linear)
    assert not isinstance(auto.prepare_linear(weight, quant), Bf16Logits)
    head = auto.prepare_linear(weight, quant, logits=True)
    q4, q4_weight = make_quant("Q4_0", 64, 64, gen)
    assert isinstance(auto.prepare_linear(q4_weight, q4, logits=True), Bf16Logits)
    assert isinstance(head, Bf16Logits)
    assert isinstance(reference.prepare_linear(weight, quant, logits=True), torch.Tensor)
    assert isinstance(CpuBackend(torch.bfloat16, use_int4=True).prepare_linear(weight, quant), torch.Tensor)
    x = torch.randn(3, 128, generator=gen)
    assert torch.equal(auto.linear(x, head).argmax(-1), (x.double() @ weight.double().t()).argmax(-1))


def test_without_onednn_bf16_the_backend_keeps_fp32_and_int4(monkeypatch):
    """CPUs where torch reports no bf16 GEMM (emulated, slower than fp32) keep the fp32 weight, and a Q4
    lm_head the int4 kernel."""
    import voltserve.backends.cpu_bf16 as cpu_bf16
    from voltserve.backends.cpu_int4 import Int4Linear

    monkeypatch.setattr(cpu_bf16, "bf16_gemm_supported", lambda: False)
    backend = CpuBackend(torch.float32, use_int4=True)
    gen = torch.Generator().manual_seed(10)
    quant, weight = make_quant("Q8_0", 64, 64, gen)
    linear = backend.prepare_linear(weight, quant, logits=True)
    assert isinstance(linear, torch.Tensor) and torch.equal(linear, weight)
    q4, q4_weight = make_quant("Q4_0", 64, 64, gen)
    assert isinstance(backend.prepare_linear(q4_weight, q4, logits=True), Int4Linear)


@needs_bf16
@pytest.mark.slow
def test_default_model_greedy_tokens_equal_the_fp32_lm_head(smollm2):
    """The default model on the auto path (int4 layers), its Q8_0 lm_head as Bf16Logits or as the fp32
    weight: the same greedy tokens for four prompts (before Bf16Logits recomputed the top logits, plain bf16
    logits changed them within 48 tokens on 10 of 11 prompts)."""
    from tests.e2e.model_helpers import generate
    from voltserve.models.llama import LlamaModel

    tok = smollm2.tokenizer
    prompts = [tok.encode(t) for t in ("The quick brown fox", "def fibonacci(n):", "In 1492, Columbus",
                                       "The derivative of x^2 is")]
    backend = CpuBackend(torch.float32, use_int4=True)
    fast = LlamaModel(smollm2.config, smollm2.tensors, backend, smollm2.quantized, max_positions=512)
    assert isinstance(fast.lm_head, Bf16Logits)
    got = [tokens for tokens, _ in generate(fast, backend, prompts, 32, temperature=0)]
    reference = CpuBackend(torch.float32, use_int4=True)
    reference.use_bf16 = False  # the lm_head in fp32, the int4 layers as in `backend`
    slow = LlamaModel(smollm2.config, smollm2.tensors, reference, smollm2.quantized, max_positions=512)
    assert isinstance(slow.lm_head, torch.Tensor)
    want = [tokens for tokens, _ in generate(slow, reference, prompts, 32, temperature=0)]
    assert got == want
