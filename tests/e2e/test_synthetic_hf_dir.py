"""A random-weight HF directory (tools/make_synthetic_checkpoint.py): loads, matches transformers, serves."""

import pytest
import torch

from tests.e2e.engine_helpers import complete
from tests.e2e.model_helpers import all_logits
from tools.make_synthetic_checkpoint import synthetic_model
from voltserve.backends.cpu import CpuBackend
from voltserve.models.llama import LlamaModel


def test_logits_match_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM

    from loaders import load_model

    loaded = load_model(str(tiny_dir))
    model = LlamaModel(loaded.config, loaded.tensors, CpuBackend(torch.float32), max_positions=512)
    ids = loaded.tokenizer.encode("a synthetic prompt, long enough to span blocks of sixteen tokens")
    ours = all_logits(model, model.backend, ids)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (ours - expected).abs().max().item() < 1e-4


async def test_engine_serves_hf_dir(tiny_dir):
    from actors.engine import AsyncEngine
    from voltserve.config import EngineConfig

    engine = AsyncEngine(EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64))
    await engine.start()
    try:
        _, tokens, last = await complete(engine, engine.tokenizer.encode("hello"), temperature=0, max_tokens=5,
                                         ignore_eos=True)
        assert len(tokens) == 5 and last.num_prompt_tokens == 5
    finally:
        await engine.stop()


def test_unsupported_architecture_is_refused():
    import dataclasses

    from voltserve.errors import UnsupportedModelError

    loaded = synthetic_model("tiny")
    qwen = dataclasses.replace(loaded.config, architecture="qwen2")
    with pytest.raises(UnsupportedModelError, match="qwen2"):
        LlamaModel(qwen, loaded.tensors, CpuBackend(torch.float32))


def test_chat_template_file_replaces_the_models(tiny_dir, tmp_path):
    """`--chat-template FILE` (EngineConfig.chat_template): the engine renders with that file, e.g. to serve a
    model whose own template does not describe tools; a missing file is a config error."""
    from actors.build import build_runner
    from voltserve.config import EngineConfig
    from voltserve.errors import ConfigError

    path = tmp_path / "tools.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if tools %}<tool_call> {{ tools | length }} tools{% endif %}")
    built = build_runner(EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=16,
                                      chat_template=str(path)).validate())
    rendered = built.chat_template.render([{"role": "user", "content": "hi"}], tools=[{"name": "f"}])
    assert rendered == "[user] hi\n<tool_call> 1 tools"
    with pytest.raises(ConfigError, match="is not a file"):
        EngineConfig(model=str(tiny_dir), chat_template=str(tmp_path / "missing.jinja")).validate()


def test_a_max_model_len_above_the_models_is_served_with_one_warning(tiny_dir, caplog):
    """Above the model's own context length (512): accepted, as llama.cpp does (vLLM refuses it), with one warning
    line; up to it, none."""
    import logging

    from actors.build import build_runner
    from voltserve.config import EngineConfig

    def warnings(max_model_len):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            built = build_runner(EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=64,
                                              max_model_len=max_model_len).validate())
        assert built.max_model_len == (max_model_len or 512)
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert warnings(1000) == ["max_model_len 1000 is above the model's context length 512: serving it, but output "
                              "past 512 tokens may degrade"]
    assert warnings(512) == warnings(0) == []
