"""Which GEMM a quantized weight takes at m >= GEMM_MIN_ROWS x rows (backends/cuda/dequant_gemm.py): gemm_tc, or
dequant_f16 + cuBLAS on equal, aligned chunks of the weight's rows. Pure Python, no GPU."""

from types import SimpleNamespace

import pytest

from voltserve.backends.cuda import kernels
from voltserve.backends.cuda.dequant_gemm import dequant_chunk_rows, dequant_gemm_min_rows, dequant_gemm_wanted


def _weight(n, k):
    return SimpleNamespace(out_features=n, in_features=k)


def _backend(arch, quant_gemm="auto"):
    return SimpleNamespace(quant_gemm=quant_gemm, loader=SimpleNamespace(arch=arch))


def test_dequant_gemm_wanted():
    """SM90+: every GEMM on a weight of >= 4M weights (measured on the H200); below SM90 from 256 rows (projected,
    not measured); smaller weights never; the knob overrides both."""
    h200, v100 = _backend(90), _backend(70)
    llama_o, smollm_up = _weight(4096, 4096), _weight(3072, 576)
    assert dequant_gemm_min_rows(90) == dequant_gemm_min_rows(100) == kernels.GEMM_MIN_ROWS == 17
    assert dequant_gemm_min_rows(80) == dequant_gemm_min_rows(70) == 256
    assert dequant_gemm_wanted(h200, 17, llama_o) and dequant_gemm_wanted(h200, 4096, llama_o)
    assert not dequant_gemm_wanted(v100, 255, llama_o) and dequant_gemm_wanted(v100, 256, llama_o)
    assert not dequant_gemm_wanted(h200, 4096, smollm_up)      # small weight: gemm_tc
    assert kernels.DEQUANT_GEMM_MIN_WEIGHTS == 1 << 22
    assert dequant_gemm_wanted(h200, 17, _weight(1024, 4096))
    assert not dequant_gemm_wanted(h200, 17, _weight(1023, 4096))
    assert not dequant_gemm_wanted(_backend(90, "tc"), 4096, llama_o)
    assert dequant_gemm_wanted(_backend(70, "dequant"), kernels.GEMM_MIN_ROWS, smollm_up)


@pytest.mark.parametrize("n,k,rows", [(28672, 4096, 28672), (4096, 14336, 4096), (128256, 4096, 32128),
                                      (57344, 8192, 14336), (8192, 28672, 4096), (1000, 512, 1000)])
def test_dequant_chunk_rows(n, k, rows):
    """Equal chunks of <= 256 MiB of fp16 rows, each a multiple of 128 rows: Llama-3-8B's gate_up and down in one
    (64 MB chunks measured 14-15% slower at 512 x rows), its lm_head in 4, Llama-3-70B's gate_up in 4 and down
    in 2 (not 4,681 + 3,511 rows: a slice of y starting 8-byte aligned ran cuBLAS 3x slower)."""
    got = dequant_chunk_rows(n, k)
    assert got == rows
    chunks = -(-n // got)
    assert got == n or got % kernels.DEQUANT_CHUNK_ROWS == 0
    assert (chunks - 1) * got < n <= chunks * got
    assert got * k * 2 <= kernels.DEQUANT_SCRATCH_BYTES or chunks == 1


def test_dequant_gemm_chunks_on_the_host(monkeypatch):
    """dequant_gemm's orchestration with the kernel replaced by a host copy of the dequantized rows (CPU tensors):
    4 launches of 256, 256, 256 and 232 rows, each grid covering its rows, each chunk's product in its columns
    of y. The kernel itself is tested on the GPU (tests/kernels/test_linear.py)."""
    import ctypes

    import torch

    from tests.kernels.kutils import make_quant
    from voltserve.backends.cuda.dequant_gemm import dequant_gemm

    n, k, m = 1000, 512, 20
    monkeypatch.setattr(kernels, "DEQUANT_SCRATCH_BYTES", 300 * 2 * k)  # 256-row chunks
    quant, weight = make_quant("Q4_1", n, k, torch.Generator().manual_seed(1))
    data = torch.from_numpy(quant.data)
    w = SimpleNamespace(fmt="Q4_1", layout="gguf", data=data, row_bytes=data.shape[1], out_features=n,
                        in_features=k)
    half = weight.half()
    launches = []

    def launch(module, kernel, spec, grid, block, smem, p):
        n0 = (p.w - data.data_ptr()) // w.row_bytes
        launches.append((kernel, n0, p.n, grid))
        assert p.y_stride == p.k == k and grid[0] * 8 * 128 * kernels.DEQUANT_GROUPS >= k and grid[1] == p.n
        rows = half[n0:n0 + p.n].contiguous()
        ctypes.memmove(p.y, rows.data_ptr(), rows.numel() * 2)

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).half()
    y = torch.full((m, n), float("nan"), dtype=torch.float16)
    dequant_gemm(SimpleNamespace(_launch=launch), x, w, y)
    assert [(n0, rows) for _, n0, rows, _ in launches] == [(0, 256), (256, 256), (512, 256), (768, 232)]
    assert {kernel for kernel, *_ in launches} == {"dequant_f16"}
    ref = x.float() @ half.float().t()
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 3e-3


def test_gemm_tc_plan_splits_a_mixed_step_as_finely_as_a_decode_step():
    """65-128 rows (a mixed CUDA graph: 64 decode rows and a prompt bucket) run the k chunks per block of 64
    rows (per_m_tile); from 129 rows, and with per_m_tile off, the target stays 2 blocks an SM."""
    from voltserve.backends.cuda import kernels

    # the default model's shapes (SmolLM2-135M: qkv 960 x 576, o_proj 576 x 576, gate_up 3072 x 576, down 576 x
    # 1536) on 132 SMs: (bn, splits, k_split)
    expected = {(960, 576): ((32, 9, 64), (32, 9, 64), (32, 5, 128)),
                (576, 576): ((32, 9, 64), (32, 9, 64), (32, 5, 128)),
                (3072, 576): ((32, 3, 192), (32, 3, 192), (32, 2, 320)),
                (576, 1536): ((32, 12, 128), (32, 12, 128), (32, 8, 192))}
    for (n, k), (at64, at128, fixed128) in expected.items():
        assert kernels.gemm_tc_plan(64, n, k, 132) == at64
        assert kernels.gemm_tc_plan(128, n, k, 132) == at128
        assert kernels.gemm_tc_plan(128, n, k, 132, per_m_tile=False) == fixed128
        assert kernels.gemm_tc_plan(64, n, k, 132, per_m_tile=False) == at64
        assert kernels.gemm_tc_plan(512, n, k, 132) == kernels.gemm_tc_plan(512, n, k, 132, per_m_tile=False)
    # where the 64-row launch does not split k, the 65-128-row plan is the one before per_m_tile (BN included)
    for n, k, sms in ((14336, 4096, 132), (6144, 4096, 80), (9000, 4096, 132)):
        assert kernels.gemm_tc_plan(64, n, k, sms)[1] == 1
        assert kernels.gemm_tc_plan(100, n, k, sms) == kernels.gemm_tc_plan(100, n, k, sms, per_m_tile=False)
    for m in (17, 65, 100, 128, 129, 512):
        for n, k in ((960, 576), (70, 2816), (333, 96), (14336, 4096)):
            bn, splits, k_split = kernels.gemm_tc_plan(m, n, k, 132)
            assert (splits - 1) * k_split < k <= splits * k_split  # every split non-empty, k covered
