"""A GGUF file's header, read and checked without torch and without parsing its metadata arrays.

`voltserve serve` reads it before anything loads (`voltserve.preflight`), and `loaders.gguf.load_gguf` first thing:
an empty, truncated or corrupt file is then a `LoaderError` that names the file and says what is wrong with it,
instead of a numpy error from deep inside the reader ("cannot reshape array ..."). The `gguf` package's
GGUFReader builds every metadata array (the default model's 49k-token vocabulary and its merges: ~1.7 s); this
steps over arrays and keeps the scalars and strings (~0.1 s), which is all `config_from_metadata` needs.

Source: GGUF spec (ggml docs/gguf.md): magic, version, tensor and key/value counts, the key/value pairs, the tensor
infos, then the tensor data from the next multiple of `general.alignment`, each tensor at its offset there.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import struct
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # numpy, not torch

from voltserve.config import ModelConfig
from voltserve.errors import LoaderError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama",)
VERSIONS = (2, 3)  # those the `gguf` package's reader reads
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# GGUF value types: struct formats of the scalars; 8 is a string, 9 an array
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Truncated(Exception):
    """A read ran past the end of the file."""


class _Corrupt(Exception):
    """A value no well-formed GGUF file holds."""


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file's header says.

    Attributes:
        path: the file.
        metadata: key -> value of every scalar and string key/value pair (arrays, such as the vocabulary, are
            left out).
        tensor_shapes: tensor name -> dims as GGUF lists them (innermost first).
        tensor_types: tensor name -> its GGML type's name ("F32", "Q8_0", "Q4_K", ...).
        data_end: bytes the file needs to hold every tensor's data (the end of the tensor that ends last).
        file_bytes: the file's size.
    """

    path: pathlib.Path
    metadata: dict[str, object]
    tensor_shapes: dict[str, tuple[int, ...]]
    tensor_types: dict[str, str]
    data_end: int
    file_bytes: int

    def model_config(self) -> ModelConfig:
        """The model's hyper-parameters (`config_from_metadata`), as `load_gguf` reads them.

        Raises:
            UnsupportedModelError: an architecture other than llama (the message names the file).
            LoaderError: a required key or the token embedding is missing, or a value is wrong (names the file).
        """
        embedding = self.tensor_shapes.get("token_embd.weight")
        if not embedding:
            raise LoaderError(f"{self.path} has no token_embd.weight")
        has_output = "output.weight" in self.tensor_shapes
        try:
            return config_from_metadata(self.metadata, int(embedding[-1]), has_output=has_output)
        except LoaderError as exc:  # named: beside a draft model, which file is it?
            raise type(exc)(f"{self.path}: {exc}") from None


class _Cursor:
    """Reads little- or big-endian values from a buffer, front to back."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def skip(self, size: int) -> None:
        if self.pos + size > len(self.buf):
            raise _Truncated
        self.pos += size

    def string(self) -> bytes:
        size = self.take("Q")
        start = self.pos
        self.skip(size)
        return bytes(self.buf[start:self.pos])

    def value(self, kind: int, keep: bool):
        """The value of GGUF type `kind` (None for an array, or when not `keep`)."""
        if kind in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[kind])
        if kind == _STRING:
            raw = self.string()
            return raw.decode("utf-8", errors="replace") if keep else None
        if kind != _ARRAY:
            raise _Corrupt(f"unknown metadata value type {kind}")
        item, count = self.take("I"), self.take("Q")
        if item in _SCALAR_FORMATS:
            self.skip(count * struct.calcsize(_SCALAR_FORMATS[item]))
        elif count * 8 > len(self.buf) - self.pos:  # every string or array item takes 8 bytes at least
            raise _Truncated
        else:
            for _ in range(count):
                self.value(item, keep=False)
        return None


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Read and check a GGUF file's header: its structure, and that the file holds all of its tensors' data.

    Args:
        path: the .gguf file.

    Returns:
        The header (scalar metadata, tensor shapes, sizes).

    Raises:
        LoaderError: the file cannot be opened, is empty, is no GGUF file, has a version the reader cannot read,
            or is truncated or corrupt (the message names the file and says which).
    """
    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise LoaderError(f"{path} is empty (0 bytes): truncated or corrupt, not a GGUF model")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf, size)
    except OSError as exc:
        raise LoaderError(f"cannot read GGUF {path}: {exc}") from exc


