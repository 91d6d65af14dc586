"""CudaBackend.rope_attention: attn_decode with the rotary and the KV write fused in (decode-only and mixed steps)
vs the CPU reference (`rope_then_attention`: CpuBackend.rotary_write_kv, then CpuBackend.attention) and vs the GPU's
own two launches (rope_kv_write, then attn_decode).

Bounds: output max |got - ref| <= 4e-3 * max |ref| (test_attention's); the written K rows within rel 2e-3 of the
fp32 reference (test_rotary's) and V rows a bit-exact copy; every other cache slot unchanged. Against the GPU's
two launches: output and cache bit for bit (the same fp32 rotation rounded to fp16 once, the same attention).
Each new key's cache slot holds NaN before the call, so a kernel that reads the cache there instead of the new
key shows up as NaN; a padding token (slot -1) reads its key from the cache and writes nothing.
"""

import pytest
import torch
from tests.kernels.kutils import (assert_replay_equals_eager, backend_settings, launched_kernels, metadata_to_cuda,
                                 paged_kv_case, rel_err)

from voltserve.backends.base import rope_then_attention
from voltserve.backends.cuda import kernels
from voltserve.backends.cpu import rope_cos_sin

pytestmark = pytest.mark.gpu
TOL = 4e-3
MAX_POSITIONS = 9000


