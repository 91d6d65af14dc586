"""Random-weight Llama checkpoints: tiny ones for tests, Llama-3-8B shapes for GPU benchmarks.

`synthetic_model(shape)` builds a LoadedModel in memory (optionally straight on the GPU, which skips 16 GB of
disk and host copies for the 8B shapes); `python tools/make_synthetic_checkpoint.py --shape tiny --out DIR` writes
a Hugging Face directory (config.json, model.safetensors fp16, tokenizer.json) that `voltserve serve DIR` loads.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run from a checkout

from loaders.model import LoadedModel, QuantizedTensor  # noqa: E402
from voltserve.quant import BLOCK_BYTES  # noqa: E402
from voltserve.config import ModelConfig  # noqa: E402

SHAPES = {
    # Llama-3-8B (Meta, 2024): the shapes of the roofline target
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192),
    # SmolLM2-135M (the default model) as fp16: GPU benchmarks of its step shapes without the GGUF
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192),
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, rope_theta=10000.0, max_position_embeddings=512),
    # tiny for tensor parallelism: heads and KV heads divide by 2 and 4 (GQA group 2 per rank), and every
    # row-parallel slice (o_proj's 128 / tp, down's 256 / tp inputs) at TP 2 and 4 is whole Q4/Q8 blocks of 32
    "tiny_tp": dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
                    num_kv_heads=4, head_dim=16, rope_theta=10000.0, max_position_embeddings=512),
    # small, with every linear's in_features % 256 == 0 (repacked quant rows; tests/e2e/test_gpu_model.py)
    "small256": dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=64, rope_theta=10000.0, max_position_embeddings=512),
    # small, with every linear's in_features % 1024 == 0 (the ring GEMVs gemv_tma / gemv_chain take it)
    "small1024": dict(vocab_size=320, hidden_size=1024, intermediate_size=2048, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=128, rope_theta=10000.0, max_position_embeddings=512),
}
EOS_ID = 257


def byte_tokenizer(vocab_size: int):
    """A byte-level tokenizer: ids 0-255 are bytes, 256 = <|bos|>, 257 = <|eos|>; the rest unused."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from voltserve.tokenizer import Tokenizer, _byte_decoder

    vocab = dict(_byte_decoder())  # GPT-2's byte alphabet: stand-in character -> byte = token id
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])
    return Tokenizer(tok, bos_token_id=256, eos_token_ids=[EOS_ID], vocab_size=vocab_size)


