"""Prefix-cache block hashes are computed once per sequence (`Sequence.block_hashes`, `kv_cache.chain_hashes`):
through admission, decode, a preemption and the admissions the pool defers afterwards; a prompt's blocks once for
all the choices of a request with n > 1 (`Sequence.prompt_hashes`); and they always describe the sequence's
tokens, through a verify that rejected drafts across a block boundary and a stop string's cut, so a cached block
is only shared where its tokens match."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.helpers import make_scheduler, make_seq, next_token, run_step
from voltserve import kv_cache
from voltserve.kv_cache import hash_block
from voltserve.spec.ladder import DraftLadder
from voltserve.spec.verify import accept_greedy

BS = 4


def _count_hashes(monkeypatch) -> list[tuple]:
    """Record every hash_block call as (parent, tokens)."""
    calls, real = [], kv_cache.hash_block

    def counted(parent, token_ids):
        calls.append((parent, tuple(token_ids)))
        return real(parent, token_ids)

    monkeypatch.setattr(kv_cache, "hash_block", counted)
    return calls


def _chain(tokens: list[int], num_blocks: int) -> list[tuple]:
    """The (parent, tokens) of each of the leading `num_blocks` full blocks of `tokens`."""
    out, parent = [], None
    for b in range(num_blocks):
        block = tuple(tokens[b * BS:(b + 1) * BS])
        out.append((parent, block))
        parent = hash_block(parent, block)
    return out


def _hashes(tokens: list[int], num_blocks: int) -> list[int]:
    return [hash_block(parent, block) for parent, block in _chain(tokens, num_blocks)] if num_blocks else []


def test_each_full_block_is_hashed_once_through_preemption_and_readmission(monkeypatch):
    calls = _count_hashes(monkeypatch)
    s = make_scheduler(num_blocks=10, block_size=BS, max_num_batched_tokens=64)
    a, b = make_seq(range(1, 12), max_tokens=16), make_seq(range(50, 61), max_tokens=16)
    s.add(a)
    s.add(b)
    b_prefills = []
    while s.has_work():
        plan, _ = run_step(s)
        b_prefills += [e.start for e in plan.entries if e.seq is b and e.num_new > 1]
    # b was preempted, waited while the pool was short (an admission tried each step), and came back on its own
    # cached blocks
    assert s.num_preemptions >= 1 and len(b_prefills) == 2 and b_prefills[1] > 0
    assert a.num_tokens == b.num_tokens == 27
    expected = _chain(a.token_ids(), 26 // BS) + _chain(b.token_ids(), 26 // BS)
    assert Counter(calls) == Counter(expected) and len(calls) == len(expected) == 12
    s.pool.check_invariants()


def test_no_hashing_without_prefix_caching(monkeypatch):
    calls = _count_hashes(monkeypatch)
    s = make_scheduler(num_blocks=10, block_size=BS, prefix_caching=False)
    seq = make_seq(range(1, 12), max_tokens=8)
    s.add(seq)
    while s.has_work():
        run_step(s)
    assert calls == [] and seq.block_hashes == [] and s.pool.num_cached == 0


class _OneBadDraftRun:
    """Proposes, once, k drafts for positions crossing a block boundary: the first right (the fake model's
    token), the others wrong, so the verify keeps the first and the model's own token and rejects the rest."""

    def __init__(self):
        self.proposed: list[int] = []

    def propose(self, seq, k):
        if self.proposed or k < 3:
            return []
        right = next_token(seq.token_at(seq.num_tokens - 1), seq.num_tokens - 1)
        self.proposed = [right, 1000, 1001]
        return self.proposed


def _fake_sample(plan) -> dict:
    sampled = {}
    for e in plan.entries:
        seq = e.seq
        if e.drafts:
            ids = [seq.token_at(e.start), *e.drafts]
            sampled[seq.seq_id] = accept_greedy([next_token(t, e.start + i) for i, t in enumerate(ids)],
                                                list(e.drafts))
        elif e.sample:
            pos = e.start + e.num_new - 1
            sampled[seq.seq_id] = next_token(seq.token_at(pos), pos)
    return sampled


def _step(s):
    plan = s.schedule()
    s.update(plan, _fake_sample(plan))
    return plan


