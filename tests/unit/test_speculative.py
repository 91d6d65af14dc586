"""Speculative decoding's parts on the host: the n-gram drafter, the concurrency ladder (case L1), verification
(greedy exact, rejection sampling's distribution) and the scheduler's verify steps over a fake model (case D1's
rule: the output equals non-speculative greedy decoding; no KV block leaks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import make_scheduler, make_seq, next_token
from voltserve.config import EngineConfig
from voltserve.errors import ConfigError
from voltserve.request import FinishReason, SamplingParams
from voltserve.spec.ladder import DraftLadder
from voltserve.spec.ngram import NgramDrafter, lookup
from voltserve.spec.verify import accept_greedy, accept_sampled, verify_sampled_many


# -- n-gram drafter ---------------------------------------------------------------------------------------------

def propose(drafter, tokens, k):
    return drafter.propose(make_seq(tokens), k)


def test_ngram_copies_what_followed_the_latest_match():
    d = NgramDrafter(4, min_n=2, max_n=3)
    # suffix [5, 6] occurred twice; the latest occurrence (index 6) is followed by 9, 1
    assert propose(d, [5, 6, 7, 8, 0, 0, 5, 6, 9, 1, 5, 6], 4) == [9, 1, 5, 6]
    assert propose(d, [5, 6, 7, 8, 0, 0, 5, 6, 9, 1, 5, 6], 2) == [9, 1]  # k caps the drafts
    assert propose(d, [1, 2, 3, 4], 4) == []  # no earlier [3, 4]
    assert propose(d, [7, 7], 4) == []  # too short for min_n 2 before the suffix
    # the longest suffix wins: [2, 3, 4] matches at index 0 (-> 8), [3, 4] alone matches later (-> 9)
    assert propose(d, [2, 3, 4, 8, 3, 4, 9, 2, 3, 4], 1) == [8]
    assert propose(d, [2, 3, 4, 8, 3, 4, 9, 2, 3, 4], 9) == [8, 3, 4, 9]  # num_drafts caps k


def test_ngram_drafts_run_into_the_suffix_and_stop_at_the_end():
    d = NgramDrafter(8, min_n=1, max_n=2)
    assert propose(d, [1, 2, 1, 2, 1, 2], 8) == [1, 2]  # repetition: the match right before the suffix
    assert propose(d, [4, 4, 4], 8) == [4]


def test_ngram_lookup_agrees_with_a_brute_force_search():
    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        length = int(torch.randint(1, 40, (1,), generator=gen))
        tokens = torch.randint(0, 4, (length,), generator=gen).tolist()
        min_n, max_n = sorted(torch.randint(1, 5, (2,), generator=gen).tolist())
        want = []
        for n in range(max_n, min_n - 1, -1):  # the longest suffix first, its latest earlier occurrence
            ends = [p for p in range(n - 1, length - 1) if tokens[p - n + 1:p + 1] == tokens[length - n:]]
            if length > n and ends:
                want = tokens[ends[-1] + 1:ends[-1] + 4]
                break
        assert lookup(np.array(tokens), 3, min_n, max_n) == want, (tokens, min_n, max_n)


def test_ngram_follows_a_growing_sequence_and_bounds_the_search():
    d = NgramDrafter(2, min_n=2, max_n=2, max_lookback=6)
    seq = make_seq([1, 2, 3, 0, 0, 0, 0, 0, 1])
    assert d.propose(seq, 2) == []
    seq.output_ids.append(2)  # the cached array grows with the output
    assert d.propose(seq, 2) == []  # the match [1, 2] is older than 6 tokens
    assert NgramDrafter(2, min_n=2, max_n=2).propose(seq, 2) == [3, 0]
    seq.output_ids += [5, 1, 2]
    assert d.propose(seq, 2) == [5, 1]
    with pytest.raises(ValueError):
        NgramDrafter(0)
    with pytest.raises(ValueError):
        NgramDrafter(4, min_n=3, max_n=2)


# -- the ladder (case L1) -----------------------------------------------------------------------------------------

def test_L1_ladder_widths_by_running_sequences():
    ladder = DraftLadder.parse('{"4": 3, "5": 4}', 7)
    assert [ladder.width(r) for r in range(1, 9)] == [7, 7, 7, 3, 4, 4, 4, 4]
    assert DraftLadder.parse("", 5).width(64) == 5
    assert DraftLadder.parse({"8": 1, "2": 2}, 3).rungs == ((2, 2), (8, 1))
    off = DraftLadder.parse('{"4": 3}', 7, disable_at=6)  # speculative_disable_by_batch_size
    assert [off.width(r) for r in range(1, 9)] == [7, 7, 7, 3, 3, 0, 0, 0]
    assert EngineConfig(speculative_disable_by_batch_size=2).draft_ladder().width(2) == 0


def test_verify_graphs_stop_where_the_ladder_stops_drafting():
    from voltserve.graphs import verify_buckets

    ladder = DraftLadder.parse("", 4, disable_at=9)
    # bucket 16 takes 9..16 running sequences: none drafts, so it gets no verify graph
    assert verify_buckets([1, 2, 4, 8, 16], ladder.width) == {1: 5, 2: 9, 4: 17, 8: 33}


@pytest.mark.parametrize("bad, message", [
    ('{"1": 3}', "threshold 1 must be >= 2"),
    ('{"4": 8}', "width 8 at 4 must be an integer in 1..7"),
    ('{"4": 0}', "width 0 at 4 must be an integer in 1..7"),
    ('{"4": 2.5}', "width 2.5 at 4"),
    ('{"x": 2}', "threshold 'x' is not an integer"),
    ('[4, 3]', "must be a JSON object"),
    ("{4: 3}", "is not JSON"),
])
def test_L1_bad_ladders_fail_at_startup(bad, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=7, concurrency_drafts=bad).validate()


def test_bad_speculative_settings_fail_at_startup():
    with pytest.raises(ConfigError, match="speculative_method must be one of none, ngram, draft_model"):
        EngineConfig(speculative_method="eagle").validate()
    with pytest.raises(ConfigError, match="speculative_model is needed with speculative_method draft_model"):
        EngineConfig(speculative_method="draft_model").validate()
    with pytest.raises(ConfigError, match="speculative_model is needed with speculative_method draft_model"):
        EngineConfig(speculative_method="ngram", speculative_model="smollm2-135m-instruct").validate()
    with pytest.raises(ConfigError, match="draft_model runs without tensor parallelism"):
        EngineConfig(speculative_method="draft_model", speculative_model="m", tensor_parallel_size=2).validate()
    with pytest.raises(ConfigError, match="num_speculative_tokens must be >= 1"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0).validate()
    with pytest.raises(ConfigError, match="1 <= ngram_min <= ngram_max <= 64"):
        EngineConfig(speculative_method="ngram", ngram_min=3, ngram_max=2).validate()
    with pytest.raises(ConfigError, match="1 <= ngram_min <= ngram_max <= 64"):
        EngineConfig(speculative_method="ngram", ngram_max=4096).validate()
    with pytest.raises(ConfigError, match="concurrency_drafts: threshold 1 must be >= 2"):
        EngineConfig(concurrency_drafts='{"1": 2}').validate()  # fails at startup with speculation off too
    for bad in (1, -3):
        with pytest.raises(ConfigError, match=f"speculative_disable_by_batch_size must be 0 \\(never\\) or >= 2 "
                                              f".*, not {bad}"):
            EngineConfig(speculative_method="ngram", speculative_disable_by_batch_size=bad).validate()


# -- verification -------------------------------------------------------------------------------------------------

def test_accept_greedy():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all pass: the bonus token too
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the first miss: the target's token ends it
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]


def sampled_verifies(logits, drafts, params, gen, q=None):
    """len(drafts) independent sampled verifies of one sequence's rows logits [2, vocab], the i-th with the one
    draft drafts[i] (drawn from q, or proposed for certain when q is None): one `verify_sampled_many` call of
    len(drafts) identical spans, the batched form of as many `accept_sampled` calls (each span draws its own
    uniform and its own sample). Returns (the first emitted token [n], whether the draft passed [n] bool)."""
    n = len(drafts)
    tokens, accepted = verify_sampled_many(logits.repeat(n, 1), drafts, [1] * n, [params] * n, gen,
                                           [None if q is None else [q]] * n)
    passed = accepted == 1
    assert torch.equal(tokens[passed, 0], drafts[passed])  # a draft that passes is the first token
    return tokens[:, 0], passed


def test_rejection_sampling_keeps_the_target_distribution():
    """Each emitted position follows the target's p whatever the (point-mass) draft: the first token over many
    trials for a draft the target likes, one it dislikes and one it bans (top_k)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 3.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.8, top_k=4)
    p = torch.softmax(logits[0] / 0.8, -1)
    p[3] = 0  # top_k 4 drops the smallest
    p /= p.sum()
    gen = torch.Generator().manual_seed(1234)
    n = 20000
    for draft in (0, 2, 3):
        first, passed = sampled_verifies(logits, torch.full((n,), draft), params, gen)
        counts = torch.bincount(first, minlength=5).float()
        assert (counts / n - p).abs().max() < 0.012, (draft, counts / n, p)
        assert abs(int(passed.sum()) / n - float(p[draft])) < 0.012  # a draft passes with probability p(draft)
        assert counts[3] == 0