def synthetic_model(shape: str = "tiny", device: str = "cpu", dtype: torch.dtype = torch.float32,
                    seed: int = 0, qtype: str | None = None) -> LoadedModel:
    """A LoadedModel with N(0, 0.02) weights and unit norms.

    Args:
        shape: a key of SHAPES.
        device / dtype: where the tensors are made ("cuda" + float16 for the 8B shapes: ~16 GB).
        qtype: "Q4_0", "Q4_1" or "Q8_0": the decoder's linears come as random GGUF blocks (`quant_blocks`) in
            `quantized`, for GPU benchmarks and tests of quantized models; their `tensors` entries are then
            zero-stride placeholders of the right shape (no dequantized values: the CPU backend would run the
            model with all-zero linears). Embedding and lm_head stay dense. "Q4_K_M": the blocks a llama.cpp
            Q4_K_M file runs as once `loaders.gguf_convert` converted it (`q4_k_m_type`): Q4_1, Q8_0 for some
            v_proj / down_proj and for the lm_head.
    Raises:
        ValueError: an unknown qtype.
    """
    dims = SHAPES[shape]
    cfg = ModelConfig(architecture="llama", tie_word_embeddings=False, bos_token_id=256, eos_token_ids=(EOS_ID,),
                      **dims)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size):
        return (torch.randn(*size, generator=gen, device=device, dtype=dtype) * 0.02)

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    t = {"model.embed_tokens.weight": rand(cfg.vocab_size, h), "lm_head.weight": rand(cfg.vocab_size, h),
         "model.norm.weight": torch.ones(h, device=device, dtype=dtype)}
    if qtype is not None and qtype not in (*BLOCK_BYTES, "Q4_K_M"):
        raise ValueError(f"qtype must be one of {sorted(BLOCK_BYTES)} or Q4_K_M, got {qtype!r}")
    rng = np.random.default_rng(seed)
    quantized: dict[str, QuantizedTensor] = {}

    def linear(name, rows, cols, layer=-1):
        kind = q4_k_m_type(name, layer, cfg.num_layers, cols) if qtype == "Q4_K_M" else qtype
        if kind is None:
            t[name] = rand(rows, cols)
            return
        t[name] = torch.zeros(1, 1, device=device, dtype=dtype).expand(rows, cols)
        quantized[name] = QuantizedTensor(kind, (rows, cols), quant_blocks(kind, rows, cols, rng))

    if qtype == "Q4_K_M":
        linear("lm_head.weight", cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        linear(p + "self_attn.q_proj.weight", cfg.num_heads * d, h, n)
        linear(p + "self_attn.k_proj.weight", cfg.num_kv_heads * d, h, n)
        linear(p + "self_attn.v_proj.weight", cfg.num_kv_heads * d, h, n)
        linear(p + "self_attn.o_proj.weight", h, cfg.num_heads * d, n)
        linear(p + "mlp.gate_proj.weight", i, h, n)
        linear(p + "mlp.up_proj.weight", i, h, n)
        linear(p + "mlp.down_proj.weight", h, i, n)
        t[p + "input_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, device=device, dtype=dtype)
    return LoadedModel(config=cfg, tensors=t, tokenizer=byte_tokenizer(cfg.vocab_size), chat_template=None,
                       source=f"synthetic:{shape}" + (f"-{qtype}" if qtype else ""), quantized=quantized)


def q4_k_m_type(name: str, layer: int, num_layers: int, cols: int) -> str:
    """The packed type weight `name` (of decoder layer `layer`; -1: the lm_head; `cols` input features) runs as in
    a llama.cpp Q4_K_M file after `loaders.gguf_convert`: its Q6_K tensors (the output weight; attn_v and ffn_down
    in the layers llama.cpp's `use_more_bits` picks: the first and last eighth, and every third between) as Q8_0,
    its Q4_K ones as Q4_1; rows that are no whole 256-weight super-blocks llama.cpp stores as Q5_0 / Q8_0, so
    those run as Q8_0."""
    if layer < 0 or cols % 256:
        return "Q8_0"
    eighth = num_layers // 8
    more_bits = layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2
    return "Q8_0" if more_bits and name.endswith(("v_proj.weight", "down_proj.weight")) else "Q4_1"


# byte offsets of the fp16 scale (then min) in each block of the types without kernels (ggml-common.h)
FILE_TYPE_SCALES = {"Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2),
                    "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
                    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ1_S": (0,),
                    "IQ1_M": ()}  # IQ1_M's scale lies in the top bits of its sub-block scales: random


def quant_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 32 * block_bytes] uint8 GGUF blocks (voltserve.quant): random quants, and scales that keep
    a product with a unit-RMS x near unit RMS (Q4_1's m centres the nibbles on zero). A FILE_TYPE_SCALES type
    (K-quants, Q5, i-quants: what `loaders.gguf_convert` converts) gives [rows, cols / block * type_size] random
    bytes with the fp16 fields at 0.5-1.5 / (32 sqrt(cols)) (6-bit sub-block scales times ~32), every other field
    random."""
    if qtype in FILE_TYPE_SCALES:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        if cols % block:
            raise ValueError(f"{qtype} rows are whole blocks of {block}, got {cols} columns")
        blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for off in FILE_TYPE_SCALES[qtype]:
            field = rng.uniform(0.5, 1.5, (rows, cols // block)) / (32 * np.sqrt(cols))
            blocks[:, :, off:off + 2] = field.astype(np.float16)[..., None].view(np.uint8)
        return blocks.reshape(rows, cols // block * size)
    bb = BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 32, bb), dtype=np.uint8)
    step = 1.0 / (np.sqrt(cols) * (4.6 if qtype != "Q8_0" else 74.0))  # q's std: 4.6 (nibbles), 74 (int8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(step).tobytes(), dtype=np.uint8)
    if qtype == "Q4_1":
        blocks[:, :, 2:4] = np.frombuffer(np.float16(-7.5 * step).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * bb)


def save_hf_dir(model: LoadedModel, out: pathlib.Path) -> None:
    """Write config.json, model.safetensors (fp16) and tokenizer.json."""
    from safetensors.torch import save_file

    cfg = model.config
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": EOS_ID, "torch_dtype": "float16"},
        indent=2))
    save_file({k: v.to(torch.float16).contiguous().cpu() for k, v in model.tensors.items()},
              str(out / "model.safetensors"))
    model.tokenizer.backend.save(str(out / "tokenizer.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    save_hf_dir(synthetic_model(args.shape, seed=args.seed), args.out)
    print(f"wrote {args.shape} checkpoint to {args.out}")


if __name__ == "__main__":
    main()
