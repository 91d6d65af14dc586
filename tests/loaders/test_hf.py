"""Hugging Face directory loader on tiny random transformers checkpoints saved in tmp_path."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from loaders import load_model
from loaders.hf import load_hf_dir
from voltserve.errors import LoaderError, UnsupportedModelError

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _save_tiny(tmp_path, smollm2_tokenizer, tie: bool, config_cls=transformers.LlamaConfig, **extra):
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=smollm2_tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, **extra,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    smollm2_tokenizer.backend.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": {"content": "<|im_start|>"}}
    ))
    return model, model_dir


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_llama_dir(tmp_path, smollm2_tokenizer, tie):
    model, model_dir = _save_tiny(tmp_path, smollm2_tokenizer, tie)
    loaded = load_model(str(model_dir))
    c = loaded.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 2, 32, 64)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 8, 49152)
    assert (c.rms_norm_eps, c.max_position_embeddings, c.rope_style) == (1e-5, 512, "neox")
    assert (c.tie_word_embeddings, c.bos_token_id, c.eos_token_ids) == (tie, 1, (2,))
    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(loaded.tensors) == set(expected)
    for name, value in expected.items():
        assert torch.equal(loaded.tensors[name], value.float()), name
    assert loaded.chat_template == TEMPLATE and loaded.quantized == {}
    tok = loaded.tokenizer
    assert tok.encode("Hello 123<|im_end|>") == smollm2_tokenizer.encode("Hello 123<|im_end|>")
    assert (tok.eos_token, tok.bos_token, tok.special_ids) == ("<|im_end|>", "<|im_start|>", frozenset(range(17)))
    assert tok.token_bytes(tok.encode(" 😀")[1]) == b"\x80"


def test_qwen2_and_eos_from_tokenizer_config(tmp_path, smollm2_tokenizer):
    _, model_dir = _save_tiny(tmp_path, smollm2_tokenizer, True, transformers.Qwen2Config)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("eos_token_id"), cfg.pop("bos_token_id")
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    loaded = load_hf_dir(model_dir)
    assert loaded.config.architecture == "qwen2"
    assert (loaded.config.eos_token_ids, loaded.config.bos_token_id) == ((2,), 1)
    assert "model.layers.0.self_attn.q_proj.bias" in loaded.tensors  # Qwen2 has QKV bias


def test_unsupported_and_broken_dirs(tmp_path, smollm2_tokenizer):
    _, model_dir = _save_tiny(tmp_path, smollm2_tokenizer, True)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_hf_dir(model_dir)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(LoaderError, match="no tokenizer.json"):
        load_hf_dir(model_dir)


_TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 160,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 512}


@pytest.mark.parametrize("change, message", [
    (lambda c: [c], "config.json is not a JSON object"),
    (lambda c: {**c, "text_config": None}, None),  # null: no text config, read as absent
    (lambda c: {**c, "hidden_size": "abc"}, "has the wrong type or range: invalid literal"),
    (lambda c: {**c, "rope_scaling": "linear"}, "has the wrong type or range: 'str' object has no attribute"),
    (lambda c: {**c, "num_attention_heads": 0, "num_key_value_heads": 0}, "has the wrong type or range"),
    (lambda c: {**c, "num_attention_heads": 0, "head_dim": 16}, "gives num_heads 0: a size or count must be >= 1"),
    (lambda c: {**c, "max_position_embeddings": -1}, "gives max_position_embeddings -1"),
], ids=["list", "text-config-null", "str-size", "str-rope-scaling", "zero-heads", "zero-heads-head-dim", "neg-ctx"])
def test_a_malformed_config_json_is_a_loader_error(tmp_path, change, message):
    """A config.json of the wrong shape, or with a value of the wrong type or range, is a LoaderError in words
    (`voltserve serve` reads it before the load: one line, exit 2), not an AttributeError / TypeError /
    ValueError traceback, nor (a count of 0) a model that loads."""
    from loaders.hf_config import config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(change(dict(_TINY_CONFIG))))
    if message is None:
        assert config_from_hf(tmp_path).hidden_size == 64
        return
    with pytest.raises(LoaderError, match=message):
        config_from_hf(tmp_path)


@pytest.mark.parametrize("config, missing", [
    ({}, "'architectures', 'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', "
         "'num_attention_heads'"),
    ({**_TINY_CONFIG, "hidden_size": None, "vocab_size": None}, "'vocab_size', 'hidden_size'"),
    ({**_TINY_CONFIG, "architectures": []}, "'architectures'"),
    ({"architectures": ["LlamaForCausalLM"], "text_config": {"hidden_size": 64, "vocab_size": 320}},
     "'intermediate_size', 'num_hidden_layers', 'num_attention_heads'"),
], ids=["empty", "null-sizes", "no-architectures", "text-config"])
def test_a_config_json_without_required_keys_names_them_all(tmp_path, config, missing):
    """An empty or partial config.json (a failed download, a hand-written one) names the file and every required
    key it lacks in one message, not "no readable config.json" or only the first key."""
    from loaders.hf_config import config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoaderError) as info:
        config_from_hf(tmp_path)
    assert str(info.value) == f"{tmp_path / 'config.json'} lacks required key(s): {missing}"