def test_rejection_sampling_with_draft_distributions():
    """Drafts sampled from a draft model's q (Leviathan et al. 2023): the first emitted token follows p, a draft
    passes with probability sum(min(p, q)) over the drafts q proposes, and q = p passes every draft."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 3.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.8, top_k=4)
    p = torch.softmax(logits[0] / 0.8, -1)
    p[3] = 0  # top_k 4 drops the smallest
    p /= p.sum()
    q_narrow = torch.tensor([0.1, 0.3, 0.3, 0.3])  # narrower than the target's vocabulary: id 4 has q = 0
    gen = torch.Generator().manual_seed(99)
    n = 20000
    for q in (torch.tensor([0.05, 0.1, 0.6, 0.2, 0.05]), q_narrow, p.clone()):
        drafts = torch.multinomial(q, n, replacement=True, generator=gen)
        first, passed = sampled_verifies(logits, drafts, params, gen, q)
        counts, accepted = torch.bincount(first, minlength=5).float(), int(passed.sum())
        qq = torch.cat([q, q.new_zeros(5 - len(q))])
        assert (counts / n - p).abs().max() < 0.012, (q, counts / n, p)
        assert abs(accepted / n - float(torch.minimum(p, qq).sum())) < 0.012
        assert counts[3] == 0
    assert accepted == n  # q = p


def test_accept_sampled_is_one_span_of_verify_sampled_many():
    """`accept_sampled` (the host form of a sampled verify; the rejection sampling tests above draw their trials
    as spans of one `verify_sampled_many` call) emits exactly the tokens of a one-span `verify_sampled_many` from
    the same generator state, for point-mass drafts and drafts with a q, passing or not."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 3.0, 0.0, 0.0], [1.0, 0.0, 0.5, 2.0, 0.0]])
    params = SamplingParams(temperature=0.8, top_k=4)
    q = [torch.tensor([0.05, 0.1, 0.6, 0.2, 0.05]), torch.tensor([0.1, 0.3, 0.3, 0.3])]
    outs = set()
    for seed in range(100):
        for drafts, probs in (([0], None), ([2, 2], None), ([2], q[:1]), ([2, 1], q)):
            got = accept_sampled(logits[:len(drafts) + 1], drafts, params, torch.Generator().manual_seed(seed), probs)
            tokens, accepted = verify_sampled_many(logits[:len(drafts) + 1], torch.tensor(drafts), [len(drafts)],
                                                   [params], torch.Generator().manual_seed(seed), [probs])
            assert got == tokens[0, :int(accepted[0]) + 1].tolist(), (seed, drafts)
            outs.add(len(got))
    assert outs == {1, 2, 3}  # drafts rejected at once, after one pass and all passing


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# the CPU checks drafts position by position by default; both ways run everywhere
MODES = [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=pytest.mark.gpu),
         pytest.param("cuda", True, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device, at_once", MODES)
def test_verify_sampled_keeps_every_positions_distribution(device, at_once):
    """Three drafts at once on `device` (no host sync inside), 20,050 trials each way: 50 `verify_sampled` calls,
    then 1,000-span `verify_sampled_many` calls (a call per trial took minutes on a GPU):
    - point-mass drafts (each row's likeliest token): the first token follows p[0], a rejection at the second
      draft samples p[1] without its draft, and after three passes the last token follows p[3] (the rows differ,
      so a token sampled from the wrong row or residual shows);
    - drafts drawn from a draft model's q: the first token follows p[0], the first draft passes with probability
      sum(min(p[0], q[0]))."""
    from voltserve.spec.verify import sampling_distribution, verify_sampled, verify_sampled_many

    torch.manual_seed(7)
    logits = (torch.randn(4, 6) * 1.5).to(device)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    p = sampling_distribution(logits.cpu(), params)
    gen, host_gen = torch.Generator(device=device).manual_seed(5), torch.Generator().manual_seed(6)
    n, spans, singles = 20000, 1000, 50

    def trials(draw):
        firsts, seconds, lasts, lengths = torch.zeros(6), torch.zeros(6), torch.zeros(6), torch.zeros(5)

        def tally(out, drafts):
            assert out[:-1] == drafts[:len(out) - 1]
            firsts[out[0]] += 1
            lengths[len(out)] += 1
            if len(out) == 2:
                seconds[out[1]] += 1
            if len(out) == 4:
                lasts[out[3]] += 1

        for _ in range(singles):
            drafts, q = draw()
            tokens, accepted = verify_sampled(logits, torch.tensor(drafts, device=device), params, gen, q, at_once)
            assert tokens.device.type == accepted.device.type == device and tokens.shape == (4,)
            tally(tokens[:int(accepted) + 1].tolist(), drafts)
        for _ in range(n // spans):
            drawn = [draw() for _ in range(spans)]
            drafts = torch.tensor([t for d, _ in drawn for t in d], device=device)
            tokens, accepted = verify_sampled_many(logits.repeat(spans, 1), drafts, [3] * spans, [params] * spans,
                                                   gen, [q for _, q in drawn], at_once)
            for (d, _), row, a in zip(drawn, tokens.tolist(), accepted.tolist()):
                tally(row[:a + 1], d)
        total = singles + n // spans * spans
        return firsts / total, seconds, lasts, lengths / total

    likely = p[:3].argmax(-1).tolist()  # so that all three pass often enough
    firsts, seconds, lasts, lengths = trials(lambda: (likely, None))
    assert (firsts - p[0]).abs().max() < 0.012, (firsts, p[0])
    assert abs(lengths[1] - (1 - p[0, likely[0]])) < 0.012
    residual = p[1].clone()
    residual[likely[1]] = 0
    # ~1,300 and ~2,000 samples: 0.05 is ~4 standard deviations of the largest cell
    assert seconds[likely[1]] == 0 and (seconds / seconds.sum() - residual / residual.sum()).abs().max() < 0.05
    assert lasts.sum() > 1000 and (lasts / lasts.sum() - p[3]).abs().max() < 0.05

    q = [torch.softmax(torch.randn(6), -1) for _ in range(3)]
    firsts, _, _, lengths = trials(lambda: ([int(torch.multinomial(x, 1, generator=host_gen)) for x in q], q))
    assert (firsts - p[0]).abs().max() < 0.012, (firsts, p[0])
    assert abs(1 - lengths[1] - float(torch.minimum(p[0], q[0]).sum())) < 0.012


@pytest.mark.parametrize("device, at_once", MODES)
def test_verify_sampled_many_keeps_each_spans_distribution(device, at_once):
    """Four spans verified at once (point-mass drafts, none, drafts drawn from a draft model's q, one more point
    mass), each under its own parameters, 8,000 trials (the four spans 500 times over in each of 16 calls): each
    span's drafts lead its tokens, its first token follows its own first row's p, and its first draft passes as
    often as the rule says (max error 0.02)."""
    from voltserve.spec.verify import sampling_distribution, verify_sampled_many

    torch.manual_seed(11)
    vocab, ks = 7, [2, 0, 3, 1]
    logits = (torch.randn(sum(ks) + len(ks), vocab) * 1.5).to(device)
    params = [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=1.3),
              SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=1.0, min_p=0.1)]
    first = [sum(ks[:s]) + s for s in range(4)]  # each span's first row
    p = [sampling_distribution(logits[r].cpu(), params[s]) for s, r in enumerate(first)]
    q = [torch.softmax(torch.randn(vocab), -1) for _ in range(3)]
    point = [[int(p[0].argmax()), 1], [], None, [int(p[3].argmax())]]
    gen, host_gen = torch.Generator(device=device).manual_seed(5), torch.Generator().manual_seed(6)
    n, repeats = 8000, 500
    firsts, passes = torch.zeros(4, vocab), torch.zeros(4)
    for _ in range(n // repeats):
        drafted = [d if d is not None else [int(torch.multinomial(x, 1, generator=host_gen)) for x in q]
                   for _ in range(repeats) for d in point]
        drafts = torch.tensor([t for d in drafted for t in d], dtype=torch.int64, device=device)
        tokens, accepted = verify_sampled_many(logits.repeat(repeats, 1), drafts, ks * repeats, params * repeats,
                                               gen, [None, None, q, None] * repeats, at_once)
        for i, (row, a) in enumerate(zip(tokens.tolist(), accepted.tolist())):
            s = i % 4
            assert row[:a] == drafted[i][:a] and a <= ks[s]
            firsts[s, row[0]] += 1
            passes[s] += a > 0
    for s in range(4):
        assert (firsts[s] / n - p[s]).abs().max() < 0.02, (s, firsts[s] / n, p[s])
    expected = [float(p[0][point[0][0]]), 0.0, float(torch.minimum(p[2], q[0]).sum()), float(p[3][point[3][0]])]
    assert (passes / n - torch.tensor(expected)).abs().max() < 0.02, (passes / n, expected)


def test_sampled_verify_edge_cases():
    """No drafts (with an empty q list too) samples the one row; generator None draws from torch's default
    generator, so torch.manual_seed makes it reproducible."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    params = SamplingParams(temperature=1.0)
    assert len(accept_sampled(logits, [], params, torch.Generator().manual_seed(0), [])) == 1
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append([accept_sampled(torch.randn(3, 50), [1, 2], params, None) for _ in range(20)])
    assert runs[0] == runs[1]


def test_verify_greedy_matches_accept_greedy():
    from voltserve.spec.verify import verify_greedy

    for targets, drafts in (([5, 6, 7, 8], [5, 6, 7]), ([5, 9, 7, 8], [5, 6, 7]), ([4, 6, 7, 8], [5, 6, 7])):
        tokens, accepted = verify_greedy(torch.tensor(targets), torch.tensor(drafts))
        assert tokens[:int(accepted) + 1].tolist() == accept_greedy(targets, drafts)
    logits = torch.nn.functional.one_hot(torch.tensor([3, 1, 2]), 5).float()  # argmax rows 3, 1, 2
    tokens, accepted = verify_greedy(logits, torch.tensor([3, 0]))
    assert tokens.tolist() == [3, 1, 2] and int(accepted) == 1


# -- the scheduler's verify steps -----------------------------------------------------------------------------------

class FakeDrafter:
    """Proposes `guess(seq tokens)` (a list), at most k of them; records the k it was asked for."""

    def __init__(self, guess):
        self.guess = guess
        self.asked: list[int] = []

    def propose(self, seq, k):
        self.asked.append(k)
        return self.guess(seq.token_ids())[:k]


def fake_step(scheduler):
    """One step over the fake model of tests.helpers.next_token: each row's target is next_token(its input id,
    its position); verify entries accept their drafts as the runner does (greedy)."""
    plan = scheduler.schedule()
    return plan, scheduler.update(plan, fake_sample(plan))


def fake_sample(plan):
    """The fake model's tokens for `plan` (see fake_step)."""
    sampled = {}
    for e in plan.entries:
        seq = e.seq
        if e.drafts:
            ids = [seq.token_at(e.start)] + list(e.drafts)
            targets = [next_token(t, e.start + i) for i, t in enumerate(ids)]
            sampled[seq.seq_id] = accept_greedy(targets, list(e.drafts))
        elif e.sample:
            pos = e.start + e.num_new - 1
            sampled[seq.seq_id] = next_token(seq.token_at(pos), pos)
    return sampled


