"""GGUF loader: a tiny GGUF written here, then the real SmolLM2 file against transformers' own loader."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from loaders.gguf import hf_name, load_gguf, read_metadata
from loaders.gguf_header import read_gguf_header
from voltserve.errors import LoaderError, UnsupportedModelError
from voltserve.tokenizer import _byte_decoder

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 96, 2
SPECIALS = ["<s>", "</s>", "<|eot|>"]
BYTE_TOKENS = sorted(_byte_decoder(), key=_byte_decoder().get)
TOKENS = SPECIALS + BYTE_TOKENS + ["he", "hel"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to HF Q/K rows (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch="llama", weights=None, types=None, tokenizer_model="gpt2", hidden=HIDDEN, ffn=FFN,
                    raw=None):
    """A 2-layer llama GGUF. `weights`: HF name -> [out, in] fp32 (HF layout); `types`: HF name -> qtype;
    `hidden`, `ffn`: other sizes than HIDDEN and FFN (4 heads, 2 KV heads of hidden / 4 each); `raw`: HF name ->
    (qtype, [out, row bytes] uint8 blocks) written as they are (rows in the file's order: Q / K permuted), for
    types gguf-py cannot quantize (K-quants); their `weights` entries are not used."""
    rng = np.random.default_rng(0)
    w = weights if weights is not None else {}
    head_dim = hidden // HEADS
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(50000.0)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_merges(["h e", "he l"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_eot_token_id(2)
    shapes = {"token_embd.weight": (len(TOKENS), hidden), "output_norm.weight": (hidden,)}
    per_layer = {"attn_q": (HEADS * head_dim, hidden), "attn_k": (KV_HEADS * head_dim, hidden),
                 "attn_v": (KV_HEADS * head_dim, hidden), "attn_output": (hidden, HEADS * head_dim),
                 "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn),
                 "attn_norm": (hidden,), "ffn_norm": (hidden,)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.{k}.weight": v for k, v in per_layer.items()})
    for gname, shape in shapes.items():
        name = hf_name(gname)
        if name in (raw or {}):
            qtype, blocks = raw[name]
            writer.add_tensor(gname, blocks, raw_dtype=qtype)
            continue
        arr = w.setdefault(name, rng.standard_normal(shape).astype(np.float32))
        if "attn_q" in gname or "attn_k" in gname:
            arr = llama_cpp_permute(arr, HEADS if "attn_q" in gname else KV_HEADS)
        qtype = (types or {}).get(name, QT.F32)
        if qtype == QT.F32:
            writer.add_tensor(gname, arr)
        elif qtype == QT.F16:
            writer.add_tensor(gname, arr.astype(np.float16))
        elif qtype == QT.I32:
            writer.add_tensor(gname, arr.astype(np.int32))
        else:
            writer.add_tensor(gname, quantize(arr, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w


def test_tiny_gguf_loads(tmp_path):
    q0, k0 = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    gate1, up1 = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    types = {q0: QT.Q8_0, k0: QT.Q4_0, gate1: QT.Q4_1, up1: QT.F16}
    w = write_tiny_gguf(tmp_path / "tiny.gguf", types=types)
    m = load_gguf(tmp_path / "tiny.gguf")
    c = m.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 2, 64, 96)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 16, len(TOKENS))
    assert (c.rope_theta, c.max_position_embeddings, c.rope_style) == (50000.0, 256, "neox")
    assert c.rms_norm_eps == pytest.approx(1e-6)
    assert c.tie_word_embeddings and "lm_head.weight" not in m.tensors
    assert (c.bos_token_id, c.eos_token_ids) == (0, (1, 2))
    assert len(m.tensors) == 2 + LAYERS * 9
    for name, ref in w.items():
        expected = ref
        if name in types and types[name] != QT.F16:
            expected = dequantize(quantize(ref, types[name]), types[name])  # rows quantize independently
        elif name in types:
            expected = ref.astype(np.float16).astype(np.float32)
        assert m.tensors[name].dtype == torch.float32
        assert torch.equal(m.tensors[name], torch.from_numpy(expected)), name
    assert set(m.quantized) == {q0, k0, gate1}
    assert m.quantized[k0].qtype == "Q4_0" and m.quantized[k0].shape == (KV_HEADS * HEAD_DIM, HIDDEN)
    assert np.array_equal(m.quantized[q0].data, quantize(w[q0], QT.Q8_0))  # rows back in HF order
    assert m.quantized[gate1].data.shape == (FFN, HIDDEN // 32 * 20)
    tok = m.tokenizer
    assert tok.encode("hello</s>") == [TOKENS.index("hel"), TOKENS.index("l"), TOKENS.index("o"), 1]
    assert (tok.eos_token_ids, tok.special_ids, tok.vocab_size) == ((1, 2), frozenset({0, 1, 2}), len(TOKENS))


def test_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "x.gguf", arch="falcon")
    with pytest.raises(UnsupportedModelError, match="architecture 'falcon'"):
        load_gguf(tmp_path / "x.gguf")


def test_unsupported_tensor_type(tmp_path):
    write_tiny_gguf(tmp_path / "x.gguf", types={"model.layers.1.mlp.up_proj.weight": QT.I32})
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_up\.weight has unsupported type I32"):
        load_gguf(tmp_path / "x.gguf")


def test_unsupported_tokenizer_model(tmp_path):
    write_tiny_gguf(tmp_path / "x.gguf", tokenizer_model="llama")
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.model='llama'"):
        load_gguf(tmp_path / "x.gguf")


def test_the_header_says_what_the_loader_reads(tmp_path):
    """`read_gguf_header` (no torch, metadata arrays skipped): the loader's ModelConfig, the tensors' shapes, and
    the bytes their data needs (all of the file but the writer's padding)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, types={"model.layers.0.self_attn.q_proj.weight": QT.Q8_0})
    header = read_gguf_header(path)
    assert header.model_config() == load_gguf(path).config
    assert header.tensor_shapes["blk.0.attn_q.weight"] == (HIDDEN, HEADS * HEAD_DIM)  # innermost first
    assert len(header.tensor_shapes) == 2 + LAYERS * 9
    assert header.file_bytes - 32 < header.data_end <= header.file_bytes == path.stat().st_size


@pytest.mark.parametrize("keep", [0, 3, 24, 300, "half", -1])
def test_a_truncated_gguf_is_a_loader_error_that_says_so(tmp_path, keep):
    """Cut anywhere (the last case: one byte short), the file is refused in words naming it, not with numpy's
    "cannot reshape array" (data cut) or an IndexError (metadata cut)."""
    path = tmp_path / "cut.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[:{"half": len(data) // 2, -1: len(data) - 1}.get(keep, keep)])
    with pytest.raises(LoaderError, match="truncated or corrupt") as info:
        load_gguf(path)
    assert str(path) in str(info.value)
    if keep == -1:  # the share of its data the file holds, rounded down: not "(100%)" for one byte short
        assert str(info.value).endswith("(99%)")


def test_a_file_that_is_no_gguf_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))  # e.g. the wheel instead of the file inside it
    with pytest.raises(LoaderError, match=f"{path} is not a GGUF file"):
        load_gguf(path)


