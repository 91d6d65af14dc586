"""Repacked quant rows (backends/cuda/repack.py): the layout the WREPACK kernels read, checked byte by byte on the
CPU against the GGUF blocks it came from, and the round trip."""

import pytest
import torch

from voltserve.backends.cuda.repack import FORMATS, repack_rows, unpack_rows


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("k", [256, 768])
def test_layout_and_round_trip(fmt, k):
    sb, qb = FORMATS[fmt]
    nb, rows = k // 32, 5
    gen = torch.Generator().manual_seed(k + len(fmt))
    gguf = torch.randint(0, 256, (rows, nb * (sb + qb)), generator=gen, dtype=torch.uint8)
    packed = repack_rows(gguf, fmt, k)
    assert packed.shape == gguf.shape and packed.is_contiguous()
    piece = qb // 4
    group = 16 // piece
    for r in range(rows):
        for b in range(nb):
            block = gguf[r, b * (sb + qb):(b + 1) * (sb + qb)]
            assert torch.equal(packed[r, b * sb:(b + 1) * sb], block[:sb])  # the scales, in block order
            for t in range(4):  # slot t's piece of block b: 16 * t + piece * (b % G) into its 64-byte group
                at = nb * sb + (b // group) * 64 + 16 * t + piece * (b % group)
                assert torch.equal(packed[r, at:at + piece], block[sb + piece * t:sb + piece * (t + 1)])
    assert torch.equal(unpack_rows(packed, fmt, k), gguf)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="in_features % 256"):
        repack_rows(torch.zeros(2, 4 * 20, dtype=torch.uint8), "Q4_1", 128)
    with pytest.raises(ValueError, match="uint8"):
        repack_rows(torch.zeros(2, 8 * 20 + 1, dtype=torch.uint8), "Q4_1", 256)
    with pytest.raises(ValueError, match="no repacked layout"):
        repack_rows(torch.zeros(2, 8 * 20, dtype=torch.uint8), "Q5_K", 256)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_synthetic_quantized_model(qtype):
    """tools/make_synthetic_checkpoint.py's quantized linears (GPU benchmarks of quantized models): every decoder
    linear has GGUF blocks of the right shape, its dense entry is a zero-stride placeholder, and the scales keep a
    product with a unit-RMS x near unit RMS."""
    import numpy as np

    from tools.make_synthetic_checkpoint import quant_blocks, synthetic_model
    from voltserve.quant import BLOCK_BYTES

    m = synthetic_model("tiny", qtype=qtype)
    names = [n for n in m.tensors if n.endswith("proj.weight")]
    assert len(names) == 7 * m.config.num_layers and set(m.quantized) == set(names)
    for n in names:
        q = m.quantized[n]
        assert q.qtype == qtype and q.shape == tuple(m.tensors[n].shape)
        assert q.data.shape == (q.shape[0], q.shape[1] // 32 * BLOCK_BYTES[qtype]) and m.tensors[n].stride() == (0, 0)
    rows, cols = 64, 2048
    blocks = quant_blocks(qtype, rows, cols, np.random.default_rng(0)).reshape(rows, cols // 32, -1)
    d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)
    if qtype == "Q8_0":
        w = d * blocks[:, :, 2:].view(np.int8).astype(np.float32)
    else:
        nib = np.concatenate([blocks[:, :, -16:] & 15, blocks[:, :, -16:] >> 4], axis=2).astype(np.float32)
        mn = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32) if qtype == "Q4_1" else -8 * d
        w = d * nib + mn
    x = np.random.default_rng(1).standard_normal(cols).astype(np.float32)
    rms = float(np.sqrt(np.mean((w.reshape(rows, cols) @ x) ** 2)))
    assert 0.5 < rms < 2.0, rms
