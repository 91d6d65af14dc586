"""Device sampling vs the CPU reference (voltserve.sampling / torch on the CPU logits).

greedy (argmax_logprob): token ids exact (first index on ties); logprob abs 1e-4 (fp32 logits) / 1e-3 (fp16).
sample_verify (speculative sampling's draft checks, point-mass drafts): rows without a draft give sample's tokens
exactly; with one, over many Philox streams the draft passes at the reference's p(draft) within 5 sigma, a failing
row's token follows p without the draft (chi-square) and never is the draft, and the emitted token (the draft when it
passes) follows p; a draft outside the kept set never passes, a kept set of the draft alone always does; greedy
rows pass when the draft is the argmax.
sample_topk_topp: greedy rows = argmax; logprobs and top-k alternatives = torch.log_softmax / torch.topk within
1e-4 (fp32); the empirical distribution of temperature / top-k / top-p / min-p over many Philox streams matches the
CPU reference's filtered softmax within 5 sigma per token (vocab 64) and never leaves its support (vocab 49152 /
128256); Philox4x32-10 matches Random123's known-answer vectors; same (seed, offset) -> same token.
"""

import pytest
import torch

from voltserve.request import SamplingParams
from voltserve.sampling import filter_logits

pytestmark = pytest.mark.gpu

TOP = 20


