"""Single-file GGUF -> `LoadedModel` (config from metadata, fp32 weights, packed Q4/Q8 blocks, tokenizer).

K-quant, Q5 and i-quant weights are converted to packed Q4_1 / Q8_0 blocks on the way (`loaders.gguf_convert`)
unless the caller asks for the file's exact values as floats.

Source: GGUF spec (ggml docs/gguf.md); tensor names from llama.cpp's convert_hf_to_gguf.py. Parsing and the
reference dequantization come from the `gguf` package (vectorised numpy).
"""

from __future__ import annotations

import collections
import logging
import pathlib
import time

import numpy as np
import torch

from loaders.gguf_convert import CONVERTED_TYPES, convert_blocks, packed_type
from loaders.gguf_header import read_gguf_header
from loaders.gguf_names import LAYER_NAMES, PACKED_TYPES, hf_name
from loaders.gguf_tokenizer import build_tokenizer
from loaders.model import LoadedModel, QuantizedTensor
from voltserve.config import ModelConfig
from voltserve.errors import LoaderError, UnsupportedModelError

logger = logging.getLogger(__name__)

__all__ = ["DEQUANT_TYPES", "PACKED_TYPES", "hf_name", "load_gguf", "read_metadata", "unpermute_rows"]

# Types we can turn into fp32 (gguf.quants.dequantize); PACKED_TYPES also stay packed for the backends.
FLOAT_TYPES = ("F32", "F16", "BF16")
DEQUANT_TYPES = (*PACKED_TYPES, *FLOAT_TYPES, *CONVERTED_TYPES)


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (interleaved rotary -> HF neox halves).

    llama.cpp's converter maps HF rows of each head [h, 2, d/2] to [h, d/2, 2]; new_rows = old_rows[perm]
    restores the HF order. Same as transformers' `reverse_permute_weights` (modeling_gguf_pytorch_utils.py).

    Args:
        num_rows: num_heads * head_dim.
        num_heads: heads of this projection (query heads for Q, KV heads for K).

    Returns:
        [num_rows] int64 permutation.
    """
    half = num_rows // num_heads // 2
    return np.arange(num_rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)


def read_metadata(reader) -> dict[str, object]:
    """All key/value fields of a GGUFReader as Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def _dequantize(tensor, qtype: str) -> np.ndarray:
    """One GGUF tensor -> fp32 numpy array in row-major [rows, cols] (GGUF lists dims innermost first)."""
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed(tensor.shape))
    if qtype == "F32":
        arr = np.array(tensor.data, dtype=np.float32)
    elif qtype == "F16":
        arr = np.asarray(tensor.data).astype(np.float32)
    else:
        arr = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32, copy=False)
    return arr.reshape(shape)


def load_gguf(path: str | pathlib.Path, convert: bool = True) -> LoadedModel:
    """Read a GGUF file into a LoadedModel.

    Args:
        path: the .gguf file.
        convert: 2-D tensors of a `gguf_convert.CONVERTED_TYPES` type (Q4_K, Q6_K, ...) become packed Q4_1 /
            Q8_0 blocks, their fp32 tensors those blocks' values; False: they load as their exact fp32 values
            only (no packed blocks).

    Returns:
        LoadedModel with fp32 [out, in] tensors under HF names, Q/K rows in HF (neox) order, `quantized`
        holding the raw blocks of every Q4_0/Q4_1/Q8_0 2-D tensor (and the converted ones), the GGUF tokenizer
        and chat template.

    Raises:
        LoaderError: the file cannot be read, is empty, truncated or corrupt (`read_gguf_header`), or lacks
            required tensors/keys.
        UnsupportedModelError: architecture, tokenizer or a tensor type is not supported (names the tensor).
    """
    import gguf

    t0 = time.perf_counter()
    header = read_gguf_header(path)  # an empty, truncated or corrupt file: a LoaderError that says so, naming it
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except (OSError, ValueError, IndexError) as exc:
        raise LoaderError(f"cannot read GGUF {path}: {exc}") from exc
    meta = read_metadata(reader)
    config = header.model_config()  # as `voltserve serve` read it before the load
    tokenizer = build_tokenizer(meta)

    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedTensor] = {}
    perms = {
        "self_attn.q_proj": unpermute_rows(config.num_heads * config.head_dim, config.num_heads),
        "self_attn.k_proj": unpermute_rows(config.num_kv_heads * config.head_dim, config.num_kv_heads),
    }
    converted: collections.Counter[str] = collections.Counter()  # "Q6_K -> Q8_0" -> tensors
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        qtype = t.tensor_type.name
        if qtype not in DEQUANT_TYPES:
            raise UnsupportedModelError(
                f"tensor {t.name} has unsupported type {qtype} (supported: {', '.join(DEQUANT_TYPES)})"
            )
        arr = _dequantize(t, qtype)
        packed = packed_type(qtype, PACKED_TYPES, convert) if arr.ndim == 2 and arr.shape[1] % 32 == 0 else None
        quant = None
        if packed is not None:
            raw = np.asarray(t.data, dtype=np.uint8).reshape(arr.shape[0], -1)
            if packed == qtype:
                quant = QuantizedTensor(qtype=qtype, shape=tuple(arr.shape), data=raw)
            elif (done := convert_blocks(qtype, raw, arr)) is not None:  # rows convert independently: before
                quant, arr = done                                          # the Q / K row permutation
                converted[f"{qtype} -> {quant.qtype}"] += 1
            else:
                converted[f"{qtype} -> floats (out of fp16 range or not finite)"] += 1
        perm = next((p for key, p in perms.items() if key in name), None)
        if perm is not None:
            arr = arr[perm]
        tensors[name] = torch.from_numpy(np.ascontiguousarray(arr))
        if quant is not None:
            data = quant.data
            if perm is not None:
                data = data[perm]
            elif quant.qtype == qtype:  # a view of the file's memory map
                data = np.array(data, copy=True)
            quantized[name] = QuantizedTensor(qtype=quant.qtype, shape=tuple(arr.shape), data=data)
    _check_complete(tensors, config, path)
    if converted:
        logger.info("converted for the quantized kernels: %s (--gguf-convert off keeps the exact values as floats)",
                    ", ".join(f"{n} tensors {k}" for k, n in sorted(converted.items())))
    logger.info("loaded %s in %.1f s: %s", path, time.perf_counter() - t0, config)
    return LoadedModel(
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        source=str(path),
        quantized=quantized,
    )


def _check_complete(tensors: dict[str, torch.Tensor], config: ModelConfig, path) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        needed.append("lm_head.weight")
    for i in range(config.num_layers):
        needed += [f"model.layers.{i}.{v}.weight" for v in LAYER_NAMES.values()]
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise LoaderError(f"{path} lacks tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
