import math

import pytest
import torch

from voltserve.request import SamplingParams
from voltserve.sampling import SampleRow, sample


def row(prompt=(), output=(), eos=(0,), seed=None, **kw):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SampleRow(SamplingParams(**kw), gen, list(prompt), list(output), eos)


LOGITS = torch.tensor([[0.0, 1.0, 3.0, 2.0, -1.0]])


def test_greedy_is_argmax():
    tokens, lps = sample(LOGITS.repeat(2, 1), [row(temperature=0), row(temperature=0)])
    assert tokens == [2, 2] and lps == [None, None]


def test_top_k_1_and_tiny_top_p_are_greedy():
    assert sample(LOGITS, [row(temperature=1.0, top_k=1, seed=1)])[0] == [2]
    assert sample(LOGITS, [row(temperature=1.0, top_p=0.01, seed=1)])[0] == [2]


def test_min_p_keeps_only_near_top_tokens():
    # p(3)/p(2) = e^-1 = 0.37 < 0.5: only token 2 survives
    for seed in range(20):
        assert sample(LOGITS, [row(temperature=1.0, min_p=0.5, seed=seed)])[0] == [2]


def test_seeded_sampling_is_reproducible():
    a = [sample(LOGITS, [row(temperature=1.0, seed=7)])[0][0] for _ in range(5)]
    gen_a = torch.Generator().manual_seed(7)
    r = SampleRow(SamplingParams(temperature=1.0), gen_a, [], [], (0,))
    seq1 = [sample(LOGITS, [r])[0][0] for _ in range(30)]
    gen_b = torch.Generator().manual_seed(7)
    r = SampleRow(SamplingParams(temperature=1.0), gen_b, [], [], (0,))
    seq2 = [sample(LOGITS, [r])[0][0] for _ in range(30)]
    assert seq1 == seq2 and len(set(a)) == 1 and len(set(seq1)) > 1


def test_sampled_frequencies_follow_softmax():
    gen = torch.Generator().manual_seed(0)
    r = SampleRow(SamplingParams(temperature=1.0), gen, [], [], ())
    n = 4000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample(LOGITS, [r])[0][0]] += 1
    expected = torch.softmax(LOGITS[0], -1) * n
    # 5 sigma of a binomial count
    assert torch.all((counts - expected).abs() <= 5 * torch.sqrt(expected * (1 - expected / n)) + 1)


def test_temperature_sharpens():
    gen = torch.Generator().manual_seed(0)
    r = SampleRow(SamplingParams(temperature=0.05), gen, [], [], ())
    assert {sample(LOGITS, [r])[0][0] for _ in range(50)} == {2}


def test_repetition_penalty_demotes_seen_tokens():
    assert sample(LOGITS, [row(temperature=0, prompt=[2], repetition_penalty=4.0)])[0] == [3]


def test_presence_and_frequency_penalties():
    assert sample(LOGITS, [row(temperature=0, output=[2], presence_penalty=1.5)])[0] == [3]
    assert sample(LOGITS, [row(temperature=0, output=[2, 2], frequency_penalty=0.6)])[0] == [3]
    assert sample(LOGITS, [row(temperature=0, output=[2], frequency_penalty=0.6)])[0] == [2]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.0]])
    assert sample(logits, [row(temperature=0, eos=(0,), min_tokens=2, output=[1])])[0] == [3]
    assert sample(logits, [row(temperature=0, eos=(0,), min_tokens=2, output=[1, 1])])[0] == [0]
    assert sample(logits, [row(temperature=0, eos=(), min_tokens=1, stop_token_ids=[0, 3])])[0] == [1]


def test_logprobs_of_sampled_and_top_tokens():
    tokens, lps = sample(LOGITS, [row(temperature=0, logprobs=2)])
    ref = torch.log_softmax(LOGITS[0], -1)
    lp = lps[0]
    assert lp.token_id == 2 and lp.logprob == pytest.approx(float(ref[2]), abs=1e-6)
    assert [t for t, _ in lp.top] == [2, 3]
    assert lp.top[1][1] == pytest.approx(float(ref[3]), abs=1e-6)
    assert math.exp(lp.logprob) == pytest.approx(float(torch.softmax(LOGITS[0], -1)[2]), rel=1e-5)


def test_grammar_mask_limits_every_row_kind():
    """A row's `allowed` mask (a grammar's next tokens): greedy picks the best allowed token, sampling never
    leaves the mask, logprobs stay the model's (unmasked, as for every row); a row without a mask in the same
    batch is free."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]] * 3)
    allowed = torch.tensor([False, False, True, True, False])
    rows = [SampleRow(SamplingParams(temperature=0.0), None, [], [], (), allowed),
            SampleRow(SamplingParams(temperature=1.0, logprobs=1), gen, [], [], (), allowed),
            SampleRow(SamplingParams(temperature=0.0), None, [], [], ())]
    model = torch.log_softmax(logits[0], -1)
    seen = set()
    for _ in range(200):
        tokens, logprobs = sample(logits, rows)
        assert tokens[0] == 2 and tokens[2] == 0
        seen.add(tokens[1])
        assert math.isclose(logprobs[1].logprob, float(model[tokens[1]]), rel_tol=1e-6)
        assert logprobs[1].top == ((0, float(model[0])),)
    assert seen == {2, 3}


def test_grammar_wins_over_min_tokens_bans():
    """min_tokens bans EOS (0) and a stop id (1); when the grammar allows nothing else, its token is taken rather
    than one outside the mask."""
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    row = SampleRow(SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[1]), None, [], [], (0,),
                    torch.tensor([True, True, False]))
    assert sample(logits, [row])[0] == [1]
    row = SampleRow(SamplingParams(temperature=0.0, min_tokens=5), None, [], [], (0,),
                    torch.tensor([True, True, False]))
    assert sample(logits, [row])[0] == [1]  # the ban on EOS leaves token 1, which the grammar allows


def _filter_one(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filters of one row written out plainly (temperature, top-k, min-p, top-p), for comparison."""
    x = x / p.temperature
    if 0 < p.top_k < x.shape[0]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.min_p > 0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1:
        vals, order = torch.sort(x, descending=True)
        probs = torch.softmax(vals, -1)
        keep = (probs.cumsum(-1) - probs) < p.top_p
        x = torch.full_like(x, float("-inf")).scatter(0, order[keep], vals[keep])
    return x


def test_filter_logits_rows_each_under_their_own_parameters():
    """Rows filtered together, each under its own parameters (one sort for all), equal each row filtered
    alone, and one row equals the same row in a batch (random tie-free rows, 300 batches)."""
    from voltserve.sampling import filter_logits

    gen = torch.Generator().manual_seed(0)
    choices = [SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp)
               for t in (0.3, 1.0, 2.5) for k in (0, 1, 3, 40) for tp in (1.0, 0.8, 0.05) for mp in (0.0, 0.2)]
    for i in range(300):
        n, vocab = 1 + i % 5, (5, 40, 300)[i % 3]
        x = torch.randn(n, vocab, generator=gen) * 3
        params = [choices[int(j)] for j in torch.randint(len(choices), (n,), generator=gen)]
        rows = filter_logits(x, params)
        for r in range(n):
            alone = _filter_one(x[r], params[r])
            assert torch.equal(torch.isinf(rows[r]), torch.isinf(alone)), (params[r], rows[r], alone)
            assert torch.allclose(rows[r][torch.isfinite(alone)], alone[torch.isfinite(alone)])
            assert torch.equal(filter_logits(x[r], params[r]), rows[r])
