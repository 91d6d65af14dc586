"""K-quant and Q5 GGUF weights converted at load into the packed types the kernels run (loaders.gguf_convert)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import Q4_K, dequantize

from loaders import peek_packed_weights
from loaders.gguf import load_gguf, unpermute_rows
from loaders.gguf_convert import CONVERTED_TYPES, convert_blocks, q4_k_to_q4_1
from tests.loaders.test_gguf import HEADS, KV_HEADS, write_tiny_gguf
from tools.make_synthetic_checkpoint import quant_blocks
from voltserve.config import ConfigError, EngineConfig
from voltserve.quant import QuantizedTensor, concat_rows, dequantize_rows

HIDDEN = FFN = 256  # K-quant rows are whole 256-weight super-blocks
REQUANTIZED = sorted(t for t, target in CONVERTED_TYPES.items() if target == "Q8_0")


def exact(qtype: str, raw: np.ndarray) -> np.ndarray:
    """[rows, cols] fp32: gguf-py's dequantization of rows of `qtype` blocks."""
    return dequantize(raw, QT[qtype]).reshape(raw.shape[0], -1).astype(np.float32)


def test_q4_k_runs_as_q4_1_with_the_same_nibbles_and_scales_rounded_once():
    rng = np.random.default_rng(1)
    raw = quant_blocks("Q4_K", 6, 1024, rng).reshape(6, 4, 144)
    raw[:, :, 0:4] = rng.uniform(1e-4, 1e-2, (6, 4, 2)).astype(np.float16).view(np.uint8)  # d, dmin of any mantissa
    raw = raw.reshape(6, 4 * 144)
    out = q4_k_to_q4_1(raw)
    assert out.shape == (6, 1024 // 32 * 20) and out.dtype == np.uint8
    # every Q4_1 block holds its Q4_K sub-block's nibbles (element order included)
    sub = raw.reshape(-1, 144)[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    want_q = (sub & 0x0F).reshape(-1, 32)
    got = out.reshape(-1, 20)[:, 4:]
    got_q = np.concatenate([got & 0x0F, got >> 4], axis=1)
    assert np.array_equal(got_q, want_q)
    # each weight moves by at most half an fp16 ulp of d * sc and of dmin * m (the bound in gguf_convert)
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    bound = 2.0 ** -11 * (15 * np.abs(d * sc) + np.abs(dmin * mn)) + 2.0 ** -24  # [super-blocks, 8]
    err = np.abs(exact("Q4_1", out) - exact("Q4_K", raw)).reshape(-1, 8, 32).max(axis=-1)
    assert (err <= bound.reshape(err.shape)).all()
    assert err.max() > 0  # the rounding is real: the bound is what is tested, not equality


def test_a_q4_k_scale_past_fp16_is_requantized_as_q8_0():
    raw = quant_blocks("Q4_K", 2, 256, np.random.default_rng(2))
    raw[0, 0:2] = np.frombuffer(np.float16(30000.0).tobytes(), np.uint8)  # d * sc overflows fp16
    assert q4_k_to_q4_1(raw) is None
    assert convert_blocks("Q4_K", raw, exact("Q4_K", raw)) is None  # amax / 127 past fp16 too: kept as floats
    raw[0, 0:2] = np.frombuffer(np.float16(2000.0).tobytes(), np.uint8)  # d * sc past fp16, amax / 127 not
    assert q4_k_to_q4_1(raw) is None
    quant, ref = convert_blocks("Q4_K", raw, exact("Q4_K", raw))
    assert quant.qtype == "Q8_0" and quant.data.shape == (2, 256 // 32 * 34)
    assert np.isfinite(ref).all() and np.array_equal(ref, exact("Q8_0", quant.data))


@pytest.mark.parametrize("qtype", REQUANTIZED)
def test_requantized_types_move_no_weight_past_0_57_of_its_q8_0_step(qtype):
    raw = quant_blocks(qtype, 5, 512, np.random.default_rng(3))
    values = exact(qtype, raw)
    quant, ref = convert_blocks(qtype, raw, values)
    assert quant.qtype == "Q8_0" and quant.shape == (5, 512) and quant.data.shape == (5, 512 // 32 * 34)
    assert np.array_equal(ref, exact("Q8_0", quant.data))  # the reference is what the blocks hold
    step = np.abs(values).reshape(-1, 32).max(axis=1) / 127  # half a step, plus the scale's fp16 rounding
    err = np.abs(ref - values).reshape(-1, 32).max(axis=1)
    assert (err <= 0.57 * step + 1e-12).all()
    assert (err > 0).any()


def test_a_fused_weight_of_two_packed_types_runs_as_q8_0():
    """A Q4_K_M layer's q / k (Q4_K -> Q4_1) and v (Q6_K -> Q8_0) fuse into one QKV weight: as Q8_0, the v rows
    as they were, the Q4_1 rows requantized within 0.57 of their new step (not fp16, as before)."""
    rng = np.random.default_rng(6)
    q = QuantizedTensor("Q4_1", (8, 256), quant_blocks("Q4_1", 8, 256, rng))
    v = QuantizedTensor("Q8_0", (4, 256), quant_blocks("Q8_0", 4, 256, rng))
    fused = concat_rows([q, v])
    assert fused.qtype == "Q8_0" and fused.shape == (12, 256) and fused.data.shape == (12, 256 // 32 * 34)
    assert np.array_equal(fused.data[8:], v.data)
    want = dequantize_rows(q)
    step = np.abs(want).reshape(-1, 32).max(axis=1) / 127
    err = np.abs(dequantize_rows(fused)[:8] - want).reshape(-1, 32).max(axis=1)
    assert (err <= 0.57 * step).all() and (err > 0).any()
    same = concat_rows([q, q])
    assert same.qtype == "Q4_1" and np.array_equal(same.data, np.concatenate([q.data, q.data]))
    assert concat_rows([q, QuantizedTensor("Q8_0", (4, 64), quant_blocks("Q8_0", 4, 64, rng))]) is None


def test_off_fuses_natively_mixed_parts_as_their_exact_values(tmp_path):
    """--gguf-convert off (LlamaModel(fuse_mixed=False)): a file's own Q4_0 q / k beside Q8_0 v fuse as floats."""
    from tests.loaders.test_gguf import LAYERS
    from voltserve.backends.cpu import CpuBackend
    from voltserve.models.llama import LlamaModel

    types = {f"model.layers.{i}.self_attn.{n}_proj.weight": QT.Q8_0 if n == "v" else QT.Q4_0
             for i in range(LAYERS) for n in "qkv"}
    write_tiny_gguf(tmp_path / "m.gguf", types=types, hidden=64, ffn=128)
    m = load_gguf(tmp_path / "m.gguf", convert=False)
    p = "model.layers.0.self_attn."
    want = torch.cat([m.tensors[p + f"{n}_proj.weight"] for n in "qkv"])
    for mixed in (True, False):
        backend = CpuBackend(torch.float32, use_int4=False)
        model = LlamaModel(m.config, m.tensors, backend, m.quantized, max_positions=32, fuse_mixed=mixed)
        fused = concat_rows([m.quantized[p + f"{n}_proj.weight"] for n in "qkv"])  # Q8_0 of the mixed parts
        assert torch.equal(model.layers[0].qkv, torch.from_numpy(dequantize_rows(fused)) if mixed else want)


def test_convert_blocks_refuses_what_it_cannot_convert():
    raw = quant_blocks("Q4_K", 1, 256, np.random.default_rng(4))
    with pytest.raises(ValueError, match="Q4_1 has no conversion"):
        convert_blocks("Q4_1", raw, exact("Q4_K", raw))
    with pytest.raises(ValueError, match="whole 144-byte blocks"):
        q4_k_to_q4_1(raw[:, :100])


def k_quant_gguf(path) -> dict[str, tuple[QT, np.ndarray]]:
    """A GGUF of the Q4_K_M kind: q / k / gate / up / the embedding Q4_K, v / down Q6_K, o_proj Q5_K, the rest
    F32; returns the K-quant tensors' raw blocks (rows in the file's order)."""
    rng = np.random.default_rng(5)
    head = HIDDEN // HEADS
    kinds = {"self_attn.q_proj": ("Q4_K", HEADS * head), "self_attn.k_proj": ("Q4_K", KV_HEADS * head),
             "self_attn.v_proj": ("Q6_K", KV_HEADS * head), "self_attn.o_proj": ("Q5_K", HIDDEN),
             "mlp.gate_proj": ("Q4_K", FFN), "mlp.up_proj": ("Q4_K", FFN), "mlp.down_proj": ("Q6_K", HIDDEN)}
    raw = {f"model.layers.{i}.{k}.weight": (qt, rows) for i in range(2) for k, (qt, rows) in kinds.items()}
    raw["model.embed_tokens.weight"] = ("Q4_K", None)
    out = {}
    for name, (qt, rows) in raw.items():
        rows = rows or 261  # the tiny GGUF's vocabulary
        out[name] = (QT[qt], quant_blocks(qt, rows, HIDDEN if "down" not in name else FFN, rng))
    write_tiny_gguf(path, hidden=HIDDEN, ffn=FFN, raw=out)
    return out


def hf_rows(name: str, arr: np.ndarray) -> np.ndarray:
    """The file's Q / K rows in HF order, as the loader puts them."""
    if "q_proj" in name:
        return arr[unpermute_rows(arr.shape[0], HEADS)]
    if "k_proj" in name:
        return arr[unpermute_rows(arr.shape[0], KV_HEADS)]
    return arr


def test_a_k_quant_gguf_loads_as_packed_q4_1_and_q8_0_blocks(tmp_path):
    raw = k_quant_gguf(tmp_path / "k.gguf")
    m = load_gguf(tmp_path / "k.gguf")
    assert m.tokenizer.vocab_size == 261
    for name, (qt, blocks) in raw.items():
        quant, ref = convert_blocks(qt.name, blocks, exact(qt.name, blocks))
        assert m.quantized[name].qtype == CONVERTED_TYPES[qt.name], name
        assert np.array_equal(m.quantized[name].data, hf_rows(name, quant.data)), name
        assert torch.equal(m.tensors[name], torch.from_numpy(hf_rows(name, ref))), name
    off = load_gguf(tmp_path / "k.gguf", convert=False)
    assert not set(raw) & set(off.quantized)
    for name, (qt, blocks) in raw.items():
        assert torch.equal(off.tensors[name], torch.from_numpy(hf_rows(name, exact(qt.name, blocks)))), name


def test_the_header_names_the_types_the_loader_converts_to(tmp_path):
    k_quant_gguf(tmp_path / "k.gguf")
    packed = peek_packed_weights(str(tmp_path / "k.gguf"))
    assert packed["model.layers.1.self_attn.q_proj.weight"] == ("Q4_1", HIDDEN)
    assert packed["model.layers.0.mlp.down_proj.weight"] == ("Q8_0", FFN)
    assert packed["model.layers.0.self_attn.o_proj.weight"] == ("Q8_0", HIDDEN)
    assert peek_packed_weights(str(tmp_path / "k.gguf"), gguf_convert=False) == {}


def test_a_converted_model_answers_like_the_exact_file(tmp_path):
    """The fp32 reference backend on both loads. Q4_K -> Q4_1 is near-lossless; the Q8_0 requantization moves
    these random weights by ~0.45% RMS (random sub-block scales: a real file's move less), and the logits by
    ~1% of their range over the layers (bound 3%) (a wrong nibble or scale order moves them by their whole range)."""
    from tests.e2e.model_helpers import all_logits
    from voltserve.backends.cpu import CpuBackend
    from voltserve.models.llama import LlamaModel

    k_quant_gguf(tmp_path / "k.gguf")
    ids = [5, 77, 140, 3, 200, 9, 31, 250]
    logits = []
    for convert in (True, False):
        m = load_gguf(tmp_path / "k.gguf", convert=convert)
        backend = CpuBackend(torch.float32, use_int4=False)
        logits.append(all_logits(LlamaModel(m.config, m.tensors, backend, m.quantized, max_positions=64), backend,
                                 ids))
    converted, exact_logits = logits
    rel = ((converted - exact_logits).abs().max() / exact_logits.abs().max()).item()
    assert 0 < rel < 3e-2, rel
    assert (converted.argmax(-1) == exact_logits.argmax(-1)).all()


def test_gguf_convert_takes_auto_or_off():
    assert EngineConfig(gguf_convert="off").validate().gguf_convert == "off"
    with pytest.raises(ConfigError, match="gguf_convert must be auto or off, not 'on'"):
        EngineConfig(gguf_convert="on").validate()