def run_all(scheduler, seqs):
    for s in seqs:
        scheduler.add(s)
    plans = []
    while scheduler.has_work():
        plans.append(fake_step(scheduler)[0])
    return plans


def oracle(tokens):
    """A drafter that knows the fake model: right for 2 tokens, then wrong."""
    out, pos = [], len(tokens) - 1
    last = tokens[-1]
    for i in range(3):
        last = next_token(last, pos + i) if i < 2 else 1000
        out.append(last)
    return out


def test_D1_verify_steps_give_the_greedy_output_and_free_every_block():
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8], [9]]
    base = make_scheduler()
    ref = [make_seq(p, max_tokens=13) for p in prompts]
    base_plans = run_all(base, ref)
    spec = make_scheduler(drafter=FakeDrafter(oracle), ladder=DraftLadder(4))
    seqs = [make_seq(p, max_tokens=13) for p in prompts]
    plans = run_all(spec, seqs)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in ref]
    assert all(s.finish_reason is FinishReason.LENGTH and len(s.output_ids) == 13 for s in seqs)
    assert len(plans) < len(base_plans)  # 3 tokens a verify step
    assert spec.num_accepted_tokens == 2 * spec.num_verify_steps and spec.num_draft_tokens >= \
        spec.num_accepted_tokens
    assert spec.pool.num_free == spec.pool.num_blocks
    spec.pool.check_invariants()


