"""linear: GEMV (m <= 16; each case under `gemv_choice`: the routing, the SM70 kernels, gemv_mma) and tiled GEMM (m >= 17) on fp16 and GGUF Q4_0 / Q4_1 / Q8_0 weights vs
CpuBackend.linear on the dequantized fp32 weights and the same fp16 activations; quantized GEMMs both through
gemm_tc and through dequant_f16 + cuBLAS (`quant_gemm`).

Bound: max |got - ref| <= 3e-3 * max |ref| (fp32 accumulation; one fp16 output rounding is 4.9e-4 relative).
"""

import pytest
import torch
from tests.kernels.kutils import backend_settings, capture, launched_kernels, make_quant, rel_err

from voltserve.backends.cuda.linear import launch_linear

pytestmark = pytest.mark.gpu
TOL = 3e-3


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 37, 100, 133])
@pytest.mark.parametrize("nk", [(333, 576), (1537, 1536), (70, 2816)])
def test_linear_quant(cuda_backend, cpu_backend, gemv_choice, qtype, m, nk):
    n, k = nk
    gen = torch.Generator().manual_seed(m * n + k)
    quant, weight = make_quant(qtype, n, k, gen)
    x = torch.randn(m, k, generator=gen).half()
    w = cuda_backend.prepare_linear(weight, quant)
    assert w.fmt == qtype and w.data.dtype == torch.uint8  # raw blocks on the device, never fp16
    got = cuda_backend.linear(x.cuda(), w)
    assert rel_err(got, cpu_backend.linear(x.float(), weight)) <= TOL


@pytest.mark.parametrize("m", [1, 5, 8, 13, 37])
@pytest.mark.parametrize("nk", [(333, 577), (1001, 1024), (77, 1800)])
def test_linear_f16(cuda_backend, cpu_backend, gemv_choice, m, nk):
    n, k = nk
    gen = torch.Generator().manual_seed(m + n + k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).half().float()
    x = torch.randn(m, k, generator=gen).half()
    w = cuda_backend.prepare_linear(weight)
    assert rel_err(cuda_backend.linear(x.cuda(), w), cpu_backend.linear(x.float(), weight)) <= TOL


@pytest.mark.parametrize("m", [17, 70])
def test_gemm_tiled_f16(cuda_backend, cpu_backend, m):
    """The tiled kernel on fp16 weights (the backend sends those to cuBLAS; this covers the kernel itself)."""
    gen = torch.Generator().manual_seed(m)
    weight = (torch.randn(129, 301, generator=gen) * 0.05).half().float()
    x = torch.randn(m, 301, generator=gen).half()
    got = launch_linear(cuda_backend, x.cuda(), cuda_backend.prepare_linear(weight), f16_gemm="tiled")
    assert rel_err(got, cpu_backend.linear(x.float(), weight)) <= TOL


def test_linear_strided_input(cuda_backend, cpu_backend):
    gen = torch.Generator().manual_seed(1)
    quant, weight = make_quant("Q4_1", 65, 96, gen)
    wide = torch.randn(5, 101, generator=gen).half()
    got = cuda_backend.linear(wide.cuda()[:, 3:99], cuda_backend.prepare_linear(weight, quant))
    assert rel_err(got, cpu_backend.linear(wide[:, 3:99].float(), weight)) <= TOL


