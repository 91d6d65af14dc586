"""GGUF tensor names -> Hugging Face names, and which GGUF types the loader keeps packed (no torch: the preflight
reads them from the header, `loaders.peek_packed_weights`).

Source: tensor names from llama.cpp's convert_hf_to_gguf.py (gguf-py's `constants.TENSOR_NAMES`).
"""

from __future__ import annotations

# GGUF block-quantized types whose blocks the loader keeps (`loaders.model.QuantizedTensor`) for the backends to run
# on, beside the fp32 copy; every other type is only dequantized (`loaders.gguf.DEQUANT_TYPES`)
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> HF name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`).

    Returns None for tensors the engine does not use (e.g. `rope_freqs.weight`).
    """
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None
