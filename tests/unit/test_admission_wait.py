"""Scheduler(admission_wait_steps=): new requests wait a few steps so that they start together in one mixed step
instead of one mixed step each, never longer than the bound, and never when starting costs no mixed step."""

from tests.helpers import make_scheduler, make_seq, run_step


def _kinds(plan):
    """(sequences decoding, sequences starting) of a plan."""
    return (sum(e.num_new == 1 for e in plan.entries), sum(e.num_new > 1 for e in plan.entries))


def _one_running(wait, **kw):
    s = make_scheduler(admission_wait_steps=wait, **kw)
    a = make_seq([1, 2, 3], max_tokens=50)
    s.add(a)
    plan, _ = run_step(s)  # nothing runs yet: it starts at once
    assert _kinds(plan) == (0, 1)
    return s, a


def test_without_a_wait_each_request_starts_in_the_next_step():
    s, _ = _one_running(0)
    s.add(make_seq([4, 5, 6]))
    plan, _ = run_step(s)
    assert _kinds(plan) == (1, 1)


def test_requests_arriving_within_the_wait_start_together():
    s, a = _one_running(3)
    b, c = make_seq([4, 5, 6]), make_seq([7, 8, 9])
    s.add(b)
    kinds = []
    for i in range(4):
        if i == 1:
            s.add(c)  # one step after b
        plan, _ = run_step(s)
        kinds.append(_kinds(plan))
    # b waits 3 plans (decode-only steps of a), then b and c start in one mixed step; c waited 2
    assert kinds == [(1, 0), (1, 0), (1, 0), (1, 2)]
    assert [e.seq for e in plan.entries] == [a, b, c]
    assert s.waiting == type(s.waiting)()


def test_no_wait_when_nothing_runs_or_the_step_is_mixed_already():
    s = make_scheduler(admission_wait_steps=5, max_num_batched_tokens=4)
    a = make_seq(range(1, 11), max_tokens=5)  # a 10-token prompt in chunks of 4
    s.add(a)
    plan, _ = run_step(s)
    assert [(e.seq, e.num_new) for e in plan.entries] == [(a, 4)]  # nothing ran: no wait
    b = make_seq([4])
    s.add(b)
    plan, _ = run_step(s)
    # a's next chunk makes the step mixed: b starts in it (the budget left: 0 tokens, so it waits for room)
    assert [(e.seq, e.num_new) for e in plan.entries] == [(a, 4)]
    plan, _ = run_step(s)
    assert [(e.seq, e.num_new) for e in plan.entries] == [(a, 2), (b, 1)]


def test_a_preempted_sequence_does_not_wait():
    s = make_scheduler(admission_wait_steps=4, num_blocks=4, block_size=4)
    a, b = make_seq([1, 2, 3], max_tokens=12), make_seq([4, 5, 6], max_tokens=12)
    s.add(a)
    s.add(b)
    run_step(s)  # both start (nothing ran before): a block each
    while not s.num_preemptions:
        run_step(s)
    assert s.waiting[0] is b and s.running == [a]  # the pool ran short: b went back to the head of the queue
    # a decodes alone, yet b is not held back: it was no new arrival (it starts as soon as blocks allow)
    assert not s._holds_back([e for e in s.schedule().entries])


def test_an_aborted_waiting_request_leaves_no_trace():
    s, _ = _one_running(3)
    b = make_seq([4, 5, 6])
    s.add(b)
    run_step(s)
    from voltserve.request import FinishReason
    s.finish(b, FinishReason.ABORT)
    assert not s._added_at and not s.waiting


def test_schedule_ahead_waits_as_schedule_does():
    s, a = _one_running(2, ahead_prefill_tokens=64)
    b = make_seq([4, 5, 6])
    s.add(b)
    plan = s.schedule()  # plan 1 since b came: decode-only
    assert _kinds(plan) == (1, 0)
    ahead = s.schedule_ahead(plan)  # plan 2: b has waited 1 < 2 plans: still decode-only, planned ahead
    assert ahead is not None and _kinds(ahead) == (1, 0)
    s.update(plan, {a.seq_id: 7})
    ahead2 = s.schedule_ahead(ahead)  # plan 3: b has waited 2: it starts in the step planned ahead
    assert ahead2 is not None and [(e.seq, e.num_new) for e in ahead2.entries] == [(a, 1), (b, 3)]


def test_a_start_that_keeps_the_step_decode_only_does_not_wait():
    """A one-token prompt (or one cached but its last token) starts as one more decode row: no mixed step."""
    s, a = _one_running(4)
    b = make_seq([4])
    s.add(b)
    plan, _ = run_step(s)
    assert [(e.seq, e.num_new) for e in plan.entries] == [(a, 1), (b, 1)]


def test_schedule_ahead_does_not_hold_for_sequences_about_to_finish():
    """If every running sequence ends with the current step's token (max_tokens), schedule() would start the
    head at once: the step planned ahead starts it too instead of holding it behind finished sequences."""
    s = make_scheduler(admission_wait_steps=4, ahead_prefill_tokens=64)
    a = make_seq([1, 2, 3], max_tokens=2)
    s.add(a)
    run_step(s)  # a's prefill samples its first token
    plan = s.schedule()  # a's last token
    b = make_seq([4, 5, 6])
    s.add(b)
    ahead = s.schedule_ahead(plan)
    s.update(plan, {a.seq_id: 7})
    assert a.finish_reason is not None
    assert ahead is not None and [(e.seq, e.num_new) for e in ahead.entries] == [(a, 1), (b, 3)]