@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("vocab", [49152, 151937, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_logprob(cuda_backend, rows, vocab, dtype):
    gen = torch.Generator().manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    logits[0, vocab // 3] = logits[0, vocab // 2] = 40.0  # tie: the lower index wins
    ids, logprobs = cuda_backend.sample_greedy(logits.cuda())
    ref_ids = logits.float().argmax(-1)
    assert torch.equal(ids.cpu(), ref_ids)
    assert int(ids[0]) == vocab // 3
    ref_lp = torch.log_softmax(logits.float(), -1).gather(1, ref_ids[:, None])[:, 0]
    tol = 1e-4 if dtype == torch.float32 else 1e-3
    assert torch.allclose(logprobs.cpu(), ref_lp, atol=tol, rtol=0)


# -- sample_topk_topp -------------------------------------------------------------------------------------------

def _row(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, offset=0, num_logprobs=0, draft=-1):
    from voltserve.backends.cuda.params import SampleRowParams

    return SampleRowParams(seed, offset, temperature, top_p, min_p, top_k, num_logprobs, draft)


def _ref_probs(x: torch.Tensor, **kw) -> torch.Tensor:
    """The CPU reference's sampling distribution of one row [vocab] fp32."""
    p = SamplingParams(**kw)
    return torch.softmax(filter_logits(x.clone(), p), -1)


def test_philox_known_answers(cuda_backend):
    m = 0xFFFFFFFF
    cases = [  # Random123 kat_vectors: philox4x32 10 (ctr0..3, key0..1) -> out0..3
        ([0, 0, 0, 0, 0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([m, m, m, m, m, m], [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0],
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    words = torch.tensor([c for c, _ in cases], dtype=torch.int64).to(torch.int32)  # wraps to u32 bit patterns
    out = cuda_backend.philox4x32_10(words).cpu().to(torch.int64) & m
    assert out.tolist() == [o for _, o in cases]


@pytest.mark.parametrize("vocab", [49152, 128256, 37, 7])
def test_greedy_logprobs_and_top(cuda_backend, vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 9
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[0, vocab // 3] = logits[0, vocab // 2] = 30.0  # tie: the lower index wins
    nlp = [0, 1, 5, 20, 20, 3, 0, 20, 2]
    temps = [0.0, 0.0, 0.0, 0.0, 1.0, 0.7, 1.3, 0.5, 2.0]
    params = [_row(temperature=t, num_logprobs=n, seed=7 + i, top_k=40 if i % 2 else 0)
              for i, (t, n) in enumerate(zip(temps, nlp))]
    ids, lps, (top_ids, top_lps) = cuda_backend.sample(logits.cuda(), params)
    ids, lps, top_ids, top_lps = ids.cpu(), lps.cpu(), top_ids.cpu(), top_lps.cpu()
    ref_lp = torch.log_softmax(logits, -1)
    for r in range(rows):
        if temps[r] == 0.0:
            assert int(ids[r]) == int(logits[r].argmax())
        assert 0 <= int(ids[r]) < vocab
        assert abs(float(lps[r]) - float(ref_lp[r, ids[r]])) < 1e-4
        n = min(nlp[r], vocab)
        if n:
            vals, idx = torch.topk(ref_lp[r], n)
            assert top_ids[r, :n].tolist() == idx.tolist() or r == 0  # row 0 holds a tie, checked below
            assert torch.allclose(top_lps[r, :n], vals, atol=1e-4, rtol=0)
        assert (top_ids[r, n:] == -1).all() and torch.isneginf(top_lps[r, n:]).all()
    assert int(ids[0]) == vocab // 3


def test_top_ties_lower_index_first(cuda_backend):
    vocab = 4099
    x = torch.full((1, vocab), -5.0)
    x[0, [17, 900, 3000, 4098]] = 2.0
    x[0, 5] = 3.0
    _, _, (top_ids, top_lps) = cuda_backend.sample(x.cuda(), [_row(temperature=0.0, num_logprobs=3)])
    assert top_ids[0, :3].tolist() == [5, 17, 900]


CONFIGS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=10),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02),
    dict(temperature=2.0, top_k=3),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_distribution_small_vocab(cuda_backend, cfg):
    vocab, n = 64, 40000
    gen = torch.Generator().manual_seed(CONFIGS.index(cfg))
    x = torch.randn(vocab, generator=gen) * 2
    ref = _ref_probs(x, **cfg).double()
    # half the rows vary the seed at offset 0, half vary the offset under one seed
    params = [_row(seed=1000 + i, offset=0, **cfg) for i in range(n // 2)]
    params += [_row(seed=123456789123, offset=i, **cfg) for i in range(n // 2)]
    ids, _, _ = cuda_backend.sample(x.expand(n, vocab).contiguous().cuda(), params)
    counts = torch.bincount(ids.cpu(), minlength=vocab).double()
    assert counts[ref == 0].sum() == 0, "sampled a token outside the reference's support"
    expect = n * ref
    sigma = (n * ref * (1 - ref)).sqrt()
    assert ((counts - expect).abs() <= 5 * sigma + 1).all(), (counts, expect)
    chi2 = float(((counts - expect)[ref > 0] ** 2 / expect[ref > 0]).sum())
    dof = int((ref > 0).sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, chi2


@pytest.mark.parametrize("vocab", [49152, 128256])
@pytest.mark.parametrize("cfg", [dict(temperature=1.0, top_k=50), dict(temperature=0.8, top_p=0.5),
                                 dict(temperature=1.0, min_p=0.1), dict(temperature=1.5, top_k=1000, top_p=0.9),
                                 dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=1e-6)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_support_large_vocab(cuda_backend, vocab, cfg):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(vocab, generator=gen) * 3
    x[::97] += 4.0  # a heavier head
    ref = _ref_probs(x, **cfg)
    n = 512
    params = [_row(seed=i * 7919, offset=i, num_logprobs=1, **cfg) for i in range(n)]
    ids, lps, _ = cuda_backend.sample(x.expand(n, vocab).contiguous().cuda(), params)
    ids = ids.cpu()
    assert (ref[ids] > 0).all(), "sampled a token outside the reference's support"
    if cfg.get("top_k") == 1 or cfg.get("top_p", 1.0) < 1e-3:
        assert (ids == int(x.argmax())).all()
    else:
        assert len(set(ids.tolist())) > 1
    ref_lp = torch.log_softmax(x, -1)
    assert torch.allclose(lps.cpu(), ref_lp[ids], atol=1e-4, rtol=0)


def test_seed_and_offset(cuda_backend):
    vocab = 1000
    x = torch.zeros(1, vocab).cuda()  # flat: every token equally likely
    rows = 64
    same = [_row(seed=42, offset=5)] * rows
    a, _, _ = cuda_backend.sample(x.expand(rows, vocab).contiguous(), same)
    b, _, _ = cuda_backend.sample(x.expand(rows, vocab).contiguous(), same)
    assert len(set(a.tolist())) == 1 and torch.equal(a, b)
    offs = [_row(seed=42, offset=o) for o in range(rows)]
    c, _, _ = cuda_backend.sample(x.expand(rows, vocab).contiguous(), offs)
    assert len(set(c.tolist())) > rows // 2
    seeds = [_row(seed=s, offset=5) for s in range(rows)]
    d, _, _ = cuda_backend.sample(x.expand(rows, vocab).contiguous(), seeds)
    assert len(set(d.tolist())) > rows // 2
    hi = [_row(seed=42 | (1 << 40), offset=5 | (1 << 40))] * 2  # the high words matter
    e, _, _ = cuda_backend.sample(x.expand(2, vocab).contiguous(), hi)
    assert int(e[0]) == int(e[1])


def test_fp16_logits(cuda_backend):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 32000, generator=gen) * 3).half()
    ids, lps, (top_ids, top_lps) = cuda_backend.sample(x.cuda(), [_row(temperature=0.0, num_logprobs=5)] * 4)
    ref = torch.log_softmax(x.float(), -1)
    assert torch.equal(ids.cpu(), x.float().argmax(-1))
    assert torch.allclose(lps.cpu(), ref.gather(1, ids.cpu()[:, None])[:, 0], atol=1e-3, rtol=0)
    assert torch.allclose(top_lps.cpu()[:, :5], ref.topk(5).values, atol=1e-3, rtol=0)


def test_runner_device_path_reproducible(cuda_backend):
    """ModelRunner.execute takes the device path for temperature/top-p/logprobs rows; a seeded sequence gives the
    same tokens run to run (R1) and its Philox offset advances by one per sampled token."""
    from voltserve.runner import ModelRunner
    from voltserve.scheduler import ScheduledSeq, StepPlan
    from voltserve.sequence import Sequence

    vocab = 5000
    gen = torch.Generator().manual_seed(11)
    steps = [torch.randn(2, vocab, generator=gen).cuda() for _ in range(6)]
    kv = torch.zeros(1, 2, 1, 16, 1, 8, dtype=torch.float16, device="cuda")

    def run(seed_a):
        runner = ModelRunner(None, cuda_backend, kv, eos_token_ids=(0,), seed=0)
        runner.prepare = lambda plan: None
        pa = SamplingParams(temperature=0.9, top_p=0.95, seed=seed_a, logprobs=3)
        pb = SamplingParams(temperature=1.2, top_k=40, min_p=0.01, seed=7)
        seqs = [Sequence(i, "r", i, [1, 2, 3], p, 16, philox_seed=p.seed) for i, p in enumerate((pa, pb))]
        out, lps_all = [], []
        for logits in steps:
            runner.forward = lambda step, logits=logits: logits
            plan = StepPlan([ScheduledSeq(s, s.num_tokens - 1, 1, True) for s in seqs])
            toks, lps = runner.execute(plan)
            for s in seqs:
                s.output_ids.append(toks[s.seq_id])
            out.append((toks[0], toks[1]))
            lps_all.append(lps)
        assert [s.philox_offset for s in seqs] == [len(steps)] * 2
        return out, lps_all

    a, lps = run(1234)
    b, _ = run(1234)
    assert a == b
    for (tok, _), lp, logits in zip(a, lps, steps):
        ref = torch.log_softmax(logits[0].cpu(), -1)
        assert set(lp) == {0} and lp[0].token_id == tok
        assert abs(lp[0].logprob - float(ref[tok])) < 1e-4
        assert [t for t, _ in lp[0].top] == ref.topk(3).indices.tolist()


# -- sample_verify: speculative sampling's draft checks ---------------------------------------------------------

def _tally(values: torch.Tensor, vocab: int) -> torch.Tensor:
    """A histogram of token ids [n] int64 over the vocabulary, fp64."""
    return torch.bincount(values, minlength=vocab).double()


def _assert_follows(counts: torch.Tensor, ref: torch.Tensor) -> None:
    """counts (a histogram of n draws) against probabilities ref: 5 sigma per token, a chi-square bound, and
    nothing outside ref's support."""
    n = float(counts.sum())
    assert counts[ref == 0].sum() == 0, "a token outside the reference's support"
    expect = n * ref
    sigma = (n * ref * (1 - ref)).sqrt()
    assert ((counts - expect).abs() <= 5 * sigma + 1).all(), (counts, expect)
    keep = ref > 0
    chi2 = float(((counts - expect)[keep] ** 2 / expect[keep]).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, chi2


def test_verify_rows_without_a_draft_sample_as_sample_does(cuda_backend):
    gen = torch.Generator().manual_seed(21)
    x = (torch.randn(6, 4000, generator=gen) * 3).cuda()
    params = [_row(temperature=t, top_k=k, top_p=p, seed=5 + i, offset=i)
              for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 40, 1.0), (1.3, 0, 0.9), (0.0, 0, 1.0),
                                             (1.0, 5, 0.5), (2.0, 0, 1.0)])]
    ids, _, _ = cuda_backend.sample(x, params)
    checked = cuda_backend.sample_verify(x, params)
    assert checked.shape == (2, 6) and checked.dtype == torch.int64
    assert torch.equal(checked[0], ids) and checked[1].tolist() == [0] * 6


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_verify_keeps_the_target_distribution(cuda_backend, cfg):
    """Speculative sampling with a point-mass draft d (Leviathan et al. 2023): d passes with probability p(d);
    a rejection samples p without d; so the emitted token follows p."""
    vocab, n = 64, 40000
    gen = torch.Generator().manual_seed(100 + CONFIGS.index(cfg))
    x = torch.randn(vocab, generator=gen) * 2
    ref = _ref_probs(x, **cfg).double()
    d = int(ref.argsort(descending=True)[1])  # the second likeliest: passes and fails both common
    params = [_row(seed=77, offset=i, draft=d, **cfg) for i in range(n)]
    tokens, passed = cuda_backend.sample_verify(x.expand(n, vocab).contiguous().cuda(), params).cpu()
    ok = passed == 1
    p_d = float(ref[d])
    assert abs(float(ok.sum()) - n * p_d) <= 5 * (n * p_d * (1 - p_d)) ** 0.5 + 1, (float(ok.sum()) / n, p_d)
    assert (tokens[~ok] != d).all()
    residual = ref.clone()
    residual[d] = 0
    _assert_follows(_tally(tokens[~ok], vocab), residual / residual.sum())
    _assert_follows(_tally(torch.where(ok, d, tokens), vocab), ref)


def test_verify_edge_rows(cuda_backend):
    """A draft outside the kept set never passes; a kept set of the draft alone always does; greedy rows pass
    when the draft is the argmax (fp16 logits, a large vocabulary)."""
    vocab, n = 49152, 256
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(vocab, generator=gen) * 3).half()
    order = x.float().argsort(descending=True)
    top, outside = int(order[0]), int(order[100])
    rows = [_row(top_k=3, seed=1, offset=i, draft=outside) for i in range(n)]
    rows += [_row(top_k=1, seed=2, offset=i, draft=top) for i in range(n)]
    rows += [_row(temperature=0.0, draft=top), _row(temperature=0.0, draft=outside)]
    tokens, passed = cuda_backend.sample_verify(x.expand(len(rows), vocab).contiguous().cuda(), rows).cpu()
    assert passed[:n].sum() == 0 and set(tokens[:n].tolist()) <= set(order[:3].tolist())
    assert passed[n:2 * n].sum() == n
    assert passed[2 * n:].tolist() == [1, 0] and tokens[2 * n:].tolist() == [top, top]


def test_race_draws_each_token_its_own_word(cuda_backend):
    """The race takes 4 tokens' words from one Philox call (token b0 + u * 1024 + t: word u % 4 of counter
    (b0 + t, 2 + u / 4, offset)): tied tokens that share a thread, a counter or a call, and a second b0, are
    drawn uniformly, plainly and (one of them a draft) after a failed check. A word shared by two tokens would
    tie their exponentials and favour the lower index."""
    vocab, n = 16384, 20000
    tied = [5 + 1024 * u for u in range(8)] + [8192 + 5, 8192 + 5 * 1024 + 5]
    x = torch.full((vocab,), float("-inf"))
    x[tied] = 0.0
    ref = torch.zeros(vocab, dtype=torch.float64)
    ref[tied] = 1 / len(tied)
    logits = x.cuda().expand(n, vocab)  # row stride 0: every row reads the one row
    ids, _, _ = cuda_backend.sample(logits, [_row(seed=3, offset=i) for i in range(n)])
    _assert_follows(_tally(ids.cpu(), vocab), ref)
    d = tied[2]
    tokens, passed = cuda_backend.sample_verify(logits, [_row(seed=4, offset=i, draft=d) for i in range(n)]).cpu()
    ok = passed == 1
    assert abs(float(ok.sum()) - n / len(tied)) <= 5 * (n * 0.1 * 0.9) ** 0.5
    residual = ref.clone()
    residual[d] = 0
    _assert_follows(_tally(tokens[~ok], vocab), residual / residual.sum())


@pytest.mark.parametrize("vocab", [8193, 49152, 128256, 151937])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("many", [False, True], ids=["block-a-step", "block-a-row"])
def test_chunked_rows_give_the_single_block_tokens(cuda_backend, vocab, dtype, many):
    """Rows without top-k / top-p / min-p / logprobs on sample_chunks (a block a step while rows <= SMs; `many`:
    more rows, a block a row in one pass): the tokens and draft checks of sample_topk_topp (same loads, same
    Philox words), logprobs within 1e-4 (fp32) / 1e-3 (fp16) (log_z summed in another order), top entries
    -1 / -inf, the arrival counters zero again. Rows include a stripe of -inf logits, greedy rows whose draft is
    the argmax and drafts in the last, partial step."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.sampling import _chunk_row, _filtered_row

    gen = torch.Generator().manual_seed(vocab)
    rows = cuda_backend.num_sms + 8 if many else min(96, cuda_backend.num_sms)
    x = torch.randn(rows, vocab, generator=gen) * 3
    x[:, 1000:3000] = float("-inf")
    logits = x.to(dtype).cuda()
    argmax = logits.float().argmax(-1).tolist()
    temps = [0.0, 0.7, 1.0, 1.3]
    drafts = [argmax[i] if i % 8 == 0 else vocab - 1 - i if i % 3 == 1 else (7 * i) % vocab if i % 3 == 2 else -1
              for i in range(rows)]
    params = [_row(temperature=temps[i % 4], seed=11 + i, offset=i * 3, draft=drafts[i]) for i in range(rows)]
    assert all(_chunk_row(r, vocab) and not _filtered_row(r) for r in params)
    assert cuda_backend._sample_chunks(rows, vocab) == (1 if many else kernels.sample_chunk_count(vocab))
    chunked_ids, chunked_lp, (top_ids, top_lps) = cuda_backend.sample(logits, params)
    chunked_checks = cuda_backend.sample_verify(logits, params)
    assert not cuda_backend.sample_counters.any()
    try:
        cuda_backend.sample_chunks = "off"
        ids, lp, _ = cuda_backend.sample(logits, params)
        checks = cuda_backend.sample_verify(logits, params)
    finally:
        cuda_backend.sample_chunks = "auto"
    assert torch.equal(chunked_ids, ids) and torch.equal(chunked_checks[0], checks[0])
    assert chunked_checks[1][::8].tolist() == [1] * len(range(0, rows, 8))  # greedy rows (i % 8 == 0 -> T 0)
    # a sampled check differs only where u * sum lands within rounding of e_d (summed in another order)
    assert int((chunked_checks[1] != checks[1]).sum()) <= 1
    tol = 1e-4 if dtype == torch.float32 else 1e-3
    assert torch.allclose(chunked_lp, lp, atol=tol, rtol=0)
    assert (top_ids == -1).all() and torch.isinf(top_lps).all()


def _single_block(backend, call):
    """call() with every launch on sample_topk_topp (VOLTSERVE_SAMPLE_CHUNKS=off)."""
    mode = backend.sample_chunks
    try:
        backend.sample_chunks = "off"
        return call()
    finally:
        backend.sample_chunks = mode


@pytest.mark.parametrize("vocab", [8193, 49152, 151937])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("blocks", ["step", "two", "row"])
def test_chunked_top_p_rows_give_the_single_block_tokens(cuda_backend, vocab, dtype, blocks):
    """Rows with top-p and / or min-p on sample_chunks (a weight histogram, the crossing bin's candidates, the
    threshold radix-selected among them), a block a step, two blocks a row (each several steps; not for 8,193
    tokens: two steps) or one (more rows than half the SMs): sample_topk_topp's tokens and draft checks (the
    same threshold, kept set and Philox words), logprobs within 1e-4 (fp32) / 1e-3 (fp16), the counters and
    histograms zero again. Rows: spread logits, integer logits (tie groups of thousands: a crossing bin of
    more than SAMPLE_CANDIDATES tokens reads the row again), a flat row (every token tied), greedy rows and
    plain rows beside them, drafts kept, cut and in the last chunk."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.sampling import _chunk_row, _filtered_row

    gen = torch.Generator().manual_seed(vocab + 1)
    steps = kernels.sample_chunk_count(vocab)
    sms = cuda_backend.num_sms
    rows, chunks = {"step": (min(40, sms // steps), steps), "two": (sms // 2, 2), "row": (sms // 2 + 3, 1)}[blocks]
    if rows == 0:
        pytest.skip(f"{sms} SMs hold no top-p row of {steps} blocks")
    x = torch.randn(rows, vocab, generator=gen) * 3
    x[1::5] = torch.randint(0, 4, (len(range(1, rows, 5)), vocab), generator=gen).float()
    x[2::5, 500:900] = float("-inf")
    x[4 % rows] = 0.0  # (fewer than 5 rows on GPUs of < 95 SMs at 151,937 tokens)
    logits = x.to(dtype).cuda()
    order = logits.float().argsort(-1, descending=True)
    cfgs = [(1.0, 0.95, 0.0), (0.7, 0.5, 0.0), (1.3, 0.9, 0.05), (1.0, 1.0, 0.1), (0.8, 0.99, 0.0),
            (0.0, 0.9, 0.0), (1.0, 1.0, 0.0), (1.0, 1e-6, 0.0)]
    drafts = [int(order[i, i % 3]) if i % 4 == 0 else vocab - 1 if i % 4 == 1 else -1 if i % 4 == 2
              else int(order[i, 50]) for i in range(rows)]
    params = [_row(temperature=t, top_p=tp, min_p=mp, seed=31 + i, offset=5 * i, draft=drafts[i])
              for i, (t, tp, mp) in enumerate(cfgs[i % len(cfgs)] for i in range(rows))]
    assert all(_chunk_row(r, vocab) for r in params) and any(_filtered_row(r) for r in params)
    assert cuda_backend._sample_chunks(rows, vocab, filtered=True) == chunks
    chunked_ids, chunked_lp, (top_ids, top_lps) = cuda_backend.sample(logits, params)
    chunked_checks = cuda_backend.sample_verify(logits, params)
    assert not cuda_backend.sample_counters.any() and not cuda_backend.sample_hist.any()
    ids, lp, _ = _single_block(cuda_backend, lambda: cuda_backend.sample(logits, params))
    checks = _single_block(cuda_backend, lambda: cuda_backend.sample_verify(logits, params))
    assert torch.equal(chunked_ids, ids) and torch.equal(chunked_checks[0], checks[0])
    # a sampled check differs only where u * sum lands within rounding of e_d (summed in another order)
    assert int((chunked_checks[1] != checks[1]).sum()) <= 1
    assert torch.allclose(chunked_lp, lp, atol=1e-4 if dtype == torch.float32 else 1e-3, rtol=0)
    assert (top_ids == -1).all() and torch.isinf(top_lps).all()


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_chunked_top_p_thresholds_over_many_draws(cuda_backend, top_p):
    """A wrong top-p threshold shows only in draws that land near the cut, so sample_chunks' tokens are compared
    with sample_topk_topp's over 64 offsets a row: dense rows (a permutation of 49,152 values 1.6e-4 apart:
    ~96 tokens in each 1/64-wide bin, the crossing bin's among them) and spread rows, a block a step."""
    from voltserve.backends.cuda import kernels

    vocab = 49152
    rows = min(16, cuda_backend.num_sms // kernels.sample_chunk_count(vocab))
    gen = torch.Generator().manual_seed(int(top_p * 100))
    x = torch.randn(rows, vocab, generator=gen) * 3
    for r in range(0, rows, 2):
        x[r] = torch.linspace(4, -4, vocab)[torch.randperm(vocab, generator=gen)]
    logits = x.cuda()
    assert cuda_backend._sample_chunks(rows, vocab, filtered=True) == kernels.sample_chunk_count(vocab)
    for k in range(64):
        params = [_row(top_p=top_p, seed=9 + r, offset=k) for r in range(rows)]
        chunked = cuda_backend.sample(logits, params)[0]
        single = _single_block(cuda_backend, lambda: cuda_backend.sample(logits, params))[0]
        assert torch.equal(chunked, single), (k, chunked.tolist(), single.tolist())


@pytest.mark.parametrize("cfg", [dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, top_p=0.6, min_p=0.02),
                                 dict(temperature=1.2, min_p=0.05)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_chunked_top_p_follows_the_reference(cuda_backend, cfg):
    """sample_chunks' top-p / min-p rows (16,384 tokens: 2 chunks, 40 heavy tokens over a flat tail) draw from
    the CPU reference's distribution, and with a point-mass draft keep it (Leviathan et al. 2023)."""
    from voltserve.backends.cuda import kernels

    vocab, n = 16384, 24000
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(vocab, generator=gen)
    x[torch.randperm(vocab, generator=gen)[:40]] += 8 + 2 * torch.randn(40, generator=gen)
    ref = _ref_probs(x, **cfg).double()
    rows = min(64, cuda_backend.num_sms // kernels.sample_chunk_count(vocab))
    assert cuda_backend._sample_chunks(rows, vocab, filtered=True) == 2
    logits = x.expand(rows, vocab).contiguous().cuda()
    d = int(ref.argsort(descending=True)[1])
    ids, tokens, passed = [], [], []
    for start in range(0, n, rows):
        ids.append(cuda_backend.sample(logits, [_row(seed=3, offset=start + i, **cfg) for i in range(rows)])[0])
        t, ok = cuda_backend.sample_verify(logits, [_row(seed=4, offset=start + i, draft=d, **cfg)
                                                    for i in range(rows)])
        tokens.append(t)
        passed.append(ok)
    _assert_follows(_tally(torch.cat(ids).cpu(), vocab), ref)
    tokens, ok = torch.cat(tokens).cpu(), torch.cat(passed).cpu() == 1
    _assert_follows(_tally(torch.where(ok, d, tokens), vocab), ref)