def test_drafts_stop_at_max_tokens_and_the_context():
    drafter = FakeDrafter(lambda tokens: [1, 1, 1, 1, 1, 1])
    s = make_scheduler(drafter=drafter, ladder=DraftLadder(6), max_model_len=12)
    a = make_seq([5, 5], max_tokens=4)
    b = make_seq([5, 5, 5, 5, 5], max_tokens=20)
    run_all(s, [a, b])
    # a: its 1st token from the prefill, then k <= 4 - 1 - 1 = 2 drafts (the bonus token may be its last)
    assert drafter.asked[0] == 2 and len(a.output_ids) == 4
    # b: the context ends at 12 tokens: at 6 tokens k <= 12 - 6 - 1 = 5
    assert max(drafter.asked) <= 5 and b.num_tokens == 12 and b.finish_reason is FinishReason.LENGTH


def test_an_eos_among_accepted_drafts_ends_the_sequence_there():
    # the fake model's targets at position p after id t: drafts equal them, but the drafter also proposes EOS
    # (id 0) as its 2nd token and the "model" accepts it (a target of 0 there)
    s = make_scheduler(drafter=FakeDrafter(lambda tokens: [77, 0, 55]), ladder=DraftLadder(3), eos=(0,))
    seq = make_seq([1, 2, 3], max_tokens=10)
    s.add(seq)
    plan = s.schedule()
    s.update(plan, {seq.seq_id: 77})  # the prefill's token
    plan = s.schedule()
    assert plan.has_drafts and plan.entries[0].drafts == (77, 0, 55) and plan.entries[0].num_new == 4
    touched = s.update(plan, {seq.seq_id: [77, 0, 55, 9]})  # everything "accepted"
    assert touched == [seq] and seq.output_ids == [77, 77, 0] and seq.finish_reason is FinishReason.STOP
    assert s.pool.num_free == s.pool.num_blocks


