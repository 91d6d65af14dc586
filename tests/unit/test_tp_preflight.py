"""`voltserve serve --tensor-parallel-size N` on a GGUF whose block-quantized row-parallel weights (o_proj, down_proj:
their input features are split) do not split into whole 32-weight blocks: one `bad configuration:` line and exit
status 2 from the header, before the port, the engine or a rank process starts. Before, each rank loaded the model
first and the engine then failed on the same split."""

from __future__ import annotations

import logging

import pytest
from gguf import GGMLQuantizationType as QT

from loaders import peek_packed_weights
from tests.loaders.test_gguf import LAYERS, write_tiny_gguf
from voltserve import cli
from voltserve.distributed.sharding import check_block_split
from voltserve.errors import ConfigError

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _gguf(path, qtype, hidden: int, ffn: int):
    """The tiny GGUF (4 heads, 2 KV heads of hidden / 4) with every layer linear in `qtype`."""
    names = [f"model.layers.{i}.{linear}.weight" for i in range(LAYERS) for linear in LINEARS]
    write_tiny_gguf(path, types={name: qtype for name in names}, hidden=hidden, ffn=ffn)
    return path


@pytest.fixture
def no_start(monkeypatch):
    """Fail the test if `voltserve serve` gets past its checks (the port is bound right after them)."""
    def started(*args):
        raise AssertionError("the server started")

    monkeypatch.setattr(cli.preflight, "listen", started)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
@pytest.mark.parametrize("hidden, ffn, name, detail", [
    # down_proj: 96 inner features, 48 a rank
    (64, 96, "model.layers.0.mlp.down_proj.weight", "its 96 input features over tensor_parallel_size 2 give each "
                                                    "rank 48"),
    # o_proj: 4 heads of 8, 16 input features a rank (down_proj's 128 / 2 are whole blocks)
    (32, 128, "model.layers.0.self_attn.o_proj.weight", "its 32 input features over tensor_parallel_size 2 give "
                                                        "each rank 16"),
], ids=["down_proj", "o_proj"])
def test_a_split_through_quant_blocks_is_one_line_before_anything_starts(tmp_path, caplog, no_start, qtype, hidden,
                                                                         ffn, name, detail):
    model = _gguf(tmp_path / "m.gguf", qtype, hidden, ffn)
    with caplog.at_level(logging.ERROR):
        assert cli.main(["serve", str(model), "--device", "cpu", "--tensor-parallel-size", "2"]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        f"bad configuration: tensor parallel: {name} is {qtype.name} with blocks of 32 input features; {detail}, "
        "not whole blocks (the input size / tensor_parallel_size must be a multiple of 32)"]


@pytest.mark.parametrize("qtype,convert", [(QT.Q5_0, "off"), (QT.F16, "auto"), (QT.F32, "auto")])
def test_types_that_load_as_floats_split_anywhere(tmp_path, qtype, convert):
    """Only Q4_0 / Q4_1 / Q8_0 stay packed, and the types `--gguf-convert auto` converts into them; the others
    (floats; Q5_0, K-quants with the conversion off) are dequantized at the load and their slices need no block
    boundary (a Q5_0 model of these shapes serves at TP 2 with --gguf-convert off): nothing to refuse."""
    from voltserve import preflight
    from voltserve.config import EngineConfig

    model = _gguf(tmp_path / "m.gguf", qtype, 64, 96)
    assert peek_packed_weights(str(model), gguf_convert=convert == "auto") == {}
    preflight.check_model(EngineConfig(model=str(model), device="cpu", tensor_parallel_size=2,
                                       gguf_convert=convert).validate())


def test_a_converted_type_splits_on_its_packed_blocks(tmp_path):
    """Q5_0 loads as Q8_0 by default (loaders.gguf_convert): down_proj's 96 inputs / 2 = 48 are no whole block."""
    from voltserve import preflight
    from voltserve.config import ConfigError, EngineConfig

    model = _gguf(tmp_path / "m.gguf", QT.Q5_0, 64, 96)
    assert peek_packed_weights(str(model))["model.layers.0.mlp.down_proj.weight"] == ("Q8_0", 96)
    with pytest.raises(ConfigError, match="down_proj.weight is Q8_0 with blocks of 32 input features.*"
                                          "--gguf-convert off loads it as floats"):
        preflight.check_model(EngineConfig(model=str(model), device="cpu", tensor_parallel_size=2).validate())


def test_whole_blocks_pass_and_the_header_gives_each_packed_weight(tmp_path):
    model = _gguf(tmp_path / "m.gguf", QT.Q8_0, 64, 128)  # o_proj 64 / 2 = 32, down 128 / 2 = 64: whole blocks
    packed = peek_packed_weights(str(model))
    assert packed["model.layers.1.self_attn.o_proj.weight"] == ("Q8_0", 64)
    assert packed["model.layers.1.mlp.down_proj.weight"] == ("Q8_0", 128)
    assert packed["model.layers.0.mlp.gate_proj.weight"] == ("Q8_0", 64)
    assert len(packed) == LAYERS * len(LINEARS)  # the token embedding is F32 here, the norms 1-D
    from voltserve import preflight
    from voltserve.config import EngineConfig

    preflight.check_model(EngineConfig(model=str(model), device="cpu", tensor_parallel_size=2).validate())


def test_check_block_split_rules():
    check_block_split("w", "Q8_0", 256, 4)  # 64 a rank
    check_block_split("w", "Q4_1", 96, 3)  # 32 a rank
    with pytest.raises(ConfigError, match=r"^tensor parallel: w's input features \(96\) must divide by "
                                          r"tensor_parallel_size \(5\)$"):
        check_block_split("w", "Q8_0", 96, 5)
    with pytest.raises(ConfigError, match=r"give each rank 48, not whole blocks"):
        check_block_split("w", "Q4_0", 192, 4)