def _case(seq_lens, heads, block_size, seed, pad=(), spare=8):
    """(qkv [num_seqs, q | k | v | `spare` columns] fp16, kv with NaN at each new key's slot, metadata with the
    slots, positions): one decode token per sequence at position seq_len - 1; sequences in `pad` get slot -1 and
    keep their cache row."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    kv, attn = paged_kv_case(seq_lens, [1] * len(seq_lens), num_kv_heads, head_dim, block_size, gen)
    slots = []
    for i, n in enumerate(seq_lens):
        slot = _slot(attn, i, n - 1, block_size)
        if i not in pad:
            kv.view(2, -1, num_kv_heads, head_dim)[:, slot] = float("nan")
        slots.append(-1 if i in pad else slot)
    attn.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim + spare, generator=gen).half()
    positions = torch.tensor(seq_lens, dtype=torch.int64) - 1
    return qkv, kv, attn, positions


def _slot(attn, seq, position, block_size):
    """The cache slot of sequence `seq`'s token at `position` (its block table)."""
    return int(attn.block_tables[seq, position // block_size]) * block_size + position % block_size


def _split(qkv, heads):
    num_heads, num_kv_heads, head_dim = heads
    q_size, kv_size, n = num_heads * head_dim, num_kv_heads * head_dim, qkv.shape[0]
    return (qkv[:, :q_size].view(n, num_heads, head_dim),
            qkv[:, q_size:q_size + kv_size].view(n, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size:q_size + 2 * kv_size].view(n, num_kv_heads, head_dim))


def _gpu(backend, qkv, kv, attn, positions, cos_sin, heads, style, fused, max_seq_len=None, split_decode=False,
         max_query_len=None):
    """rope_attention on copies of the inputs: (output, cache, launched kernel names); fused: True ("auto"),
    False ("off") or a VOLTSERVE_ROPE_ATTN value."""
    kv = kv.cuda()
    meta = metadata_to_cuda(attn, max_seq_len, split_decode, max_query_len)
    mode = {True: "auto", False: "off"}.get(fused, fused)
    with backend_settings(backend, rope_attn=mode), launched_kernels(backend) as names:
        out = backend.rope_attention(*_split(qkv.cuda(), heads), positions.cuda(), cos_sin.cuda(), style, kv, meta,
                                     heads[2] ** -0.5)
    return out.cpu(), kv.cpu(), names


def _check(cuda_backend, cpu_backend, seq_lens, heads, style, seed, block_size=16, pad=(), max_seq_len=None,
           spare=8):
    """rope_attention fused (asserted from the launches; the two launches where `spare` leaves the head rows
    unaligned or neox pairs dims across 16-byte vectors, head_dim % 16 == 8) against the CPU reference and against
    the two launches."""
    qkv, kv, attn, positions = _case(seq_lens, heads, block_size, seed, pad, spare)
    cos_sin = rope_cos_sin(heads[2], MAX_POSITIONS, 5e5)
    ref_kv = kv.float().nan_to_num()  # the CPU oracle: unused slots zeroed (test_attention's reason)
    ref = rope_then_attention(cpu_backend, *[t.float() for t in _split(qkv, heads)], positions, cos_sin, style,
                              ref_kv, attn, heads[2] ** -0.5)
    got, got_kv, names = _gpu(cuda_backend, qkv, kv, attn, positions, cos_sin, heads, style, True, max_seq_len)
    fused = spare % 8 == 0 and (style == "interleaved" or heads[2] % 16 == 0)
    assert names[0] == ("attn_decode" if fused else "rope_kv_write")
    assert rel_err(got, ref) <= TOL
    written = attn.slot_mapping[attn.slot_mapping >= 0]
    flat, ref_flat, kv_flat = (t.view(2, -1, heads[1], heads[2]) for t in (got_kv, ref_kv, kv))
    assert rel_err(flat[0, written], ref_flat[0, written]) <= 2e-3
    assert torch.equal(flat[1, written], ref_flat[1, written].half())  # v: a bit-exact copy
    keep = torch.ones(flat.shape[1], dtype=torch.bool)
    keep[written] = False
    assert torch.equal(flat[:, keep].nan_to_num(7.0), kv_flat[:, keep].nan_to_num(7.0))  # nothing else written
    two, two_kv, two_names = _gpu(cuda_backend, qkv, kv, attn, positions, cos_sin, heads, style, False, max_seq_len)
    assert two_names[:2] == ["rope_kv_write", "attn_decode"]
    assert torch.equal(got, two)
    assert torch.equal(got_kv.nan_to_num(7.0), two_kv.nan_to_num(7.0))


# 96: the CUDA-core path on every GPU; GROUP 16: the CUDA-core path, two q vectors per thread when staged
HEADS = [(9, 3, 64), (8, 1, 128), (32, 8, 128), (6, 2, 96), (16, 1, 128)]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_attention_decode(cuda_backend, cpu_backend, heads, style, attn_choice):
    """Contexts of 1 key, a split boundary (17, 64, 65), one partition (512) and several (5003), batch 7."""
    _check(cuda_backend, cpu_backend, [1, 17, 64, 65, 512, 5003, 300], heads, style, seed=heads[2])


@pytest.mark.parametrize("heads", HEADS[1:3])
def test_rope_attention_capacity_grid_and_padding(cuda_backend, cpu_backend, heads, attn_choice):
    """A graph bucket's grid (capacity 8192, contexts spread over the splits) with padding tokens (slot -1)."""
    _check(cuda_backend, cpu_backend, [700, 1, 33, 4097, 2], heads, "neox", seed=5, pad=(1, 3), max_seq_len=8192)


@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_rope_attention_block_sizes(cuda_backend, cpu_backend, block_size, attn_choice):
    _check(cuda_backend, cpu_backend, [129, 1, 2000], (32, 8, 128), "neox", seed=block_size, block_size=block_size)


def test_rope_attention_long_splits(cuda_backend, cpu_backend, attn_choice):
    """Splits of up to 1,024 keys (attn_min_part): the newest key lies in a tile loaded after the PDL wait, not in
    the first one loaded before it."""
    with backend_settings(cuda_backend, attn_min_part=1024):
        _check(cuda_backend, cpu_backend, [1000, 700, 3000, 65], (32, 8, 128), "neox", seed=9)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_attention_head_dim_40(cuda_backend, cpu_backend, style):
    """head_dim 40: neox pairs dims d and d + 20, across 16-byte vectors, so it takes the two launches;
    interleaved pairs stay inside a vector and fuse."""
    _check(cuda_backend, cpu_backend, [300, 1, 77], (6, 2, 40), style, seed=40)


def test_rope_attention_unaligned_rows_take_two_launches(cuda_backend, cpu_backend):
    """q | k | v rows of 5 spare columns: k and v rows not 16-byte aligned, so rope_kv_write runs first."""
    _check(cuda_backend, cpu_backend, [300, 1, 77], (9, 3, 64), "neox", seed=6, spare=5)


def _step_case(cpu_backend, seq_lens, query_lens, heads, style, seed):
    """A step of the given context and query lengths: (qkv, kv with NaN at every new key's slot, metadata with
    the slots, positions, cos_sin, the CPU reference output, the reference cache with the new keys)."""
    gen = torch.Generator().manual_seed(seed)
    kv, attn = paged_kv_case(seq_lens, query_lens, heads[1], heads[2], 16, gen)
    positions, slots = [], []
    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        positions += range(n - q, n)
        slots += [_slot(attn, i, t, 16) for t in range(n - q, n)]
    attn.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    kv.view(2, -1, heads[1], heads[2])[:, attn.slot_mapping] = float("nan")  # a kernel reading them shows NaN
    positions = torch.tensor(positions, dtype=torch.int64)
    qkv = torch.randn(len(slots), (heads[0] + 2 * heads[1]) * heads[2] + 8, generator=gen).half()
    cos_sin = rope_cos_sin(heads[2], MAX_POSITIONS, 1e4)
    ref_kv = kv.float().nan_to_num()
    ref = rope_then_attention(cpu_backend, *[t.float() for t in _split(qkv, heads)], positions, cos_sin, style,
                              ref_kv, attn, heads[2] ** -0.5)
    return qkv, kv, attn, positions, cos_sin, ref, ref_kv


def _check_step(cuda_backend, cpu_backend, seq_lens, query_lens, heads, style, seed, split_decode=False,
                max_seq_len=None, max_query_len=None, fused=None):
    """A step with prompt rows (query length > 1), within TOL of the CPU reference, every new K / V row written,
    and bit for bit the output and cache of "decode" and "off" (rope_kv_write, then the plain kernels). `fused`
    (default: kernels.rope_fused's rule): under "auto" the step has no rope_kv_write (with split_decode
    attn_decode, fused, for the one-token sequences; then attn_prefill, fused), else "auto" launches what "off"
    does."""
    fused = kernels.rope_fused("auto", False, sum(query_lens), len(query_lens)) if fused is None else fused
    qkv, kv, attn, positions, cos_sin, ref, ref_kv = _step_case(cpu_backend, seq_lens, query_lens, heads, style,
                                                                seed)
    runs = {mode: _gpu(cuda_backend, qkv, kv, attn, positions, cos_sin, heads, style, mode, max_seq_len,
                       split_decode, max_query_len) for mode in ("auto", "decode", "off")}
    got, got_kv, names = runs["auto"]
    assert ("rope_kv_write" in names) != fused and names[-1] == "attn_prefill", names
    assert rel_err(got, ref) <= TOL
    flat, ref_flat = got_kv.view(2, -1, heads[1], heads[2]), ref_kv.view(2, -1, heads[1], heads[2])
    assert rel_err(flat[0, attn.slot_mapping], ref_flat[0, attn.slot_mapping]) <= 2e-3
    assert torch.equal(flat[1, attn.slot_mapping], ref_flat[1, attn.slot_mapping].half())
    for mode in ("decode", "off"):
        other, other_kv, other_names = runs[mode]
        assert other_names == (["rope_kv_write"] + names if fused else names), mode
        assert torch.equal(got, other), mode
        assert torch.equal(got_kv.nan_to_num(7.0), other_kv.nan_to_num(7.0)), mode


@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (6, 2, 96)])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_attention_prefill_step(cuda_backend, cpu_backend, heads, style):
    """Prompts fresh and after cached prefixes (chunked prefill, prefix hits), tile edges on both sides, a
    one-token row: rope_kv_write, then attn_prefill, in every mode."""
    _check_step(cuda_backend, cpu_backend, [40, 9, 300, 17, 1, 64], [1, 9, 33, 16, 1, 50], heads, style,
                seed=heads[2])


