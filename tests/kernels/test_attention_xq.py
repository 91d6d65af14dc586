"""attn_decode writing its output also quantized for the o_proj GEMV after it (`linear.attention_xq`,
ptx/s8_xq.cuh): the o_proj launch that reads those bytes instead of launching quantize_s8 gives y bit for bit
equal to the launch that quantizes x itself (same int8 values and scales), and the attention output is unchanged.

Covers both attention writers of an output row (the only split, contexts <= 64 keys; the merge of several splits,
in attn_decode or in attn_decode_reduce), both attention paths (tensor cores, CUDA cores), gemv_s8 at 2 and 8 rows
and gemv_s8w at one row of k = 14,336 (x quantized per launch there), on each repacked format. Bound against the
int8 emulation: EMU_TOL (test_gemv_s8.py's).
"""

import pytest
import torch
from tests.kernels.kutils import (backend_settings, launched_kernels, metadata_to_cuda, rel_err, repacked_weight,
                                  s8_reference)
from tests.kernels.test_rope_attention import MAX_POSITIONS, _case, _split

from voltserve.backends.cpu import rope_cos_sin

pytestmark = pytest.mark.gpu
EMU_TOL = 1e-3
# (heads, contexts): Llama-3-8B's attention (GROUP 4, 4,096 features) at 8 and 2 rows; GROUP 14, 14,336
# features (gemv_s8w, x quantized per launch at one row; the merge's items past the group's in the last pass)
CASES = [((32, 8, 128), [1, 17, 64, 65, 512, 300, 2000, 33]), ((32, 8, 128), [700, 40]),
         ((112, 8, 128), [513]), ((112, 8, 128), [64, 129])]


@pytest.fixture
def poisoned_xq(monkeypatch):
    """attention_xq's buffers filled with 0x7f before attn_decode runs, so bytes it fails to write (a recycled
    block may hold a previous launch's right answer) show up as huge scales."""
    from voltserve.backends.cuda import backend as backend_module

    real = backend_module.attention_xq

    def poisoned(backend, w, out, group):
        fields = real(backend, w, out, group)
        if fields[0] is not None:
            backend.xq_pending.xq.fill_(0x7F)  # on the backend's stream (torch's), before the attention launch
        return fields

    monkeypatch.setattr(backend_module, "attention_xq", poisoned)


def _attention_then_o_proj(backend, qkv, kv, attn, positions, cos_sin, heads, lin, handoff):
    """rope_attention then the o_proj linear on its output: (attention output, y, launched kernel names)."""
    meta = metadata_to_cuda(attn)
    with launched_kernels(backend) as names:
        out = backend.rope_attention(*_split(qkv.cuda(), heads), positions.cuda(), cos_sin.cuda(), "neox",
                                     kv.cuda(), meta, heads[2] ** -0.5, out_linear=lin if handoff else None)
        y = backend.linear(out.view(out.shape[0], -1), lin)
    assert backend.xq_pending is None  # taken by the linear
    return out, y, names


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("merge", ["kernel", "reduce"])
def test_o_proj_reads_attention_xq(cuda_backend, fmt, case, merge, attn_choice, poisoned_xq, monkeypatch):
    if cuda_backend.loader.arch < 80:
        pytest.skip("gemv_s8 is SM80+")
    heads, seq_lens = CASES[case]
    if merge == "reduce":  # too few arrival counters: the splits merge in attn_decode_reduce
        monkeypatch.setattr(cuda_backend, "attn_counters", torch.zeros(1, dtype=torch.int32, device="cuda"))
    rows, k = len(seq_lens), heads[0] * heads[2]
    qkv, kv, attn, positions = _case(seq_lens, heads, 16, seed=case)
    cos_sin = rope_cos_sin(heads[2], MAX_POSITIONS, 5e5)
    with backend_settings(cuda_backend, gemv_kernel="auto", quant_repack="on", gemv_s8="on", gemv_s8_m1="warp",
                          gemv_s8_x="auto", attn_xq="auto"):
        quant, _, lin = repacked_weight(cuda_backend, fmt, 96, k, 7 + case)
        out, y, names = _attention_then_o_proj(cuda_backend, qkv, kv, attn, positions, cos_sin, heads, lin, True)
        ref_out, ref_y, ref_names = _attention_then_o_proj(cuda_backend, qkv, kv, attn, positions, cos_sin, heads,
                                                           lin, False)
    gemv = "gemv_s8w" if rows == 1 else "gemv_s8"
    attn_launches = ["attn_decode"] + (["attn_decode_reduce"] if merge == "reduce" else [])
    assert names == attn_launches + [gemv]
    assert ref_names == attn_launches + ["quantize_s8", gemv]
    assert torch.equal(out, ref_out)
    assert torch.equal(y, ref_y)
    assert rel_err(y, s8_reference(out.view(rows, k).cpu(), quant)) <= EMU_TOL


def test_stale_handoff_is_dropped(cuda_backend):
    """A handoff the next linear cannot use (another x at the same weight) is dropped: that call quantizes its own
    x, and the one after it finds nothing pending."""
    if cuda_backend.loader.arch < 80:
        pytest.skip("gemv_s8 is SM80+")
    heads, seq_lens = CASES[1]
    qkv, kv, attn, positions = _case(seq_lens, heads, 16, seed=3)
    cos_sin = rope_cos_sin(heads[2], MAX_POSITIONS, 5e5)
    with backend_settings(cuda_backend, gemv_kernel="auto", quant_repack="on", gemv_s8="on", gemv_s8_x="auto",
                          attn_xq="auto"):
        quant, _, lin = repacked_weight(cuda_backend, "Q4_1", 64, 4096, 5)
        out = cuda_backend.rope_attention(*_split(qkv.cuda(), heads), positions.cuda(), cos_sin.cuda(), "neox",
                                          kv.cuda(), metadata_to_cuda(attn), heads[2] ** -0.5, out_linear=lin)
        assert cuda_backend.xq_pending is not None
        other = out.view(2, -1).flip(0).contiguous()
        with launched_kernels(cuda_backend) as names:
            y = cuda_backend.linear(other, lin)
        assert names == ["quantize_s8", "gemv_s8"] and cuda_backend.xq_pending is None
        assert rel_err(y, s8_reference(other.cpu(), quant)) <= EMU_TOL
