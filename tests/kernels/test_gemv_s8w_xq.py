"""gemv_s8w's quantized output (ptx/gemv_s8.cu, `linear.swiglu_xq_target`): a one-row gate_up launch (RMSNorm +
SwiGLU) also writes its output quantized for the one-row gemv_s8w launch on down after it, which then skips its
quantize_s8 launch. The bytes must be quantize_s8's on the fp16 output, so down's output is bit for bit what it is
with VOLTSERVE_MLP_XQ=off; the tests compare both runs exactly and the handed bytes against a quantize_s8 launch.
"""

import pytest
import torch
from tests.kernels.kutils import backend_settings, launched_kernels, repacked_weight

pytestmark = pytest.mark.gpu
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def _settings(backend, **extra):
    """Repacked quant rows, one-row calls on gemv_s8w (as test_gemv_s8w.py); SM80+ only."""
    if backend.loader.arch < 80:
        pytest.skip("repacked rows and the int8 decode kernels are SM80+ (gemv_int8.gemv_s8_enabled)")
    return backend_settings(backend, gemv_kernel="auto", quant_repack="on", gemv_s8="on", gemv_s8_m1="warp",
                            **extra)


def _mlp(backend, gate_fmt, down_fmt, k, inner, seed):
    """Random gate_up [2 inner, k] and down [256, inner] weights, x [1, k], a norm and a residual."""
    _, _, gate_up = repacked_weight(backend, gate_fmt, 2 * inner, k, seed)
    _, _, down = repacked_weight(backend, down_fmt, 256, inner, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(1, k, generator=gen).half().cuda()
    norm = backend.prepare_norm(torch.rand(k, generator=gen) + 0.5)
    res = torch.randn(1, 256, generator=gen).half().cuda()
    return gate_up, down, x, norm, res


def _run(backend, mlp_xq, gate_up, down, x, norm, res):
    """(SwiGLU output, down's output, launched kernels, the pending quantized x after gate_up or None)."""
    with backend_settings(backend, mlp_xq=mlp_xq), launched_kernels(backend) as names:
        act = backend.norm_linear(x, norm, 1e-5, gate_up, silu=True, then=down)
        pending = backend.xq_pending
        out = backend.linear(act, down, residual=res)
    assert backend.xq_pending is None  # taken by down's call
    return act, out, names, pending


def _quantize_s8_bytes(backend, act, fmt):
    """What a quantize_s8 launch writes for act [1, n] before a one-row gemv_s8w on a `fmt` weight: (quantized
    bytes [n], scales [n / 32 * 8] as bytes), the rows' 16 pad bytes left out (no kernel writes them)."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.gemv_int8 import s8_quantized_x

    n = act.shape[1]
    spec = kernels.gemv_s8_spec(fmt, False, 1, False, True)
    xq, _ = s8_quantized_x(backend, act, spec, kernels.gemv_s8_smem_bytes(1, n), None, 0.0, 1, True)
    return _split(xq, n)


def _split(xq, n):
    pitch = n + 16
    return xq[:n].cpu(), xq[pitch:pitch + n // 32 * 8].cpu()


@pytest.mark.parametrize("grid", ["persistent", "full"])
@pytest.mark.parametrize("down_fmt", FORMATS)
@pytest.mark.parametrize("gate_fmt", FORMATS)
def test_gate_up_hands_down_quantized_x(cuda_backend, gate_fmt, down_fmt, grid):
    """Every gate_up / down format pair (Q8_0's x layout differs from Q4's, Q4_0 stores -8 s): the SwiGLU output
    and down's output equal the off run's bit for bit, one quantize_s8 launch fewer, and the handed bytes equal a
    quantize_s8 launch's on the output. 4,608 outputs: 144 chunks of 32, several a block in the persistent grid."""
    with _settings(cuda_backend, gemv_s8_x="launch", gemv_s8_grid=grid):
        case = _mlp(cuda_backend, gate_fmt, down_fmt, 1024, 4608, 5)
        act_off, out_off, names_off, pending_off = _run(cuda_backend, "off", *case)
        act, out, names, pending = _run(cuda_backend, "auto", *case)
        assert pending_off is None
        assert names_off == ["quantize_s8", "gemv_s8w", "quantize_s8", "gemv_s8w"]
        assert names == ["quantize_s8", "gemv_s8w", "gemv_s8w"]
        assert torch.equal(act, act_off) and torch.equal(out, out_off)
        got_q, got_s = _split(pending.xq, 4608)
        want_q, want_s = _quantize_s8_bytes(cuda_backend, act, down_fmt)
        assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)


@pytest.mark.parametrize("gate_fmt", ["Q4_1", "Q8_0"])
def test_chunks_past_the_slots_fall_back(cuda_backend, gate_fmt):
    """A persistent grid whose blocks would take more 32-output chunks than their smem slots
    (kernels.GEMV_S8W_OUT_SLOTS; one SM's worth of blocks here) does not hand x on: down runs its own quantize_s8.
    At exactly the slots a block, it does. Both equal the off run bit for bit."""
    from voltserve.backends.cuda import kernels

    with _settings(cuda_backend, gemv_s8_x="launch", gemv_s8_grid="persistent", num_sms=1):
        spec = kernels.gemv_s8_spec(gate_fmt, True, 1, False, True)
        threads = 32 * spec["S8W_WARPS"]
        blocks = cuda_backend._occupancy("gemv_s8", "gemv_s8w", spec, kernels.gemv_s8w_smem_bytes(1024), threads)
        full = kernels.GEMV_S8W_OUT_SLOTS * 32 * blocks  # outputs at exactly the slots
        for inner, handed in ((full, True), (2 * full, False)):
            case = _mlp(cuda_backend, gate_fmt, "Q4_1", 1024, inner, 9)
            act_off, out_off, _, _ = _run(cuda_backend, "off", *case)
            act, out, names, pending = _run(cuda_backend, "auto", *case)
            assert (pending is not None) == handed, (inner, blocks)
            assert names.count("quantize_s8") == (1 if handed else 2)
            assert torch.equal(act, act_off) and torch.equal(out, out_off)


def test_not_handed_where_down_quantizes_per_block(cuda_backend):
    """Down at k <= GEMV_S8W_BLOCK_MAX_X quantizes x in every block (no quantize_s8 launch to save): gate_up hands
    nothing on and the launches are the off run's; nor for a down weight on another kernel (fp16) or without
    `then`. (gate_up's own x, k = 1,024, is quantized by its blocks here.)"""
    with _settings(cuda_backend, gemv_s8_x="auto"):
        _, _, names, pending = _run(cuda_backend, "auto", *_mlp(cuda_backend, "Q4_1", "Q4_1", 1024, 2048, 13))
        assert pending is None and names == ["gemv_s8w", "gemv_s8w"]
        gate_up, _, x, norm, _ = _mlp(cuda_backend, "Q4_1", "Q4_1", 1024, 4608, 17)
        f16_down = cuda_backend.prepare_linear(torch.randn(256, 4608, generator=torch.Generator().manual_seed(18)))
        for then in (f16_down, None):
            with launched_kernels(cuda_backend) as names:
                cuda_backend.norm_linear(x, norm, 1e-5, gate_up, silu=True, then=then)
            assert cuda_backend.xq_pending is None and names == ["gemv_s8w"]
