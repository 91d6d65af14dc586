"""Sampled verification through per-row draft checks (`CudaBackend.sample_verify`'s contract), on the CPU: the
host's reading of the checks (`accept_checked`) and the runner's bookkeeping around the one launch (which logits
rows, which drafts and Philox counters go up, how the tokens come back), with a stand-in backend that records
its call and answers fixed checks; also the device sampler's rows of a plain step and `_take_rows`. The kernel
itself is tested on the GPU (tests/kernels/test_sampling.py)."""

from __future__ import annotations

import torch

from voltserve.request import SamplingParams
from voltserve.runner import ModelRunner
from voltserve.scheduler import ScheduledSeq, StepPlan
from voltserve.sequence import Sequence
from voltserve.spec.verify import accept_checked

VOCAB = 50


def test_accept_checked_emits_drafts_up_to_the_first_failing_row():
    tokens = [40, 41, 42, 43]  # each row's token from its residual; the last row's from its distribution
    assert accept_checked([5, 6, 7], [1, 1, 1], tokens) == [5, 6, 7, 43]  # all pass: the last row's token too
    assert accept_checked([5, 6, 7], [1, 0, 1], tokens) == [5, 41]  # a pass after a failure does not count
    assert accept_checked([5, 6, 7], [0, 1, 1], tokens) == [40]
    assert accept_checked([], [], [40]) == [40]


class _CheckingBackend:
    """Stands in for CudaBackend.sample_verify: records its call; row i's token is 100 + i and its draft passes
    where `passes[i]` is 1."""

    def __init__(self, passes: list[int]):
        self.passes = passes
        self.calls = []

    def sample_verify(self, logits, params_rows):
        """Records (logits, rows); answers [2, rows] int64: tokens 100 + i, checks `passes`."""
        self.calls.append((logits.clone(), list(params_rows)))
        n = logits.shape[0]
        return torch.tensor([[100 + i for i in range(n)], self.passes[:n]], dtype=torch.int64)


def _runner(backend, logits):
    runner = ModelRunner(None, backend, torch.zeros(1, 2, 8, 16, 1, 8), (), seed=0)
    runner.prepare = lambda plan: None
    runner.forward = lambda step: logits
    return runner


def _seq(i, params, offset):
    seq = Sequence(i, f"r{i}", 0, [1, 2, 3], params, 32, philox_seed=1000 + i)
    seq.philox_offset = offset
    return seq


def test_runner_checks_every_drafted_span_in_one_launch():
    """A step of a sampled span of 2 drafts, a plain sampled sequence, a greedy span of 1 draft and a plain one
    that wants logprobs: the spans' rows, then the first plain sequence's row (it rides along: draft -1), go to
    one sample_verify call with their drafts, -1 on each span's last row, Philox counters philox_offset + i and
    temperature 0 for the greedy span; each span's tokens follow its checks, the rider gets its row's token, and
    each Philox offset moves past its rows. The logprobs sequence is sampled apart (`_sample`, with logprobs)."""
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(0))
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05)
    a, b = _seq(0, sampled, 7), _seq(1, SamplingParams(temperature=0.5), 3)
    c, d = _seq(2, SamplingParams(temperature=0), 0), _seq(3, SamplingParams(temperature=0.7, logprobs=2), 5)
    # rows: a -> 0, 1, 2; b -> 3; c -> 4, 5; d -> 6
    plan = StepPlan([ScheduledSeq(a, 3, 3, True, (11, 12)), ScheduledSeq(b, 3, 1, True),
                     ScheduledSeq(c, 3, 2, True, (13,)), ScheduledSeq(d, 3, 1, True)], has_drafts=True)
    backend = _CheckingBackend(passes=[1, 0, 0, 1, 0, 0])  # a: first passes, second fails; c: its draft passes
    tokens, lps = _runner(backend, logits).execute(plan)
    assert len(backend.calls) == 1
    got_logits, rows = backend.calls[0]
    assert torch.equal(got_logits, logits[[0, 1, 2, 4, 5, 3]])
    assert [r.draft for r in rows] == [11, 12, -1, 13, -1, -1]
    assert [r.offset for r in rows] == [7, 8, 9, 0, 1, 3]
    assert [r.seed for r in rows] == [1000] * 3 + [1002] * 2 + [1001]
    assert [round(r.temperature, 6) for r in rows] == [0.8] * 3 + [0.0] * 2 + [0.5]
    assert (rows[0].top_k, round(rows[0].top_p, 6), round(rows[0].min_p, 6), rows[0].num_logprobs) == (20, 0.9,
                                                                                                      0.05, 0)
    assert tokens[0] == [11, 101]  # the row after the first failing check gives its own token
    assert tokens[2] == [13, 104]  # every draft passed: the last row's token
    assert tokens[1] == 105  # the rider: its row's token
    assert isinstance(tokens[3], int) and 0 <= tokens[3] < VOCAB and set(lps) == {3}  # sampled on the host
    assert (a.philox_offset, b.philox_offset, c.philox_offset, d.philox_offset) == (10, 4, 2, 6)


def test_take_rows_gives_views_of_consecutive_rows_and_gathers_others():
    from voltserve.runner import _take_rows

    t, u = torch.arange(20).view(10, 2), torch.arange(10)
    view, view_u = _take_rows(t, [3, 4, 5], u)
    assert view.data_ptr() == t[3].data_ptr() and view.tolist() == [[6, 7], [8, 9], [10, 11]]
    assert view_u.tolist() == [3, 4, 5]
    assert _take_rows(t, [5, 1]).tolist() == [[10, 11], [2, 3]]
    assert _take_rows(t, []).shape == (0, 2)


def test_drafts_from_a_draft_models_distribution_keep_the_general_verify():
    """A span whose drafts came with their q (a draft model's sampled drafts) is verified by
    `verify_sampled_many`, not the point-mass checks."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    seq = _seq(0, SamplingParams(temperature=1.0), 0)
    q = tuple(torch.softmax(torch.randn(VOCAB), -1) for _ in range(2))
    plan = StepPlan([ScheduledSeq(seq, 3, 3, True, (4, 5), q)], has_drafts=True)
    backend = _CheckingBackend(passes=[1, 1, 0])
    tokens, _ = _runner(backend, logits).execute(plan)
    assert backend.calls == [] and 1 <= len(tokens[0]) <= 3


def test_device_sampler_rows_carry_each_sequences_parameters():
    """`ModelRunner._launch_device_sampler`'s rows (a plain step's device sampling): seed, the given Philox
    counter, temperature (0 when greedy), top-p / min-p / top-k (-1 -> 0), the logprobs wanted, no draft."""
    calls = []

    class Sampler:
        def sample(self, logits, params_rows):
            calls.append(list(params_rows))
            n = logits.shape[0]
            return torch.zeros(n, dtype=torch.int64), torch.zeros(n), (torch.zeros(n, 20), torch.zeros(n, 20))

    a = _seq(0, SamplingParams(temperature=0.6, top_p=0.8, min_p=0.02, top_k=-1, logprobs=3), 0)
    b = _seq(1, SamplingParams(temperature=0), 0)
    _runner(Sampler(), None)._launch_device_sampler(torch.zeros(2, VOCAB), [a, b], [5, 9])
    rows = calls[0]
    assert [(r.seed, r.offset, r.top_k, r.num_logprobs, r.draft) for r in rows] == [(1000, 5, 0, 3, -1),
                                                                                     (1001, 9, 0, 0, -1)]
    assert [round(r.temperature, 6) for r in rows] == [0.6, 0.0]
    assert (round(rows[0].top_p, 6), round(rows[0].min_p, 6)) == (0.8, 0.02)


def test_the_chunked_sampler_takes_rows_without_top_k_or_logprobs():
    """`sampling._chunk_row`, `_filtered_row` and `DeviceSampling._sample_chunks`: sample_chunks runs launches
    whose rows have no logprobs and, unless greedy, no top-k (or one >= vocab): a block a step while the rows fit
    the SMs, else a block a row; with top-p / min-p rows (sampled) at most one block an SM in all (a block a step,
    else as many as fit, at least one); VOLTSERVE_SAMPLE_CHUNKS=plain leaves launches with such rows to
    sample_topk_topp (0), off every launch."""
    from voltserve.backends.cuda.params import SampleRowParams
    from voltserve.backends.cuda.sampling import DeviceSampling, _chunk_row, _filtered_row

    def row(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, num_logprobs=0):
        return SampleRowParams(1, 0, temperature, top_p, min_p, top_k, num_logprobs, -1)

    vocab = 49152  # 6 steps
    chunkable = (row(), row(top_k=vocab), row(top_k=-1), row(0.0, 5, 0.9, 0.1), row(top_p=0.95), row(min_p=0.1))
    assert all(_chunk_row(r, vocab) for r in chunkable)
    assert not any(_chunk_row(r, vocab) for r in (row(top_k=5), row(num_logprobs=1), row(0.0, num_logprobs=1)))
    assert [_filtered_row(r) for r in chunkable] == [False, False, False, False, True, True]

    class Backend(DeviceSampling):
        sample_chunks = "auto"
        num_sms = 13
        sample_counters = torch.zeros(8)

    be = Backend()
    assert [be._sample_chunks(n, vocab) for n in (1, 8, 9, 500)] == [6, 6, 1, 1]
    assert be._sample_chunks(1, 100) == 1 and be._sample_chunks(3, 8193) == 2
    assert [be._sample_chunks(n, vocab, filtered=True) for n in (1, 2, 3, 6, 7, 500)] == [6, 6, 4, 2, 1, 1]
    be.sample_chunks = "plain"
    assert be._sample_chunks(8, vocab) == 6 and be._sample_chunks(1, vocab, filtered=True) == 0
    be.sample_chunks = "off"
    assert be._sample_chunks(1, vocab) == 0