@pytest.mark.parametrize("fmt", ["F16", "Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("nk", [(97, 2304), (45, 96), (70, 100)])
def test_linear_rows_independent(cuda_backend, gemv_choice, fmt, nk):
    """Each output row is the same fixed-order sum whatever the other rows: bitwise equal between launches that
    run the same kernel (`gemv_kernel_name`: gemv_mma on SM80+; else quant gemv for m <= 2 and gemv_q for
    m >= 3 when k % 256 == 0, fp16 gemv for all m)."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    n, k = nk
    gen = torch.Generator().manual_seed(n + k)
    if fmt == "F16":
        w = cuda_backend.prepare_linear((torch.randn(n, k, generator=gen) * 0.05).half().float())
    else:
        if k % 32:
            pytest.skip("GGUF rows are whole 32-weight blocks")
        quant, weight = make_quant(fmt, n, k, gen)
        w = cuda_backend.prepare_linear(weight, quant)
    x = torch.randn(11, k, generator=gen).half().cuda()
    full = cuda_backend.linear(x, w)  # launches of 8 + 3 rows
    kernel = {m: gemv_kernel_name(cuda_backend, w, m, int(k % 8 == 0)) for m in (1, 2, 3, 8)}
    for m in (3, 8):
        assert torch.equal(cuda_backend.linear(x[:m].contiguous(), w), full[:m]), (fmt, m)
    ones = [m for m in (1, 2, 3, 8) if kernel[m] == kernel[1]]
    for m in ones[1:]:
        assert torch.equal(cuda_backend.linear(x[:1].contiguous(), w), cuda_backend.linear(x[:m].contiguous(), w)[:1])


# SmolLM2-135M linears (out x in) and its lm_head: the decode-batch / prefill shapes of gemm_tc (WMMA, split-K)
SMOL = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


@pytest.fixture(params=["tc", "dequant"])
def quant_gemm(request, cuda_backend):
    """Runs a quantized-GEMM test through gemm_tc ("tc") and through dequant_f16 + cuBLAS ("dequant")."""
    with backend_settings(cuda_backend, quant_gemm=request.param):
        yield request.param


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("m", [17, 64, 100, 512])
@pytest.mark.parametrize("nk", SMOL)
def test_gemm_tc_smollm_shapes(cuda_backend, cpu_backend, quant_gemm, qtype, m, nk):
    n, k = nk
    if n == 49152 and (qtype != "Q8_0" or m == 100):
        pytest.skip("lm_head: Q8_0 only, fewer cases")
    gen = torch.Generator().manual_seed(m + n + k)
    quant, weight = make_quant(qtype, n, k, gen)
    x = torch.randn(m, k, generator=gen).half()
    with launched_kernels(cuda_backend) as names:
        got = cuda_backend.linear(x.cuda(), cuda_backend.prepare_linear(weight, quant))
    assert ("dequant_f16" if quant_gemm == "dequant" else "gemm_tc") in names
    assert rel_err(got, cpu_backend.linear(x.float(), weight)) <= TOL


@pytest.mark.parametrize("m,nk", [(64, (576, 1536)), (17, (333, 96)), (40, (960, 576)), (100, (960, 576)),
                                  (128, (576, 1536)), (512, (3072, 576))])
def test_gemm_tc_deterministic_and_graph_replay(cuda_backend, m, nk):
    """Split-K partials are merged in fixed order by the last block: repeated launches and a replayed CUDA graph
    are bitwise equal to eager, and the arrival counters are back at zero."""
    from voltserve.backends.cuda import kernels

    n, k = nk
    gen = torch.Generator().manual_seed(n * k + m)
    quant, weight = make_quant("Q4_1", n, k, gen)
    w = cuda_backend.prepare_linear(weight, quant)
    x = torch.randn(m, k, generator=gen).half().cuda()
    with backend_settings(cuda_backend, quant_gemm="tc"):
        _check_replays(cuda_backend, x, w)
    assert int(cuda_backend.gemm_counters.abs().sum()) == 0
    splits = kernels.gemm_tc_plan(m, n, k, cuda_backend.num_sms)[1]
    assert splits > 1 if m < 512 else splits == 1  # both the split-K and the direct epilogue are covered


def _check_replays(backend, x, w):
    """backend.linear(x, w) three more times and from a replayed CUDA graph: bitwise equal to the first call."""
    first = backend.linear(x, w)
    for _ in range(3):
        assert torch.equal(backend.linear(x, w), first)
    graph, captured = capture(backend, lambda: backend.linear(x, w))
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)
    return first


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("nk", [(333, 576), (4096, 1024), (70, 2816), (70, 14336), (64, 5120), (66000, 256)])
def test_dequantize_rows_exact(cuda_backend, qtype, nk):
    """dequant_f16 writes each weight as d * q (+ m) in fp32 rounded once to fp16, which is the fp16 of the
    exact dequantized value here (d * q is exact in fp32, so one rounding of the exact d * q + m either way): bit
    for bit, from row 0 and from an offset; k = 5,120 and 14,336: several blocks a row, the last part-filled;
    66,000 rows: blocks loop over rows past the grid's 65,535."""
    from voltserve.backends.cuda.dequant_gemm import dequantize_rows

    n, k = nk
    quant, weight = make_quant(qtype, n, k, torch.Generator().manual_seed(n + k))
    w = cuda_backend.prepare_linear(weight, quant)
    out = torch.full((n, k), float("nan"), dtype=torch.float16, device="cuda")
    assert torch.equal(dequantize_rows(cuda_backend, w, 0, out).cpu(), weight.half())
    tail = torch.full((n - 5, k), float("nan"), dtype=torch.float16, device="cuda")
    assert torch.equal(dequantize_rows(cuda_backend, w, 5, tail).cpu(), weight[5:].half())
    for bad in (torch.empty(3, k, dtype=torch.float16, device="cuda"),      # rows past the weight's at n0 = n - 2
                torch.empty(2, k + 32, dtype=torch.float16, device="cuda"),  # another k
                torch.empty(2, k, dtype=torch.float32, device="cuda")):     # not fp16
        with pytest.raises(ValueError):
            dequantize_rows(cuda_backend, w, n - 2, bad)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_dequant_gemm_chunks_and_graph_replay(cuda_backend, cpu_backend, monkeypatch, qtype):
    """A weight larger than the scratch goes in chunks of rows (here 4 launches, the last short), each cuBLAS
    product writing its columns of y; eager, repeated and graph-replayed calls are bitwise equal."""
    from voltserve.backends.cuda import kernels

    n, k, m = 1000, 512, 150
    monkeypatch.setattr(kernels, "DEQUANT_SCRATCH_BYTES", 300 * 2 * k)
    gen = torch.Generator().manual_seed(7)
    quant, weight = make_quant(qtype, n, k, gen)
    w = cuda_backend.prepare_linear(weight, quant)
    x = torch.randn(m, k, generator=gen).half()
    with backend_settings(cuda_backend, quant_gemm="dequant"):
        with launched_kernels(cuda_backend) as names:
            cuda_backend.linear(x.cuda(), w)
        assert names == ["dequant_f16"] * 4
        got = _check_replays(cuda_backend, x.cuda(), w)
    assert rel_err(got, cpu_backend.linear(x.float(), weight)) <= TOL


def test_gemm_tc_plan():
    from voltserve.backends.cuda import kernels

    for m in (17, 64, 512):
        for n, k in SMOL + [(70, 2816), (333, 96)]:
            bn, splits, k_split = kernels.gemm_tc_plan(m, n, k, 132)
            assert bn in kernels.GEMM_TC_BNS and k_split % kernels.GEMM_TC_KC == 0
            assert (splits - 1) * k_split < k <= splits * k_split  # every split non-empty, k covered