def test_the_ladder_sets_each_steps_width_and_no_step_is_planned_ahead():
    drafter = FakeDrafter(lambda tokens: [1] * 8)
    s = make_scheduler(drafter=drafter, ladder=DraftLadder.parse('{"4": 3, "5": 4}', 7), max_num_seqs=8,
                       num_blocks=256)
    seqs = [make_seq([1, 2], max_tokens=50) for _ in range(5)]
    widths = []
    for n in range(1, 6):
        s.add(seqs[n - 1])
        plan, _ = fake_step(s)  # the new one's prefill next to the others' verifies
        drafter.asked.clear()
        plan, _ = fake_step(s)
        widths.append(set(drafter.asked))
        assert s.schedule_ahead(plan) is None
    assert widths == [{7}, {7}, {7}, {3}, {4}]


def test_no_drafts_from_the_disable_size_on_and_steps_planned_ahead_again():
    """speculative_disable_by_batch_size 3: two running sequences verify drafts (no step planned ahead); once a
    third runs, steps decode one token each and the next is planned ahead; when one finishes, drafts return."""
    drafter = FakeDrafter(lambda tokens: [1] * 8)
    s = make_scheduler(drafter=drafter, ladder=DraftLadder.parse("", 4, disable_at=3), max_num_seqs=8,
                       num_blocks=256)
    a, b, c = make_seq([1, 2], max_tokens=50), make_seq([1, 2], max_tokens=50), make_seq([1, 2], max_tokens=8)
    for seq in (a, b):
        s.add(seq)
    fake_step(s)  # both prefills
    plan, _ = fake_step(s)
    assert [len(e.drafts) for e in plan.entries] == [4, 4] and s.schedule_ahead(plan) is None
    s.add(c)
    plan, _ = fake_step(s)  # c's prefill beside a's and b's decodes: three run, none drafts
    assert [len(e.drafts) for e in plan.entries] == [0, 0, 0] and not plan.has_drafts
    drafter.asked.clear()
    plan = s.schedule()
    ahead = s.schedule_ahead(plan)
    assert ahead is not None and [e.num_new for e in ahead.entries] == [1, 1, 1] and drafter.asked == []
    s.update(plan, fake_sample(plan))
    s.update(ahead, fake_sample(ahead))
    while not c.is_finished:
        plan, _ = fake_step(s)
    plan, _ = fake_step(s)  # c is gone: two run again, and draft
    assert [len(e.drafts) for e in plan.entries] == [4, 4]