def test_rejected_drafts_across_a_block_boundary_never_reach_a_hash():
    drafter = _OneBadDraftRun()
    s = make_scheduler(num_blocks=16, block_size=BS, drafter=drafter, ladder=DraftLadder(3))
    seq = make_seq([1, 2, 3, 4, 5, 6], max_tokens=10)
    s.add(seq)
    _step(s)  # prefill: 7 tokens, 6 computed
    plan = _step(s)  # verify: drafts at positions 7, 8, 9; the one at 8 (the next block's first) is rejected
    assert plan.entries[0].drafts == (drafter.proposed[0], 1000, 1001)
    assert seq.num_computed_tokens == 8 and seq.output_ids[-1] != 1000
    assert seq.block_hashes == _hashes(seq.token_ids(), 2)
    _step(s)
    s.running.remove(seq)  # preempted with block 2 half computed: re-admitted on its 2 cached blocks
    s._preempt(seq)
    plan = _step(s)
    assert plan.entries[0].start == 8
    while s.has_work():
        _step(s)
    tokens = seq.token_ids()
    assert len(tokens) == 16 and 1000 not in tokens
    assert seq.block_hashes == _hashes(tokens, 15 // BS)
    # a prompt with the kept tokens shares all 3 blocks; one with the rejected drafts only the 2 before them
    kept, rejected = make_seq([*tokens[:12], 99], max_tokens=1), make_seq([*tokens[:8], 1000, 1001, 7, 7, 99])
    for probe in (kept, rejected):
        s.add(probe)
        _step(s)
    assert (kept.num_cached_tokens, rejected.num_cached_tokens) == (12, 8)


def test_a_cut_output_drops_the_hashes_of_its_changed_blocks():
    """A stop string that cuts a verify's tokens (the scheduler actor's `_push_to_stop`) truncates the output:
    the hashes of the blocks the cut reaches go, and are computed from the tokens kept when asked again."""
    seq = make_seq([1, 2, 3, 4, 5, 6], max_tokens=20)
    seq.output_ids = [7, 8, 9, 10, 11, 12]
    kv_cache.chain_hashes(seq.block_hashes, seq.tokens_in, 3, BS)
    assert seq.block_hashes == _hashes(seq.token_ids(), 3)
    seq.truncate_output(3, BS)  # 9 tokens: block 2 (positions 8..11) is no longer full
    assert seq.block_hashes == _hashes(seq.token_ids(), 2)
    seq.output_ids += [40, 41, 42]
    kv_cache.chain_hashes(seq.block_hashes, seq.tokens_in, 3, BS)
    assert seq.block_hashes == _hashes(seq.token_ids(), 3) and seq.tokens_in(6, 12) == [7, 8, 9, 40, 41, 42]



def _run_choices(prompt: list[int], n: int, shared: bool, budget: int) -> tuple[list, list, dict]:
    """A request's n choices (tokens an index apart, crossing block boundaries) run to the end on a fresh
    scheduler with a token budget of `budget` a step; the choices share their prompt's hash chain, as
    `actors.engine` makes them, when `shared`. Returns (the choices, each plan's (index, start, num_new, block
    ids) entries, the pool's hash -> block index)."""
    s = make_scheduler(num_blocks=40, block_size=BS, max_num_batched_tokens=budget)
    prompt_hashes = [] if shared else None
    seqs = [make_seq(prompt, max_tokens=8, request_id="r") for _ in range(n)]
    for i, seq in enumerate(seqs):
        seq.index, seq.prompt_hashes = i, prompt_hashes
        s.add(seq)
    plans = []
    while s.has_work():
        plan, _ = run_step(s, lambda seq: 40 + 10 * seq.index + len(seq.output_ids))
        plans.append([(e.seq.index, e.start, e.num_new, tuple(e.seq.block_ids)) for e in plan.entries])
    s.pool.check_invariants()
    return seqs, plans, dict(s.pool._cached)


@pytest.mark.parametrize("budget", [64, 16], ids=["admitted-together", "admitted-apart"])
def test_the_choices_of_one_request_hash_their_prompt_once(monkeypatch, budget):
    """n = 4: each full prompt block is hashed once for the four choices (it was once per choice), each choice's
    own blocks (output tokens) once; the steps, the cache hits (choices admitted apart find the first one's
    prompt blocks) and what is cached are those of unshared chains."""
    prompt = list(range(1, 15))  # 3 full blocks of 4 and 2 tokens; 8 outputs fill blocks 3 and 4 of each choice
    calls = _count_hashes(monkeypatch)
    seqs, plans, cached = _run_choices(prompt, 4, True, budget)
    assert Counter(calls) == Counter(_chain(prompt, 3) + [c for seq in seqs for c in _chain(seq.token_ids(), 5)[3:]])
    assert len(calls) == 3 + 4 * 2
    calls.clear()
    alone, alone_plans, alone_cached = _run_choices(prompt, 4, False, budget)
    assert len(calls) == 4 * 5
    assert plans == alone_plans and cached == alone_cached
    assert [s.block_hashes for s in seqs] == [s.block_hashes for s in alone] == [
        _hashes(s.token_ids(), 5) for s in seqs]
    assert [s.output_ids for s in seqs] == [s.output_ids for s in alone]
    assert [s.num_cached_tokens for s in seqs] == [s.num_cached_tokens for s in alone] == (
        [0, 0, 0, 0] if budget == 64 else [0, 0, 12, 12])  # apart: choice 1 starts in step 1 too
    calls.clear()
    _run_choices(prompt, 1, True, budget)
    assert len(calls) == 3 + 2  # n = 1: the same prompt blocks, one choice's own
