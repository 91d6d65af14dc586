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
    fast = PackedStepInputs(4, 4, 8, 16, pin=False)
    fast.fill_from_plan(plan.entries)
    step = ModelRunner(None, _HostBackend(), torch.zeros(1, 2, 64, 16, 1, 8), (2,), seed=0).prepare(plan)
    assert fast.ids[:3].tolist() == [101, 102, 103]
    assert fast.positions[:3].tolist() == [5, 17, 33]
    assert fast.seq_lens[:3].tolist() == [6, 18, 34]
    assert fast.longest == 34 and fast.decode_splits.tolist() == [0]  # the word is StepGraphs.fill's
    assert fast.slots[:3].tolist() == [5, 2 * 16 + 1, 5 * 16 + 1]  # block ids 0 | 1, 2 | 3, 4, 5
    ref = {"ids": step.input_ids, "positions": step.positions, "slots": step.attn.slot_mapping,
           "seq_lens": step.attn.seq_lens}
    for name, want in ref.items():
        assert getattr(fast, name)[:3].tolist() == want.tolist(), name
    for i, e in enumerate(plan.entries):  # past a sequence's blocks the two may differ: those entries are unread
        width = len(e.seq.block_ids)
        assert fast.tables[i, :width].tolist() == step.attn.block_tables[i, :width].tolist() == e.seq.block_ids


def test_pad_and_words():
    host = PackedStepInputs(4, 4, 8, 16, pin=False)
    host.fill_from_plan(_decode_plan((20, 3)).entries)
    host.pad(2, 4)
    assert host.slots.tolist()[2:] == [-1, -1] and host.seq_lens.tolist()[2:] == [1, 1]
    assert host.tables[2:, 0].tolist() == [0, 0]
    # ids/positions/slots (2 words each) of 4 tokens, logits rows (2 words), lens and 5 query starts of 4
    # sequences, the decode attention's split count, then 2 tables
    assert host.words(2) == 6 * 4 + 4 * 4 + 1 + 1 + 2 * 8
    assert host.longest == 21
    assert host.query_start.tolist() == [0, 1, 2, 3, 4] and host.logits_rows.tolist() == [0, 1, 2, 3]
    assert host.buffer.dtype == torch.int32 and host.buffer.numel() == host.words(4)


def _mixed_plan():
    """Two sequences decoding (prompts of 5 and 17 tokens, one token sampled), then a new 20-token prompt and a
    9-token one whose first 6 tokens are computed already (a chunk in progress)."""
    sched = Scheduler(BlockPool(64, 16), 8, 512, 512, (2,))
    a, b = (Sequence(i, f"r{i}", 0, list(range(10, 10 + n)), SamplingParams(temperature=0), 8)
            for i, n in enumerate((5, 17)))
    for seq in (a, b):
        sched.add(seq)
    plan = sched.schedule()
    sched.update(plan, {0: 101, 1: 102})
    c = Sequence(2, "r2", 0, list(range(200, 220)), SamplingParams(temperature=0), 8)
    d = Sequence(3, "r3", 0, list(range(300, 309)), SamplingParams(temperature=0), 8)
    sched.add(c)
    sched.add(d)
    plan = sched.schedule()
    return plan


def test_fill_mixed_equals_prepare():
    plan = _mixed_plan()
    assert [(e.start, e.num_new) for e in plan.entries] == [(5, 1), (17, 1), (0, 20), (0, 9)]
    host = PackedStepInputs(2 * 4 + 32, 4, 8, 16, pin=False)
    fed = PackedStepInputs(2 * 4 + 32, 4, 8, 16, pin=False)
    assert host.fill_mixed(plan.entries) == 31
    assert fed.fill_mixed(plan.entries, fed=2) == 31
    step = ModelRunner(None, _HostBackend(), torch.zeros(1, 2, 64, 16, 1, 8), (2,), seed=0).prepare(plan)
    assert host.ids[:31].tolist() == step.input_ids.tolist()
    assert fed.ids[:2].tolist() == [0, 0] and fed.ids[2:31].tolist() == step.input_ids[2:].tolist()
    assert host.positions[:31].tolist() == step.positions.tolist()
    assert host.slots[:31].tolist() == step.attn.slot_mapping.tolist()
    assert host.seq_lens[:4].tolist() == step.attn.seq_lens.tolist() == [6, 18, 20, 9]
    assert host.longest == 20
    assert host.query_start[:5].tolist() == step.attn.query_start_loc.tolist() == [0, 1, 2, 22, 31]
    assert host.logits_rows[:4].tolist() == step.logits_indices.tolist() == [0, 1, 21, 30]
    for i, e in enumerate(plan.entries):
        assert host.tables[i, :len(e.seq.block_ids)].tolist() == e.seq.block_ids
    host.pad_mixed(4, 4, 31, 40)
    assert host.slots[31:40].tolist() == [-1] * 9 and host.query_start[:5].tolist() == [0, 1, 2, 22, 31]
    host.pad_mixed(2, 4, 2, 40)  # the decodes alone in a graph of 4 sequences: two padded ones, a token each
    assert host.query_start[:5].tolist() == [0, 1, 2, 3, 4] and host.seq_lens[2:4].tolist() == [1, 1]
    assert host.logits_rows[2:4].tolist() == [2, 3] and host.tables[2:4, 0].tolist() == [0, 0]
    assert host.slots[2:40].tolist() == [-1] * 38


def test_plan_key_picks_the_smallest_graph():
    from voltserve.graphs import GraphKey, StepGraphs

    class _Backend:
        device = torch.device("cpu")

    g = StepGraphs(None, _Backend(), torch.zeros(1, 2, 64, 16, 1, 8), 4, 512, prefill_tokens=(8, 64))
    assert g.plan_key(_mixed_plan().entries) is None  # not captured
    g._graphs = dict.fromkeys(g.keys())
    assert g.keys()[0] == GraphKey(4, 64) and g.keys()[-1] == GraphKey(1) and len(g.keys()) == 3 * 2 + 3
    plan = _mixed_plan()
    assert g.plan_key(plan.entries) == GraphKey(4, 64)  # 31 tokens, the longest 20
    ent = type(plan.entries[0])
    c, d = plan.entries[2].seq, plan.entries[3].seq
    assert g.plan_key(plan.entries[:1] + [ent(c, 0, 5, True), ent(d, 0, 5, True)]) == GraphKey(4, 8)
    assert g.plan_key(plan.entries[:1] + [ent(c, 0, 6, True), ent(d, 0, 5, True)]) == \
        GraphKey(4, 64)  # 9 tokens beyond one per sequence
    assert g.plan_key(plan.entries[:2]) == GraphKey(2)
    assert g.plan_key(plan.entries[3:]) == GraphKey(1, 64)  # 9 tokens > 8
    assert g.plan_key(plan.entries[:1] + plan.entries[3:]) == GraphKey(2, 64)
    e = plan.entries[2]
    assert g.plan_key([type(e)(e.seq, 0, 65, True)]) is None  # longer than the largest P: eager
    assert g.plan_key([plan.entries[0]] * 5) is None  # more sequences than the largest bucket
    assert GraphKey(4, 64).tokens == 68 and GraphKey(4).tokens == 4


class _PlanningBackend:
    """A backend that plans its decode attention per step (as CudaBackend.graph_decode_splits does)."""

    device = torch.device("cpu")

    def __init__(self):
        self.asked = []

    def graph_decode_splits(self, capacity, num_seqs, longest):
        self.asked.append((capacity, num_seqs, longest))
        return 3 + longest


def test_fill_writes_the_backends_split_plan():
    """StepGraphs.fill puts the backend's split count for (capacity, graph sequences, longest context) in the
    word `AttentionMetadata.decode_splits` reads; a backend without a planner leaves 0 (the grid's splits)."""
    from voltserve.graphs import GraphKey, StepGraphs

    backend = _PlanningBackend()
    graphs = StepGraphs(None, backend, torch.zeros(1, 2, 64, 16, 1, 8), 4, 8192, (64,))
    graphs.fill(GraphKey(4), _decode_plan((5, 17, 33)).entries)
    assert graphs._decode.writable().decode_splits.tolist() == [3 + 34]
    graphs.fill(GraphKey(4, 64), _mixed_plan().entries)
    assert graphs._mixed.writable().decode_splits.tolist() == [3 + 20]
    assert backend.asked == [(8192, 4, 34), (8192, 4, 20)]
    step = graphs._decode.static_step(GraphKey(4), 8192)
    assert step.attn.decode_splits is graphs._decode.decode_splits and step.attn.max_seq_len == 8192
    plain = StepGraphs(None, _HostBackend(), torch.zeros(1, 2, 64, 16, 1, 8), 4, 8192)
    plain.fill(GraphKey(4), _decode_plan((5,)).entries)
    assert plain._decode.writable().decode_splits.tolist() == [0]


def _verify_entries():
    """The decode plan of two sequences (prompts of 5 and 17 tokens), the first verifying 3 drafts."""
    plan = _decode_plan((5, 17))
    first = plan.entries[0]
    return [type(first)(first.seq, first.start, 4, True, drafts=(7, 8, 9))] + plan.entries[1:]


def test_verify_steps_run_rows_as_decodes():
    """A verify step's metadata asks for its rows as decodes (AttentionMetadata.rows_as_decodes): the verify
    graph's static step, and an eager verify step unless a longer prompt chunk rides along; the verify graph's
    split plan is asked for its token slots (one attention unit each), not its sequences."""
    from voltserve.backends.base import ROWS_AS_DECODES_MAX_QUERY
    from voltserve.graphs import GraphKey, StepGraphs
    from voltserve.scheduler import StepPlan

    backend = _PlanningBackend()
    graphs = StepGraphs(None, backend, torch.zeros(1, 2, 64, 16, 1, 8), 4, 8192, (64,), verify_width=lambda b: 4)
    graphs._graphs = dict.fromkeys(graphs.keys())  # as if captured
    key = graphs.verify_key(_verify_entries())
    assert key == GraphKey(2, 9, True) and key.tokens == 11
    graphs.fill(key, _verify_entries())
    assert backend.asked == [(8192, 11, 18)]  # units: 11 token slots; the longest context 17 + 1
    assert graphs._verify.static_step(key, 8192).attn.rows_as_decodes
    assert not graphs._mixed.static_step(GraphKey(4, 64), 8192).attn.rows_as_decodes
    runner = ModelRunner(None, _HostBackend(), torch.zeros(1, 2, 64, 16, 1, 8), (2,), seed=0)
    assert runner.prepare(StepPlan(_verify_entries(), has_drafts=True)).attn.rows_as_decodes
    assert not runner.prepare(_mixed_plan()).attn.rows_as_decodes  # no drafts
    prompt = _mixed_plan().entries[2]
    long_chunk = type(prompt)(prompt.seq, 0, ROWS_AS_DECODES_MAX_QUERY + 1, False)
    assert not runner.prepare(StepPlan(_verify_entries() + [long_chunk], has_drafts=True)).attn.rows_as_decodes