@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (6, 2, 96)])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_attention_mixed_step(cuda_backend, cpu_backend, heads, style, attn_choice):
    """A mixed step (split_decode; the decode grid sized for an 8192-key capacity, as in a mixed CUDA graph):
    attn_decode (fused) for the one-token sequences, then attn_prefill (fused) for the prompts: one fresh,
    short ones after cached prefixes."""
    _check_step(cuda_backend, cpu_backend, [40, 9, 300, 1, 77, 21, 16], [1, 9, 1, 1, 1, 5, 16], heads, style,
                seed=heads[2] + 1, split_decode=True, max_seq_len=8192, max_query_len=64)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_attention_mixed_step_prompts_over_several_tiles(cuda_backend, cpu_backend, style, attn_choice):
    """Prompts of 47 (three q tiles, after a cached prefix) and 15 tokens next to decodes, 60 prompt tokens: key
    tiles holding new keys of other q tiles, several q tiles writing their keys."""
    _check_step(cuda_backend, cpu_backend, [500, 18, 1, 90, 3000], [1, 15, 1, 47, 1], (32, 8, 128), style,
                seed=7, split_decode=True, max_seq_len=8192, max_query_len=64)


def test_rope_attention_mixed_step_past_the_fused_limit_takes_two_launches(cuda_backend, cpu_backend):
    """More than kernels.ROPE_PREFILL_MAX_TOKENS prompt tokens (the step's tokens past one a sequence; the
    longer-prompt graphs and eager steps): rope_kv_write first."""
    n = kernels.ROPE_PREFILL_MAX_TOKENS + 2
    _check_step(cuda_backend, cpu_backend, [40, n], [1, n], (9, 3, 64), "neox", seed=3, split_decode=True,
                fused=False)