def _parse(path: pathlib.Path, buf, size: int) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        if size < 4:
            raise LoaderError(f"{path} is truncated or corrupt: {size} bytes, too short for a GGUF header")
        raise LoaderError(f"{path} is not a GGUF file (it starts with {bytes(buf[:4])!r}, not b'GGUF'): corrupt, or "
                          "another format")
    try:
        version = struct.unpack_from("<I", buf, 4)[0] if size >= 8 else 0
        order = ">" if version and not version & 0xFFFF else "<"  # written on a big-endian machine
        cursor = _Cursor(buf, order)
        cursor.skip(4)
        version = cursor.take("I")
        if version not in VERSIONS:
            raise LoaderError(f"{path}: GGUF version {version} is not supported (only {VERSIONS}), or the file is "
                              "corrupt")
        num_tensors, num_pairs = cursor.take("Q"), cursor.take("Q")
        metadata: dict[str, object] = {}
        for _ in range(num_pairs):
            key = cursor.string().decode("utf-8", errors="replace")
            value = cursor.value(cursor.take("I"), keep=True)
            if value is not None:
                metadata[key] = value
        infos = []
        for _ in range(num_tensors):
            name = cursor.string().decode("utf-8", errors="replace")
            num_dims = cursor.take("I")
            if num_dims > MAX_DIMS:
                raise _Corrupt(f"tensor {name} has {num_dims} dimensions")
            dims = tuple(cursor.take("Q") for _ in range(num_dims))
            infos.append((name, dims, cursor.take("I"), cursor.take("Q")))
    except _Truncated:
        raise LoaderError(f"{path} is truncated or corrupt: its header runs past the end of the file "
                          f"({size} bytes)") from None
    except _Corrupt as exc:
        raise LoaderError(f"{path} is corrupt: {exc}") from None
    except RecursionError:  # arrays of arrays nested past Python's stack (`_Cursor.value`); GGUFReader's too
        raise LoaderError(f"{path} is corrupt: its metadata nests arrays too deeply") from None
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise LoaderError(f"{path} is corrupt: general.alignment {alignment!r} is no power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    data_end = data_start
    shapes, types = {}, {}
    for name, dims, kind, offset in infos:
        data_end = max(data_end, data_start + offset + _tensor_bytes(path, name, dims, kind))
        shapes[name] = dims
        types[name] = GGMLQuantizationType(kind).name  # a known type: `_tensor_bytes` checked it
    if data_end > size:
        raise LoaderError(f"{path} is truncated or corrupt: its tensors need {data_end} bytes, the file has {size} "
                          f"({100 * size // data_end}%)")
    return GGUFHeader(path, metadata, shapes, types, data_end, size)


def _tensor_bytes(path: pathlib.Path, name: str, dims: tuple[int, ...], kind: int) -> int:
    try:
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise LoaderError(f"{path}: tensor {name} has tensor type {kind}, which the gguf package does not know "
                          "(corrupt, or newer than the installed gguf)") from None
    elements = 1
    for d in dims:
        elements *= d
    return elements * type_bytes // block


def config_from_metadata(meta: dict[str, object], vocab_size: int, has_output: bool) -> ModelConfig:
    """`llama.*` GGUF metadata -> ModelConfig (neox rope: Q/K rows are un-permuted on load).

    Args:
        meta: GGUF key -> value.
        vocab_size: rows of token_embd.
        has_output: the file has its own `output.weight` (else embeddings are tied).

    Raises:
        UnsupportedModelError: an architecture other than llama.
        LoaderError: a required key is missing, or a value is no number of its kind (a size or count not > 0).
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} "
                                    f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def number(key: str, default=None, cast=int, least: int = 1):
        """`key`'s value as `cast` (an int at least `least`: 1 for a size or count, 0 for a token id); `default`
        when it is absent (None: required). A corrupt or mistyped value fails here in words, not as a ValueError
        or ZeroDivisionError."""
        if key not in meta:
            if default is None:
                raise LoaderError(f"GGUF metadata lacks {key}")
            return default
        value = meta[key]
        try:
            out = cast(value)
        except (TypeError, ValueError, OverflowError):
            out = None
        if out is None or (cast is int and out < least):
            kind = f"an integer >= {least}" if cast is int else "a number"
            raise LoaderError(f"GGUF metadata {key} is {value!r}, not {kind}: corrupt, or not a llama model file")
        return out

    hidden = number(f"{arch}.embedding_length")
    num_heads = number(f"{arch}.attention.head_count")
    num_kv_heads = number(f"{arch}.attention.head_count_kv", num_heads)
    head_dim = (number(f"{arch}.attention.key_length") if f"{arch}.attention.key_length" in meta
                else number(f"{arch}.rope.dimension_count", hidden // num_heads))
    eos = [number(k, least=0) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=str(arch),
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=number(f"{arch}.feed_forward_length"),
        num_layers=number(f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, float),
        rope_theta=number(f"{arch}.rope.freq_base", 10000.0, float),
        max_position_embeddings=number(f"{arch}.context_length", 2048),
        tie_word_embeddings=not has_output,
        rope_style="neox",
        bos_token_id=None if bos is None else number("tokenizer.ggml.bos_token_id", least=0),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )
