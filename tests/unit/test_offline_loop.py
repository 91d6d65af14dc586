"""voltserve.offline.run_steps with asynchronous scheduling, against a fake runner whose 'model' makes each token
from the input id it is given: a step planned ahead must receive the previous step's sampled ids (fed on the
'device'), and the outputs must equal the synchronous loop's."""

from tests.helpers import FakeAsyncRunner, make_scheduler, make_seq, next_token

from voltserve.offline import run_steps
from voltserve.request import FinishReason


def _run(pipelined: bool, max_steps=None, mixed=False):
    s = make_scheduler(block_size=4, eos=(0,), max_num_batched_tokens=16, ahead_prefill_tokens=8 if mixed else 0)
    seqs = [make_seq(range(1, 3 + 2 * i), max_tokens=6 + i) for i in range(6)]
    for seq in seqs[:3]:
        s.add(seq)
    runner = FakeAsyncRunner(eos_at={4: 3}, mixed=mixed)  # the prompt of length 4 samples EOS as its 4th token
    steps = run_steps(s, runner, max_steps=3, pipelined=pipelined)
    # late arrivals: the loop falls back to schedule() to admit them, or (mixed) admits them into steps planned
    # ahead; the 11-token prompt is longer than ahead_prefill_tokens: schedule() admits it
    for seq in seqs[3:]:
        s.add(seq)
    steps += run_steps(s, runner, max_steps=max_steps, pipelined=pipelined)
    assert not s.has_work() and s.pool.num_free == s.pool.num_blocks
    s.pool.check_invariants()
    return [(seq.output_ids, seq.finish_reason) for seq in seqs], steps, runner


def test_pipelined_loop_equals_synchronous_loop():
    sync, sync_steps, sync_runner = _run(False)
    ahead, ahead_steps, runner = _run(True)
    assert sync_runner.fed == 0 and runner.fed >= 5 and runner.fed_with_prefill == 0
    assert runner.fed_after_finish >= 1  # a sequence finished (EOS, length) and the others went on fed
    assert ahead == sync
    t1 = next_token(4, 3)  # prompt [1, 2, 3, 4]: the prefill samples from id 4 at position 3
    t2 = next_token(t1, 4)
    assert sync[1] == ([t1, t2, next_token(t2, 5), 0], FinishReason.STOP)
    assert all(r is FinishReason.LENGTH for _, r in sync[:1] + sync[2:])
    assert ahead_steps >= sync_steps  # a finished sequence may cost one step ahead


def test_max_steps_counts_steps_planned_ahead():
    s = make_scheduler(block_size=4)
    seq = make_seq([1, 2, 3], max_tokens=50)
    s.add(seq)
    runner = FakeAsyncRunner()
    updates = []
    assert run_steps(s, runner, max_steps=7, pipelined=True, on_update=lambda t, lps: updates.append(t)) == 7
    assert len(seq.output_ids) == 7 and runner.fed == 5  # prefill, one plain decode, then 5 fed
    assert updates == [[seq]] * 7  # one call per applied step, the step in flight at max_steps included


def test_steps_planned_ahead_admit_new_sequences_like_the_synchronous_loop():
    def run(pipelined):
        s = make_scheduler(block_size=4, eos=(0,), max_num_batched_tokens=16, ahead_prefill_tokens=8)
        seqs = [make_seq(range(1, 3 + 2 * i), max_tokens=6 + i) for i in range(6)]
        s.add(seqs[0])
        runner = FakeAsyncRunner(eos_at={4: 3}, mixed=True)
        updates = [0]

        def arrive(touched, lps):  # one arrival every other step, while steps run ahead
            updates[0] += 1
            if updates[0] % 2 == 0 and updates[0] // 2 < len(seqs):
                s.add(seqs[updates[0] // 2])

        run_steps(s, runner, pipelined=pipelined, on_update=arrive)
        assert not s.has_work() and s.pool.num_free == s.pool.num_blocks
        s.pool.check_invariants()
        return [(seq.output_ids, seq.finish_reason) for seq in seqs], runner

    sync, _ = run(False)
    ahead, runner = run(True)
    assert ahead == sync == _run(False)[0]
    # prompts of <= 8 tokens started in fed steps, next to the decodes; the 10- and 12-token ones in schedule()
    assert runner.fed_with_prefill >= 2
