from tests.helpers import make_scheduler, make_seq, run_step

from voltserve.request import FinishReason


def test_chunked_prefill_then_decode():
    s = make_scheduler(max_num_batched_tokens=8, block_size=4)
    seq = make_seq(range(1, 21), max_tokens=3)
    s.add(seq)
    plan, touched = run_step(s)
    assert [(e.start, e.num_new, e.sample) for e in plan.entries] == [(0, 8, False)] and touched == []
    plan, _ = run_step(s)
    assert [(e.start, e.num_new, e.sample) for e in plan.entries] == [(8, 8, False)]
    plan, touched = run_step(s)
    assert [(e.start, e.num_new, e.sample) for e in plan.entries] == [(16, 4, True)] and touched == [seq]
    plan, _ = run_step(s)
    assert [(e.start, e.num_new) for e in plan.entries] == [(20, 1)]
    run_step(s)
    assert seq.finish_reason is FinishReason.LENGTH and seq.output_ids == [7, 7, 7]
    assert s.pool.num_free == s.pool.num_blocks
    s.pool.check_invariants()


def test_decode_and_new_prefill_share_the_budget():
    s = make_scheduler(max_num_batched_tokens=6, block_size=4)
    a, b = make_seq([1, 2, 3]), make_seq(range(10, 20))
    s.add(a)
    run_step(s)
    s.add(b)
    plan, _ = run_step(s)
    assert [(e.seq, e.num_new) for e in plan.entries] == [(a, 1), (b, 5)]


def test_eos_stops_and_ignore_eos_continues():
    s = make_scheduler(eos=(9,))
    a, b = make_seq([1, 2], max_tokens=5), make_seq([1, 2], max_tokens=3, ignore_eos=True)
    s.add(a)
    s.add(b)
    run_step(s, lambda seq: 9)
    assert a.finish_reason is FinishReason.STOP and a.stop_reason is None
    assert b.finish_reason is None
    run_step(s, lambda seq: 9)
    run_step(s, lambda seq: 9)
    assert b.finish_reason is FinishReason.LENGTH and b.output_ids == [9, 9, 9]


def test_stop_token_ids_report_the_token():
    s = make_scheduler()
    a = make_seq([1, 2], max_tokens=5, stop_token_ids=[42])
    s.add(a)
    run_step(s, lambda seq: 42)
    assert (a.finish_reason, a.stop_reason) == (FinishReason.STOP, 42)


def test_max_model_len_finishes_with_length():
    s = make_scheduler(max_model_len=6)
    a = make_seq([1, 2, 3, 4], max_tokens=100)
    s.add(a)
    for _ in range(2):
        run_step(s)
    assert a.finish_reason is FinishReason.LENGTH and a.num_tokens == 6


def test_prefix_cache_hit_skips_computed_blocks():
    s = make_scheduler(block_size=4)
    prompt = list(range(1, 14))  # 3 full blocks + 1
    a = make_seq(prompt, max_tokens=1)
    s.add(a)
    run_step(s)
    assert a.is_finished
    b = make_seq(prompt, max_tokens=1)
    s.add(b)
    plan, _ = run_step(s)
    assert b.num_cached_tokens == 12
    assert [(e.start, e.num_new) for e in plan.entries] == [(12, 1)]


def test_prefix_cache_never_covers_the_whole_prompt():
    s = make_scheduler(block_size=4)
    a = make_seq(range(1, 9), max_tokens=1)
    s.add(a)
    run_step(s)
    b = make_seq(range(1, 9), max_tokens=1)
    s.add(b)
    plan, _ = run_step(s)
    assert b.num_cached_tokens == 4 and plan.entries[0].num_new == 4  # last token must be computed


def test_preemption_by_recompute_when_pool_runs_dry():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_seq(range(1, 8), max_tokens=8), make_seq(range(20, 27), max_tokens=8)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 blocks each, pool empty
    assert s.pool.num_free == 0
    run_step(s)  # decode position 7: still fits in 2 blocks each
    assert s.num_preemptions == 0
    run_step(s)  # a needs a 3rd block for position 8 -> b (admitted last) is preempted
    assert s.num_preemptions >= 1 and b in s.waiting and b.block_ids == [] and b.num_computed_tokens == 0
    while s.has_work():
        run_step(s)
    assert a.output_ids == [7] * 8 and b.output_ids == [7] * 8
    assert s.pool.num_free == 4
    s.pool.check_invariants()


def test_cached_tokens_keep_the_first_figure_through_preemption():
    """A sequence preempted after its first token matches more of its own blocks when it is admitted again, but
    its cached-token figure stays the one its deltas already carried: usage read from any delta (the first in a
    streamed Anthropic message, the last in a streamed Responses one, the max when not streamed) agrees."""
    s = make_scheduler(num_blocks=9, block_size=4)
    warm = make_seq(range(1, 6), max_tokens=1)  # publishes block [1, 2, 3, 4]
    s.add(warm)
    run_step(s)
    a, b = make_seq(range(20, 31), max_tokens=12), make_seq([1, 2, 3, 4, *range(40, 47)], max_tokens=12)
    s.add(a)
    s.add(b)
    starts, figures = [], set()
    while s.has_work():
        plan, touched = run_step(s)
        starts += [e.start for e in plan.entries if e.seq is b and e.num_new > 1]  # b's (re-)prefills
        figures |= {b.num_cached_tokens for seq in touched if seq is b}
    assert s.num_preemptions == 1 and starts == [4, 12] and figures == {4}
    assert b.output_ids == [7] * 12


def test_abort_frees_blocks():
    s = make_scheduler()
    a = make_seq(range(1, 30), max_tokens=50)
    s.add(a)
    run_step(s)
    assert s.pool.num_free < s.pool.num_blocks
    s.finish(a, FinishReason.ABORT)
    assert s.pool.num_free == s.pool.num_blocks and not s.has_work()
    s.finish(a, FinishReason.ABORT)  # idempotent


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2)
    seqs = [make_seq([1, 2, 3]) for _ in range(3)]
    for q in seqs:
        s.add(q)
    plan, _ = run_step(s)
    assert len(plan.entries) == 2 and len(s.waiting) == 1


def _run_ahead(s, steps, next_token=lambda seq: 7):
    """Drive `s` as the asynchronous engine loop does: plan N+1 with schedule_ahead before applying plan N.
    Returns how many steps were planned ahead."""
    plan, ahead_count = s.schedule(), 0
    for _ in range(steps):
        if not plan.entries:
            break
        ahead = s.schedule_ahead(plan)
        s.update(plan, {e.seq.seq_id: next_token(e.seq) for e in plan.entries if e.sample})
        if ahead is None:
            plan = s.schedule()
        else:
            ahead_count += 1
            plan = ahead
    return ahead_count


def test_schedule_ahead_matches_the_synchronous_loop():
    # same tokens, finish reasons and free blocks as schedule/update; EOS at a different step per sequence
    def tok(seq):
        return 0 if len(seq.output_ids) == len(seq.prompt_ids) - 3 else 5 + len(seq.output_ids)

    results = []
    for ahead in (False, True):
        s = make_scheduler(block_size=4, eos=(0,))
        seqs = [make_seq(range(1, 6 + i), max_tokens=9) for i in range(4)]
        for seq in seqs:
            s.add(seq)
        if ahead:
            assert _run_ahead(s, 40, tok) > 0
        else:
            for _ in range(40):
                run_step(s, tok)
        assert not s.has_work() and s.pool.num_free == s.pool.num_blocks
        s.pool.check_invariants()
        results.append([(seq.output_ids, seq.finish_reason) for seq in seqs])
    assert results[0] == results[1]