def test_undraftable_sequences_decode_one_token():
    drafter = FakeDrafter(lambda tokens: [1, 1])
    s = make_scheduler(drafter=drafter, ladder=DraftLadder(2))
    seqs = [make_seq([1, 2], logprobs=1), make_seq([1, 2], presence_penalty=0.5),
            make_seq([1, 2], min_tokens=3, max_tokens=8)]
    for q in seqs:
        s.add(q)
    fake_step(s)
    plan, _ = fake_step(s)
    assert not plan.has_drafts and [e.num_new for e in plan.entries] == [1, 1, 1]
    fake_step(s)
    plan, _ = fake_step(s)  # min_tokens 3 met: the third drafts now
    assert [len(e.drafts) for e in plan.entries] == [0, 0, 2]


def test_drafts_leave_every_running_sequence_a_token():
    """A tight budget (16 tokens, 8 sequences, k = 4, every draft rejected, no backoff): the sequences after the
    drafted ones still decode every step."""
    s = make_scheduler(drafter=FakeDrafter(lambda tokens: [1000] * 4), ladder=DraftLadder(4),
                       max_num_batched_tokens=16, num_blocks=128, draft_max_pause=0)
    seqs = [make_seq([3, 4, 5], max_tokens=40) for _ in range(8)]
    for q in seqs:
        s.add(q)
    while not all(q.output_ids for q in seqs):  # the prompts, over two steps
        fake_step(s)
    before = [len(q.output_ids) for q in seqs]
    for _ in range(10):
        plan, _ = fake_step(s)
        assert plan.num_tokens <= 16 and plan.has_drafts
    assert [len(q.output_ids) - b for q, b in zip(seqs, before)] == [10] * 8


