"""PackedStepInputs (the host side of the decode graphs' inputs): filled straight from the scheduler's entries,
it holds what the StepInputs path (ModelRunner.prepare) builds for the same step."""

import torch

from voltserve.graphs import PackedStepInputs
from voltserve.kv_cache import BlockPool
from voltserve.request import SamplingParams
from voltserve.runner import ModelRunner
from voltserve.scheduler import Scheduler
from voltserve.sequence import Sequence


class _HostBackend:
    device = torch.device("cpu")


def _decode_plan(prompt_lens):
    """A scheduler past the prefill of len(prompt_lens) sequences (tokens 101, 102, ...), and its decode plan."""
    sched = Scheduler(BlockPool(64, 16), 8, 512, 512, (2,))
    for i, n in enumerate(prompt_lens):
        sched.add(Sequence(i, f"r{i}", 0, list(range(10, 10 + n)), SamplingParams(temperature=0), 8))
    plan = sched.schedule()
    sched.update(plan, {i: 101 + i for i in range(len(prompt_lens))})
    return sched.schedule()


def test_fill_from_plan_equals_prepare():
    plan = _decode_plan((5, 17, 33))  # 1, 2 and 3 KV blocks; decode positions 5, 17, 33
    assert all(e.num_new == 1 and e.sample for e in plan.entries)
    fast = PackedStepInputs(4, 8, 16, pin=False)
    fast.fill_from_plan(plan.entries)
    step = ModelRunner(None, _HostBackend(), torch.zeros(1, 2, 64, 16, 1, 8), (2,), seed=0).prepare(plan)
    assert fast.ids[:3].tolist() == [101, 102, 103]
    assert fast.positions[:3].tolist() == [5, 17, 33]
    assert fast.seq_lens[:3].tolist() == [6, 18, 34]
    assert fast.slots[:3].tolist() == [5, 2 * 16 + 1, 5 * 16 + 1]  # block ids 0 | 1, 2 | 3, 4, 5
    ref = {"ids": step.input_ids, "positions": step.positions, "slots": step.attn.slot_mapping,
           "seq_lens": step.attn.seq_lens}
    for name, want in ref.items():
        assert getattr(fast, name)[:3].tolist() == want.tolist(), name
    for i, e in enumerate(plan.entries):  # past a sequence's blocks the two may differ: those entries are unread
        width = len(e.seq.block_ids)
        assert fast.tables[i, :width].tolist() == step.attn.block_tables[i, :width].tolist() == e.seq.block_ids


def test_pad_and_words():
    host = PackedStepInputs(4, 8, 16, pin=False)
    host.fill_from_plan(_decode_plan((20, 3)).entries)
    host.pad(2, 4)
    assert host.slots.tolist()[2:] == [-1, -1] and host.seq_lens.tolist()[2:] == [1, 1]
    assert host.tables[2:, 0].tolist() == [0, 0]
    assert host.words(2) == 7 * 4 + 2 * 8  # ids/positions/slots (2 words each) + lens for 4 rows, then 2 tables
    assert host.buffer.dtype == torch.int32 and host.buffer.numel() == host.words(4)
