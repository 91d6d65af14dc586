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
