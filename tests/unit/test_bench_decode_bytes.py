"""tools/bench_decode.py's roofline bytes: each fused group at the type it runs as (quant.concat_rows)."""

from tools.bench_decode import step_weight_bytes
from tools.make_synthetic_checkpoint import synthetic_model


def test_a_fused_group_of_two_packed_types_counts_as_q8_0():
    """small256 as the Q4_K_M mix: layer 1 (llama.cpp's use_more_bits) has a Q8_0 v beside Q4_1 q / k, so its
    whole QKV runs (and is counted) as Q8_0; layer 0 is Q4_1 throughout. Bytes (Q4_1 20, Q8_0 34 per 32):
    lm_head Q8_0 320 x 256 = 87,040; norms fp16 5 x 256 x 2 = 2,560; layer 0 Q4_1: qkv 512 x 256, o 256 x 256,
    gate_up 1,024 x 256, down 256 x 512 = 368,640; layer 1: qkv as Q8_0 139,264, o 40,960, gate_up 163,840, down
    Q8_0 139,264. Counting q / k as their own Q4_1 (61,440 bytes, not 104,448) would give 43,008 fewer."""
    loaded = synthetic_model("small256", qtype="Q4_K_M")
    assert loaded.quantized["model.layers.1.self_attn.q_proj.weight"].qtype == "Q4_1"
    assert loaded.quantized["model.layers.1.self_attn.v_proj.weight"].qtype == "Q8_0"
    assert step_weight_bytes(loaded) == 87_040 + 2_560 + 368_640 + 139_264 + 40_960 + 163_840 + 139_264