@pytest.mark.parametrize("method, key, value", [
    ("add_context_length", "llama.context_length", "abc"),  # a string where a count goes: was a ValueError
    ("add_context_length", "llama.context_length", -5),  # was taken: a negative context window
    ("add_head_count", "llama.attention.head_count", 0),  # was a ZeroDivisionError
    ("add_embedding_length", "llama.embedding_length", "x"),
])
def test_a_corrupt_metadata_value_is_a_loader_error_that_names_it(tmp_path, monkeypatch, method, key, value):
    """A value of the wrong type or range is a LoaderError naming key and value, from the header (`voltserve serve`:
    one line, exit 2) and from the loader alike, not a ValueError / ZeroDivisionError with a traceback."""
    def write(self, *_):
        (self.add_string if isinstance(value, str) else self.add_int32)(key, value)

    monkeypatch.setattr(GGUFWriter, method, write)
    path = tmp_path / "bad.gguf"
    write_tiny_gguf(path)
    message = re.escape(f"{path}: GGUF metadata {key} is {value!r}, not an integer >= 1")  # names the file too
    with pytest.raises(LoaderError, match=message):
        read_gguf_header(path).model_config()
    with pytest.raises(LoaderError, match=message):
        load_gguf(path)


def test_arrays_of_arrays_and_big_endian_files_read_as_the_gguf_reader_reads_them(tmp_path):
    """Nested metadata arrays (of numbers and of strings) are stepped over, a big-endian file (GGUF v3) is read in
    its byte order, and `general.alignment` moves the data's start: as GGUFReader reads them."""
    import gguf

    for endian, alignment in ((gguf.GGUFEndian.LITTLE, 64), (gguf.GGUFEndian.BIG, None)):
        path = tmp_path / f"{endian.name}.gguf"
        writer = GGUFWriter(str(path), "llama", endianess=endian)
        if alignment:
            writer.add_custom_alignment(alignment)
        writer.add_array("test.nested", [[1, 2, 3], [4, 5]])
        writer.add_array("test.nested_strings", [["x", "yy"], ["zzz"]])
        writer.add_string("test.after", "héllo")
        writer.add_tensor("token_embd.weight", np.ones((10, 8), np.float32))
        writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        header, reader = read_gguf_header(path), gguf.GGUFReader(str(path), "r")
        assert header.metadata == {k: v for k, v in read_metadata(reader).items() if not isinstance(v, list)}
        assert header.metadata["test.after"] == "héllo"
        assert header.tensor_shapes == {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
        assert header.data_end == max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)