def test_schedule_ahead_plans_the_next_decode_and_its_block():
    s = make_scheduler(block_size=4)
    a = make_seq([1, 2, 3], max_tokens=5)
    s.add(a)
    plan = s.schedule()  # prefill of 3 tokens, samples position 3
    ahead = s.schedule_ahead(plan)  # a prompt's last chunk samples: its first decode can be planned ahead
    assert [(e.seq, e.start, e.num_new, e.sample) for e in ahead.entries] == [(a, 3, 1, True)]
    s.update(plan, {a.seq_id: 7})
    plan = ahead
    assert len(a.block_ids) == 1
    ahead = s.schedule_ahead(plan)
    assert [(e.seq, e.start, e.num_new, e.sample) for e in ahead.entries] == [(a, 4, 1, True)]
    assert len(a.block_ids) == 2  # position 4 opens the second block before position 3's token is known
    s.update(plan, {a.seq_id: 8})
    s.update(ahead, {a.seq_id: 9})
    assert a.output_ids == [7, 8, 9] and a.num_computed_tokens == 5
    # a chunk that does not sample (the prompt goes on) has no token to feed
    s2 = make_scheduler(block_size=4, max_num_batched_tokens=4)
    s2.add(make_seq(range(1, 10)))
    assert s2.schedule_ahead(s2.schedule()) is None


def _decoding(s, prompt, max_tokens=10):
    """A sequence added to scheduler `s` and prefilled (token 7 sampled), and the plan of its first decode."""
    seq = make_seq(prompt, max_tokens=max_tokens)
    s.add(seq)
    run_step(s)
    return seq, s.schedule()


def test_schedule_ahead_declines_when_schedule_would_differ():
    s = make_scheduler(block_size=4, max_num_seqs=2, max_model_len=8)
    a, plan = _decoding(s, [1, 2, 3])
    s.add(make_seq([4, 5]))  # a waiting request and a free slot: the next step admits it
    assert s.schedule_ahead(plan) is None
    s.update(plan, {a.seq_id: 7})
    run_step(s)  # both run now; max_num_seqs reached
    s.add(make_seq([6]))
    plan = s.schedule()
    assert s.schedule_ahead(plan) is not None  # the waiting one cannot be admitted anyway
    # the step ahead of a sequence's last position runs (its token is dropped): LENGTH as in the synchronous loop
    s2 = make_scheduler(block_size=4, max_model_len=5)
    b, plan = _decoding(s2, [1, 2, 3])
    ahead = s2.schedule_ahead(plan)
    assert [e.start for e in ahead.entries] == [4]
    s2.update(plan, {b.seq_id: 7})
    assert b.finish_reason is FinishReason.LENGTH and s2.pool.num_free == s2.pool.num_blocks
    assert s2.update(ahead, {b.seq_id: 8}) == [] and b.output_ids == [7, 7]


def test_schedule_ahead_never_preempts():
    s = make_scheduler(num_blocks=2, block_size=4)
    a, plan = _decoding(s, [1, 2, 3, 4, 5, 6, 7])  # 2 blocks after prefill, position 8 needs a third
    assert [(e.start, e.num_new) for e in plan.entries] == [(7, 1)]
    assert s.schedule_ahead(plan) is None and s.num_preemptions == 0 and len(a.block_ids) == 2


def test_schedule_ahead_admits_whole_prompts_after_the_fed_decodes():
    s = make_scheduler(block_size=4, max_num_batched_tokens=16, ahead_prefill_tokens=6)
    a, plan = _decoding(s, [1, 2, 3])
    b, c = make_seq([4, 5, 6, 7, 8]), make_seq([9, 10])
    s.add(b)
    s.add(c)
    ahead = s.schedule_ahead(plan)  # b (5 tokens) fits the 6 prompt tokens allowed; c would make 7: it waits
    assert [(e.seq, e.start, e.num_new, e.sample) for e in ahead.entries] == [(a, 4, 1, True), (b, 0, 5, True)]
    assert list(s.waiting) == [c] and s.running == [a, b] and len(b.block_ids) == 2
    s.update(plan, {a.seq_id: 7})
    ahead2 = s.schedule_ahead(ahead)
    assert [(e.seq, e.start, e.num_new) for e in ahead2.entries] == [(a, 5, 1), (b, 5, 1), (c, 0, 2)]
    s.update(ahead, {a.seq_id: 7, b.seq_id: 7})
    s.update(ahead2, {a.seq_id: 7, b.seq_id: 7, c.seq_id: 7})
    assert [len(q.output_ids) for q in (a, b, c)] == [4, 2, 1]