def test_seeded_sampling_is_not_drafted():
    s = make_scheduler(drafter=FakeDrafter(lambda tokens: [1, 1]), ladder=DraftLadder(2))
    seqs = [make_seq([1, 2], temperature=0.7, seed=5), make_seq([1, 2], temperature=0.7),
            make_seq([1, 2], temperature=0, seed=5)]
    for q in seqs:
        s.add(q)
    fake_step(s)
    plan = s.schedule()
    assert [len(e.drafts) for e in plan.entries] == [0, 2, 2]


def test_verify_graph_buckets_follow_the_ladder():
    from voltserve.graphs import verify_buckets

    ladder = DraftLadder.parse('{"4": 3, "5": 4}', 7)
    # bucket 4 takes 3 sequences of 7 drafts (21) or 4 of 3; bucket 32 takes up to 32 x 4 = 128
    assert verify_buckets([1, 2, 4, 8, 16, 32, 64], ladder.width) == {1: 8, 2: 15, 4: 22, 8: 33, 16: 65, 32: 129}
    assert verify_buckets([1, 2, 4], DraftLadder(3).width) == {1: 4, 2: 7, 4: 13}


# -- draft backoff ----------------------------------------------------------------------------------------------

def test_failing_drafts_pause_for_doubling_spans():
    """Every draft rejected: verify, 2 plain decodes, verify, 4, verify, 8, ... (pauses of 2^m tokens after m
    misses in a row, at most max_pause); during a pause schedule_ahead plans the next step (asynchronous
    scheduling), here after each schedule()."""
    for max_pause, pauses in ((64, [2, 4, 8, 16]), (4, [2, 4, 4, 4, 4, 4, 4]), (0, [])):
        s = make_scheduler(drafter=FakeDrafter(lambda tokens: [1000] * 3), ladder=DraftLadder(3),
                           draft_max_pause=max_pause)
        seq = make_seq([3, 4, 5], max_tokens=40)
        s.add(seq)
        fake_step(s)  # the prefill
        kinds = []  # per step: drafts verified, or "a" for a step planned ahead
        while s.has_work():
            plan = s.schedule()
            ahead = s.schedule_ahead(plan)  # as the engine does, while `plan` runs
            s.update(plan, fake_sample(plan))
            kinds.append(len(plan.entries[0].drafts))
            if ahead is not None:
                s.update(ahead, fake_sample(ahead))  # its input: the token `plan` just sampled
                kinds.append("a")
        verifies = [i for i, k in enumerate(kinds) if k == 3]
        gaps = [b - a - 1 for a, b in zip(verifies, verifies[1:])]
        if max_pause:
            assert gaps[:len(pauses)] == pauses, kinds
            assert kinds[verifies[1] + 1:verifies[2]] == [0, "a"] * 2, kinds
        else:
            # max_tokens bounds k at the end; the step after the last one that could draft is planned ahead
            assert kinds[:-4] == [3] * len(kinds[:-4]) and kinds[-4:] == [2, 1, 0, "a"], kinds
        assert len(seq.output_ids) == 40 and s.pool.num_free == s.pool.num_blocks