@pytest.mark.parametrize("split_decode", [True, False])
@pytest.mark.parametrize("seq_lens,query_lens", [([30], [30]), ([300], [5]), ([40, 300, 77], [5, 5, 3])])
def test_rope_attention_verify_and_lone_prompt_steps_fuse(cuda_backend, cpu_backend, seq_lens, query_lens,
                                                          split_decode):
    """Steps of sequences of >= 2 query tokens only: a lone short prompt, a verify of 4 drafts at batch 1 and 3
    (a verify CUDA graph: split_decode, attn_decode leaving them at once; eager: attn_prefill alone)."""
    _check_step(cuda_backend, cpu_backend, seq_lens, query_lens, (9, 3, 64), "neox", seed=4,
                split_decode=split_decode, max_query_len=64 if split_decode else None, max_seq_len=8192)


def test_rope_attention_verify_beside_decodes(cuda_backend, cpu_backend, attn_choice):
    """A verify graph's step: sequences verifying drafts beside ones that drafted nothing (one token)."""
    _check_step(cuda_backend, cpu_backend, [900, 41, 5000, 7, 130], [5, 1, 4, 1, 5], (32, 8, 128), "interleaved",
                seed=5, split_decode=True, max_seq_len=8192, max_query_len=64)


def test_rope_attention_head_dim_40_mixed_step_takes_two_launches(cuda_backend, cpu_backend):
    """neox at head_dim 40 pairs dims across 16-byte vectors."""
    _check_step(cuda_backend, cpu_backend, [40, 9], [1, 9], (6, 2, 40), "neox", seed=2, split_decode=True,
                fused=False)


def test_rope_attention_graph_replay_equals_eager(cuda_backend):
    """Captured in a CUDA graph (as the engine's decode steps are), then new q / k / v and positions."""
    heads = (32, 8, 128)
    qkv, kv, attn, positions = _case([300, 1, 77], heads, 16, seed=4)
    qkv, kv, positions = qkv.cuda(), kv.cuda(), positions.cuda()
    meta = metadata_to_cuda(attn, 8192)
    cos_sin = rope_cos_sin(heads[2], MAX_POSITIONS, 5e5).cuda()

    def step():
        out = cuda_backend.rope_attention(*_split(qkv, heads), positions, cos_sin, "neox", kv, meta, 0.088)
        return [out, kv.nan_to_num(7.0)]

    def change():  # then synchronize: attn_decode reads positions before its PDL wait (step metadata)
        qkv.copy_(torch.randn(qkv.shape, dtype=torch.float16))
        positions.copy_(positions.cpu() + 5)
        torch.cuda.synchronize()

    assert_replay_equals_eager(cuda_backend, step, change)


@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)])
def test_rope_attention_verify_rows_as_decodes(cuda_backend, cpu_backend, heads, attn_choice):
    """A verify step whose rows run as decodes (rows_as_decodes, a verify graph's metadata): rope_kv_write writes
    every new key, then attn_decode reads them from the cache; within TOL of the CPU reference, K / V written as
    the reference's, and within TOL of attn_prefill's answer (VOLTSERVE_ATTN_VERIFY=prefill)."""
    qkv, kv, attn, positions, cos_sin, ref, ref_kv = _step_case(cpu_backend, [900, 41, 5000, 7, 130],
                                                                [5, 1, 4, 1, 5], heads, "neox", seed=11)
    runs = {}
    for verify in ("decode", "prefill"):
        meta = metadata_to_cuda(attn, 8192, split_decode=True, max_query_len=64, rows_as_decodes=True)
        kv_dev = kv.cuda()
        with backend_settings(cuda_backend, attn_verify=verify), launched_kernels(cuda_backend) as names:
            out = cuda_backend.rope_attention(*_split(qkv.cuda(), heads), positions.cuda(), cos_sin.cuda(), "neox",
                                              kv_dev, meta, heads[2] ** -0.5)
        runs[verify] = (out.cpu(), kv_dev.cpu(), names)
    got, got_kv, names = runs["decode"]
    assert names[:2] == ["rope_kv_write", "attn_decode"] and "attn_prefill" not in names, names
    assert "attn_prefill" in runs["prefill"][2]
    assert rel_err(got, ref) <= TOL and rel_err(runs["prefill"][0], ref) <= TOL
    flat, ref_flat = got_kv.view(2, -1, heads[1], heads[2]), ref_kv.view(2, -1, heads[1], heads[2])
    assert rel_err(flat[0, attn.slot_mapping], ref_flat[0, attn.slot_mapping]) <= 2e-3
    assert torch.equal(flat[1, attn.slot_mapping], ref_flat[1, attn.slot_mapping].half())
