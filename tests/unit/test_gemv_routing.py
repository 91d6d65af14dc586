"""Which decode GEMV kernel a launch runs (backends/cuda/linear.py): pure Python, no GPU.

SM70 (V100) must never be handed gemv_mma (mma.m16n8k16 is SM80+; its SM70 build is an empty body), and on SM80+
the shapes gemv_mma cannot take (k % 32, unaligned x or weights) must fall back to gemv / gemv_q.
"""

from types import SimpleNamespace

import pytest
import torch

from voltserve.backends.cuda.linear import GEMV_MMA_MIN_ROWS, CudaLinear, gemv_kernel_name


def _backend(arch, choice="auto"):
    return SimpleNamespace(loader=SimpleNamespace(arch=arch), gemv_kernel=choice)


def _linear(fmt, n, k):
    if fmt == "F16":
        return CudaLinear("F16", torch.zeros(n, k, dtype=torch.float16), n, k, 2 * k)
    block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[fmt]
    return CudaLinear(fmt, torch.zeros(n, k // 32 * block, dtype=torch.uint8), n, k, k // 32 * block)


@pytest.mark.parametrize("fmt", ["F16", "Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_sm70_never_takes_mma(fmt, rows):
    w = _linear(fmt, 64, 4096)
    for choice in ("auto", "mma", "scalar"):
        assert gemv_kernel_name(_backend(70, choice), w, rows) != "gemv_mma"
    want = "gemv_q" if fmt != "F16" and rows >= 3 else "gemv"
    assert gemv_kernel_name(_backend(70), w, rows) == want


@pytest.mark.parametrize("fmt", ["F16", "Q4_0", "Q4_1", "Q8_0"])
def test_sm90_routing(fmt):
    w = _linear(fmt, 64, 4096)
    for rows in (1, 2, 4, 8):
        auto = gemv_kernel_name(_backend(90), w, rows)
        scalar = "gemv_q" if fmt != "F16" and rows >= 3 else "gemv"
        assert auto == ("gemv_mma" if rows >= GEMV_MMA_MIN_ROWS[fmt] else scalar), rows
        # fp16 at m = 1: gemv_mma only for the norm-fused linear without SwiGLU (where it measured faster)
        if fmt == "F16" and rows == 1:
            assert gemv_kernel_name(_backend(90), w, rows, norm=True) == "gemv_mma"
            assert gemv_kernel_name(_backend(90), w, rows, norm=True, silu=True) == "gemv"
        assert gemv_kernel_name(_backend(90, "mma"), w, rows) == "gemv_mma"
        assert gemv_kernel_name(_backend(90, "scalar"), w, rows) != "gemv_mma"
    assert gemv_kernel_name(_backend(90), w, 8, vec_ok=0) != "gemv_mma"  # unaligned x rows


def test_sm90_shapes_mma_cannot_take():
    assert gemv_kernel_name(_backend(90, "mma"), _linear("F16", 64, 4104), 8) == "gemv"  # k % 32 != 0
    for fmt, takes in (("Q4_1", False), ("Q4_0", True), ("Q8_0", True)):  # weights 2 bytes off 4-byte alignment
        w = _linear(fmt, 64, 4096)
        buf = torch.zeros(w.data.numel() + 2, dtype=torch.uint8)
        w.data = buf[2:].view(64, w.row_bytes)
        assert (gemv_kernel_name(_backend(90, "mma"), w, 8) == "gemv_mma") == takes, fmt