def test_arrays_nested_past_the_stack_are_a_loader_error(tmp_path):
    """A corrupt file whose one metadata value is an array of an array of ... (5,000 deep, 60 kB) is refused in
    words, not with a RecursionError traceback."""
    path = tmp_path / "deep.gguf"
    nested = struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)  # ARRAY of 1 ARRAY ... of 0 UINT32
    path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"k" + struct.pack("<I", 9) + nested)
    with pytest.raises(LoaderError, match=f"{path} is corrupt: its metadata nests arrays too deeply"):
        read_gguf_header(path)


def test_smollm2_header_matches_the_gguf_reader(smollm2, smollm2_gguf):
    import gguf

    header = read_gguf_header(smollm2_gguf)
    meta = read_metadata(gguf.GGUFReader(str(smollm2_gguf), "r"))
    assert header.metadata == {k: v for k, v in meta.items() if not isinstance(v, list)}
    assert header.model_config() == smollm2.config
    assert header.data_end == header.file_bytes == 98_362_432


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.rope_theta) == (64, 1536, 49152, 100000.0)
    assert c.tie_word_embeddings and c.rope_style == "neox" and c.max_position_embeddings == 8192
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert smollm2.tokenizer.eos_token == "<|im_end|>"
    assert smollm2.chat_template.startswith("{% for message in messages %}")
    assert len(smollm2.tensors) == 2 + 30 * 9
    q = smollm2.quantized
    assert q["model.embed_tokens.weight"].qtype == "Q8_0" and q["model.layers.0.mlp.down_proj.weight"].qtype == "Q4_1"
    assert q["model.layers.0.self_attn.q_proj.weight"].data.shape == (576, 576 // 32 * 20)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2, hf_smollm2):
    ref = hf_smollm2.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(smollm2.tensors[name], ref[name]), name
    # The packed blocks dequantize to the same (un-permuted) weight.
    packed = smollm2.quantized["model.layers.0.self_attn.k_proj.weight"]
    deq = dequantize(packed.data, QT[packed.qtype])
    assert torch.equal(torch.from_numpy(deq), ref["model.layers.0.self_attn.k_proj.weight"])