def test_schedule_ahead_leaves_to_schedule_what_it_cannot_admit():
    def ahead_with(waiting, **kw):
        s = make_scheduler(block_size=4, max_num_batched_tokens=16, ahead_prefill_tokens=6, **kw)
        _, plan = _decoding(s, [1, 2, 3])
        s.add(waiting)
        return s, s.schedule_ahead(plan)

    s, ahead = ahead_with(make_seq(range(1, 9)))  # 8 prompt tokens > 6: schedule() chunks or admits it
    assert ahead is None and s.pool.num_free == s.pool.num_blocks - 1 - 1  # a's block and its next one
    _, ahead = ahead_with(make_seq([4, 5], temperature=0.5), ahead_admissible=lambda seq: seq.params.is_greedy)
    assert ahead is None  # the runner cannot sample it on the device
    s, ahead = ahead_with(make_seq([4, 5]), num_blocks=2)  # no free block for it: schedule() could not admit it
    assert [e.num_new for e in ahead.entries] == [1] and len(s.waiting) == 1 and s.pool.num_free == 0
    s.pool.check_invariants()


def test_schedule_ahead_drops_a_sequence_that_finished_meanwhile():
    s = make_scheduler(block_size=4, max_num_batched_tokens=16, ahead_prefill_tokens=8, max_num_seqs=2)
    a, b = make_seq([1, 2, 3], max_tokens=2), make_seq([4, 5, 6], max_tokens=9)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    ahead = s.schedule_ahead(plan)
    s.update(plan, {a.seq_id: 7, b.seq_id: 7})
    c = make_seq([8, 9])
    s.add(c)  # waits: a still holds its slot until its second token is applied
    ahead2 = s.schedule_ahead(ahead)
    assert [e.seq for e in ahead2.entries] == [a, b] and list(s.waiting) == [c]
    s.update(ahead, {a.seq_id: 7, b.seq_id: 7})
    assert a.finish_reason is FinishReason.LENGTH and a.block_ids == []
    # a computes ahead2 but is done: the step after it goes on with b, and c takes a's slot
    ahead3 = s.schedule_ahead(ahead2)
    assert [(e.seq, e.num_new) for e in ahead3.entries] == [(b, 1), (c, 2)]
    assert s.update(ahead2, {a.seq_id: 7, b.seq_id: 7}) == [b]
    s.update(ahead3, {b.seq_id: 7, c.seq_id: 7})
    assert len(b.output_ids) == 4 and c.output_ids == [7]
    s.pool.check_invariants()


class _GrammarFailingAt:
    """A `GrammarState` stand-in whose llguidance fails on its `n`-th token (a resource limit mid-output)."""

    def __init__(self, n: int):
        self.n, self.done, self.error = n, False, None

    def accept(self, token: int) -> None:
        self.n -= 1
        if self.n == 0:
            self.error = "lexer error: too many expressions constructed"


def test_a_grammar_error_fails_the_sequence_and_frees_its_blocks():
    """Not a stop: finish_reason ABORT with `error` set (the actor fails the request), blocks back in the pool."""
    s = make_scheduler()
    a, b = make_seq(range(1, 10), max_tokens=20), make_seq(range(1, 10), max_tokens=20)
    a.grammar = _GrammarFailingAt(2)
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.finish_reason is None and a.error is None
    _, touched = run_step(s)
    assert a in touched and (a.finish_reason, a.error) == (FinishReason.ABORT, a.grammar.error)
    assert b.finish_reason is None and s.running == [b]
    s.finish(b, FinishReason.ABORT)
    assert s.pool.num_free == s.pool.num_blocks