def test_an_accepted_draft_keeps_drafting():
    s = make_scheduler(drafter=FakeDrafter(oracle), ladder=DraftLadder(3))
    seq = make_seq([3, 4, 5], max_tokens=31)
    s.add(seq)
    plans = []
    while s.has_work():
        plans.append(fake_step(s)[0])
    assert all(p.has_drafts for p in plans[1:-1]) and seq.draft_misses == 0
    assert s.num_accepted_tokens == 2 * s.num_verify_steps


def test_a_miss_after_a_hit_starts_the_streak_again():
    from voltserve.spec.backoff import drafting_paused, record_verify

    seq = make_seq([1], max_tokens=100)
    seq.output_ids = [5] * 10
    record_verify(seq, 0, 64)
    record_verify(seq, 0, 64)
    assert seq.draft_misses == 2 and seq.drafts_resume_at == 14
    assert drafting_paused(seq, 13) and not drafting_paused(seq, 14)
    record_verify(seq, 2, 64)
    record_verify(seq, 0, 64)
    assert seq.draft_misses == 1 and seq.drafts_resume_at == 12


def test_negative_draft_max_pause_fails_at_startup():
    with pytest.raises(ConfigError, match="draft_max_pause must be >= 0"):
        EngineConfig(draft_max_pause=-1).validate()


def test_schedule_ahead_plans_only_steps_schedule_would_not_draft():
    """Not the step in which a sequence's min_tokens is met (schedule() drafts then), but the one after a
    sequence's last draftable token (no draft fits before max_tokens)."""
    s = make_scheduler(drafter=FakeDrafter(lambda tokens: [1000] * 3), ladder=DraftLadder(3))
    seq = make_seq([3, 4, 5], max_tokens=20, min_tokens=2)
    s.add(seq)
    fake_step(s)  # the prefill's token: 1 < min_tokens
    plan = s.schedule()
    assert not plan.has_drafts and s.schedule_ahead(plan) is None
    s.update(plan, fake_sample(plan))
    assert len(s.schedule().entries[0].drafts) == 3
    s = make_scheduler(drafter=FakeDrafter(lambda tokens: [1000] * 3), ladder=DraftLadder(3))
    seq = make_seq([3, 4, 5], max_tokens=3)
    s.add(seq)
    fake_step(s)
    plan = s.schedule()  # at 1 token of 3: one draft fits
    assert plan.entries[0].drafts == (1000,) and s.schedule_ahead(plan) is None  # a verify: never
    s.update(plan, fake_sample(plan))  # rejected: 2 tokens
    plan = s.schedule()
    assert not plan.has_drafts and s.schedule_ahead(plan) is not None


def test_the_streak_stops_growing_at_the_longest_pause():
    from voltserve.spec.backoff import record_verify

    seq = make_seq([1], max_tokens=1000)
    seq.output_ids = [5] * 10
    for _ in range(100):
        record_verify(seq, 0, 64)
    assert seq.draft_misses == 7 and seq.drafts_resume_at == 74


@pytest.mark.parametrize("at_once", [False, True])
def test_verify_sampled_many_of_no_spans(at_once):
    from voltserve.spec.verify import verify_sampled_many

    tokens, accepted = verify_sampled_many(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64), [], [],
                                           torch.Generator(), [], at_once)
    assert tokens.shape == (0, 1) and accepted.shape == (0,) and accepted.dtype == torch.int64
