"""StepGraphs' host side end to end on the CPU: plan_key, fill / pad, the two pinned mirrors, the fed ids of steps
planned ahead and the admissions into them, with a "graph" that runs the CPU model on exactly the static inputs a
captured graph would read (`_CpuReplayGraphs`). Greedy tokens must equal the eager loop's: the CPU backend is
batch invariant, so padding and mixed batching change no value."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import OracleDrafter
from tools.bench_verify import KnownDrafter
from tools.make_synthetic_checkpoint import synthetic_model
from voltserve.backends.base import AttentionMetadata, StepInputs
from voltserve.backends.cpu import CpuBackend
from voltserve.graphs import StepGraphs
from voltserve.kv_cache import BlockPool
from voltserve.models.llama import LlamaModel
from voltserve.offline import run_steps
from voltserve.request import SamplingParams
from voltserve.runner import ModelRunner
from voltserve.scheduler import Scheduler
from voltserve.sequence import Sequence
from voltserve.spec.ladder import DraftLadder
from voltserve.spec.ngram import NgramDrafter

EOS = 9999  # outside the vocabulary: lengths are set by max_tokens


class _Event:
    """torch.cuda.Event stand-in: CPU work is done when it is launched."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuReplayGraphs(StepGraphs):
    """Every graph "captured" (no CUDA); a replay uploads the host mirror like the real one, then runs the model
    eagerly on the device buffer's views, as the graph's kernels would read them."""

    def capture(self) -> None:
        self._graphs = dict.fromkeys(self.keys())

    @torch.inference_mode()
    def replay(self, key, n, ids_from=None):
        inputs = self._inputs(key)
        inputs.upload(key.seqs)
        if ids_from is not None:
            inputs.input_ids[:ids_from.shape[0]].copy_(ids_from)
        b, t = key.seqs, key.tokens
        qsl = inputs.query_start[:b + 1].clone()
        query_lens = (qsl[1:] - qsl[:-1]).tolist()
        seq_lens = inputs.seq_lens[:b].clone()
        assert int(qsl[b]) <= t
        attn = AttentionMetadata(qsl, seq_lens, inputs.block_tables[:b].clone(), inputs.slot_mapping[:t].clone(),
                                 max(query_lens), int(seq_lens.max()), query_lens, seq_lens.tolist(),
                                 bool(key.prefill))
        rows = inputs.all_rows[:t] if key.verify else inputs.logits_rows[:b]  # a verify graph: every token's
        step = StepInputs(inputs.input_ids[:t].clone(), inputs.positions[:t].clone(), attn, rows.clone())
        logits = self.model.forward(step, self.kv_cache)
        self.replays[key] += 1
        rows = t if key.verify else n
        return logits[:rows], logits.argmax(-1)[:rows]


@pytest.fixture(scope="module")
def model():
    loaded = synthetic_model("tiny", seed=0)
    for name, w in loaded.tensors.items():
        if "norm" not in name:
            loaded.tensors[name] = w * 40  # sharp logits: distinct tokens, no near-ties
    return LlamaModel(loaded.config, loaded.tensors, CpuBackend())


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)


def _generate(model, mode, prompts, arrivals, max_tokens, max_seqs=4, budget=64, prefill=(8, 64), num_blocks=64,
              drafts=0, drafter=None, draft_max_pause=64, params=None):
    """Output ids per prompt; prompt i is added once `arrivals[i]` steps were applied. mode: eager (no graphs),
    sync (graphs, one step at a time) or pipelined (graphs, steps planned ahead). drafts: k of speculative decoding
    with n-gram drafts, or `drafter`'s (verify graphs for it), 0 = none. params: every request's (default:
    greedy)."""
    cfg, backend = model.config, model.backend
    kv = backend.allocate_kv_cache(cfg.num_layers, num_blocks, 4, cfg.num_kv_heads, cfg.head_dim)
    graphs = None
    if mode != "eager":
        graphs = _CpuReplayGraphs(model, backend, kv, max_seqs, 256, [min(p, budget) for p in prefill],
                                  DraftLadder(drafts).width if drafts else None)
        graphs.capture()
        graphs.ahead_launches = 0
    runner = ModelRunner(model, backend, kv, (EOS,), seed=0, graphs=graphs)
    launch, admitted_ahead = runner.launch, [0]

    def counting_launch(plan, feed=None):  # steps planned ahead, and those that also start a new sequence
        if feed is not None:
            graphs.ahead_launches += 1
            fed = {e.seq.seq_id for e in feed.plan.entries}
            admitted_ahead[0] += any(e.seq.seq_id not in fed for e in plan.entries)
        return launch(plan, feed)

    runner.launch = counting_launch
    spec = {"drafter": drafter or NgramDrafter(drafts, 1, 2), "ladder": DraftLadder(drafts),
            "draft_max_pause": draft_max_pause} if drafts else {}
    sched = Scheduler(BlockPool(num_blocks, 4), max_seqs, budget, 256, (EOS,), *runner.ahead_admission(), **spec)
    if graphs is not None:
        graphs.sched = sched  # for the tests' counters
    params = params or SamplingParams(temperature=0, ignore_eos=True)
    seqs = [Sequence(i, f"r{i}", 0, list(p), params, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    pending = sorted(zip(arrivals, range(len(seqs))))
    applied = [0]

    def arrive(*_):
        while pending and pending[0][0] <= applied[0]:
            sched.add(seqs[pending.pop(0)[1]])

    def on_update(*_):
        applied[0] += 1
        arrive()

    arrive()
    while sched.has_work() or pending:
        if not sched.has_work():  # idle until the next arrival
            on_update()
        elif mode == "pipelined":
            run_steps(sched, runner, pipelined=True, on_update=on_update)
        else:
            wanted = sched.draft_work()  # a draft model's drafts (run_steps does the same)
            if wanted:
                sched.drafter.prepare(wanted)
            plan = sched.schedule()
            sched.update(plan, runner.execute(plan)[0])
            on_update()
    sched.pool.check_invariants()
    assert sched.pool.num_free == sched.pool.num_blocks
    return [s.output_ids for s in seqs], graphs, admitted_ahead[0]


def test_a_long_prompt_alone_replays_chunks_that_sample_nothing(model):
    """A 100-token prompt under a 32-token budget: three chunks that sample nothing, each a mixed graph step of
    one sequence (whose logits rows hold no sampled row), then its last chunk; then decodes."""
    prompt = [list(range(1, 101))]
    eager, _, _ = _generate(model, "eager", prompt, [0], [6], budget=32, prefill=(8, 32))
    for mode in ("sync", "pipelined"):
        out, graphs, _ = _generate(model, mode, prompt, [0], [6], budget=32, prefill=(8, 32))
        assert out == eager and len(eager[0]) == 6
        assert sum(n for k, n in graphs.replays.items() if k.prefill) == 4  # 32 + 32 + 32 + 4 tokens


def test_arrivals_during_decode_equal_the_eager_loop(model):
    """Random prompts (1-70 tokens) arriving while others decode, pools and budgets that force chunking, queueing
    and finishes while steps run ahead (8 cases): eager, synchronous graphs and pipelined graphs give the same
    tokens, mixed graphs replay in every case, and the pipelined loop starts requests in steps planned ahead."""
    gen = torch.Generator().manual_seed(0)

    def pick(choices):
        return choices[int(torch.randint(len(choices), (1,), generator=gen))]

    admitted = []
    for _ in range(8):
        n = pick([3, 5, 8])
        prompts = [torch.randint(1, 300, (pick([1, 2, 3, 7, 9, 20, 40, 70]),), generator=gen).tolist()
                   for _ in range(n)]
        arrivals = sorted(torch.randint(0, 30, (n,), generator=gen).tolist())
        max_tokens = torch.randint(1, 20, (n,), generator=gen).tolist()
        kw = dict(max_seqs=pick([2, 3, 4]), budget=pick([16, 32, 64]), num_blocks=pick([40, 48, 64]))
        eager, _, _ = _generate(model, "eager", prompts, arrivals, max_tokens, **kw)
        sync, _, _ = _generate(model, "sync", prompts, arrivals, max_tokens, **kw)
        pipelined, graphs, admitted_ahead = _generate(model, "pipelined", prompts, arrivals, max_tokens, **kw)
        assert sync == eager and pipelined == eager, (prompts, arrivals, max_tokens, kw)
        assert [len(o) for o in eager] == max_tokens
        assert any(k.prefill for k in graphs.replays)
        admitted.append(admitted_ahead)
    assert sum(admitted) >= 8, admitted


def test_verify_graphs_give_the_eager_loops_tokens(model):
    """Speculative decoding (k = 3) over verify graphs: the greedy tokens of the eager loop without drafts, with
    n-gram drafts and with drafts that pass (an oracle's); verify graphs replay."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9] * 12, list(range(1, 30)), [3, 1, 4, 1, 5, 9, 2, 6]]
    arrivals, max_tokens = [0, 0, 3, 6], [40, 25, 30, 35]
    eager, _, _ = _generate(model, "eager", prompts, arrivals, max_tokens)
    for mode in ("sync", "pipelined"):
        for drafter in (None, OracleDrafter(prompts, eager, 50)):
            out, graphs, _ = _generate(model, mode, prompts, arrivals, max_tokens, drafts=3, drafter=drafter,
                                       draft_max_pause=0)  # every lookup and verify (backoff: the next test)
            assert out == eager, (mode, drafter)
            verify = {k: n for k, n in graphs.replays.items() if k.verify}
            assert verify and sum(verify.values()) >= 10, graphs.replays
            assert graphs.verify_buckets == {1: 4, 2: 7, 4: 13}
            if drafter is not None:
                sched = graphs.sched
                assert sched.num_accepted_tokens > sched.num_verify_steps, vars(sched)


def test_failing_drafts_back_off_into_steps_planned_ahead(model):
    """Drafts that never pass (k = 3): each sequence pauses drafting for 2, 4, 8, ... tokens after each failed
    verify (`voltserve.spec.backoff`) and the pipelined loop plans the paused steps ahead, with the eager loop's
    tokens; without backoff every decode step verifies and none is planned ahead."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9] * 12, list(range(1, 30)), [3, 1, 4, 1, 5, 9, 2, 6]]
    arrivals, max_tokens = [0, 0, 3, 6], [40, 25, 30, 35]
    eager, _, _ = _generate(model, "eager", prompts, arrivals, max_tokens)
    counts = {}
    for pause in (64, 0):
        out, graphs, _ = _generate(model, "pipelined", prompts, arrivals, max_tokens, drafts=3, draft_max_pause=pause,
                                   drafter=KnownDrafter(prompts, eager, model.config.vocab_size, fail=True))
        sched = graphs.sched
        assert out == eager and sched.num_accepted_tokens == 0
        counts[pause] = sched.num_verify_steps, graphs.ahead_launches
    # with backoff 4-5 verifies a sequence (after 1, 2 + 1, 4 + 1, 8 + 1, 16 + 1 tokens), the rest plain decodes;
    # without it a verify at nearly every decode step (122 of 126 here: the last tokens leave no room for drafts)
    # and one step planned ahead (the last sequence's last token: no draft fits)
    assert 16 <= counts[64][0] <= 20 and counts[64][1] >= 12, counts
    assert counts[0] == (122, 1), counts


# the draft-model tests' load: four requests arriving over the first steps
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9] * 12, list(range(1, 30)), [3, 1, 4, 1, 5, 9, 2, 6]]
ARRIVALS, MAX_TOKENS = [0, 0, 3, 6], [40, 25, 30, 35]


def _own_draft_over_graphs(model):
    """(runner, DraftModelDrafter with k = 3, its graphs): `model` as its own draft, over CPU "graphs"."""
    from voltserve.spec.draft_model import DraftModelDrafter

    cfg, backend = model.config, model.backend
    kv = backend.allocate_kv_cache(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim)
    draft_graphs = _CpuReplayGraphs(model, backend, kv, 4, 256, [8, 64], None)
    draft_graphs.capture()
    runner = ModelRunner(model, backend, kv, (), seed=0, graphs=draft_graphs)
    return runner, DraftModelDrafter(runner, BlockPool(64, 4, False), 3, cfg.vocab_size), draft_graphs


def test_a_draft_model_over_graphs_feeds_its_decode_steps_on_the_device(model):
    """The draft_model method with the model as its own draft, both over CPU "graphs": the draft's decode steps
    are launched fed from the step before (`DraftModelDrafter._run_chain`, two in flight), every draft passes and
    the tokens equal the eager loop's; both pools end free."""
    eager, _, _ = _generate(model, "eager", PROMPTS, ARRIVALS, MAX_TOKENS)
    runner, drafter, draft_graphs = _own_draft_over_graphs(model)
    launch, fed = runner.launch, []
    runner.launch = lambda plan, feed=None: (fed.append(feed is not None), launch(plan, feed))[1]
    prepare = drafter.prepare
    drafter.prepare = lambda wanted: (fed.append(None), prepare(wanted))  # None: a prepare starts
    for mode in ("sync", "pipelined"):
        fed.clear()
        out, graphs, _ = _generate(model, mode, PROMPTS, ARRIVALS, MAX_TOKENS, drafts=3, drafter=drafter,
                                   draft_max_pause=0)
        sched = graphs.sched
        assert out == eager, mode
        assert sched.num_draft_tokens > 60 and sched.num_accepted_tokens == sched.num_draft_tokens
        # each prepare: its catch-up (not fed), then its decode steps, all fed on the device
        per_prepare = " ".join("".join("F" if f else "c" for f in run) for run in _split(fed))
        assert set(per_prepare.split()) <= {"c", "cF", "cFF"} and per_prepare.count("F") > 20, per_prepare
        assert drafter.pool.num_free == drafter.pool.num_blocks
    assert any(k.prefill for k in draft_graphs.replays) and any(not k.prefill for k in draft_graphs.replays)


def test_sampled_drafts_over_graphs_feed_each_decode_step_the_drafts_just_drawn(model):
    """Sampled requests, the model as its own draft, both over CPU "graphs": each draft decode step takes the
    drafts drawn from the step before as its input ids on the device (`ModelRunner.logits(ids_from=)`), the
    host reads them once a prepare; q equals the verify's p (the same model, batch invariant), so every draft
    passes; both pools end free."""
    runner, drafter, _ = _own_draft_over_graphs(model)
    logits, fed = runner.logits, []
    runner.logits = lambda plan, ids_from=None: (fed.append(ids_from is not None), logits(plan, ids_from))[1]
    drafter.generator.manual_seed(3)
    params = SamplingParams(temperature=25.0, top_p=0.9, ignore_eos=True)  # the sharp test model: spread out
    out, graphs, _ = _generate(model, "sync", PROMPTS, ARRIVALS, MAX_TOKENS, drafts=3, drafter=drafter,
                               draft_max_pause=0, params=params)
    sched = graphs.sched
    assert [len(o) for o in out] == MAX_TOKENS and all(0 <= t < model.config.vocab_size for o in out for t in o)
    assert sched.num_draft_tokens > 60 and sched.num_accepted_tokens == sched.num_draft_tokens
    assert len(set(map(tuple, out))) == len(out) and len(set(out[1])) > 3  # sampled: not one greedy path
    assert fed.count(True) > 20 and fed.count(False) > 10
    assert drafter.pool.num_free == drafter.pool.num_blocks


def _split(marks: list) -> list[list[bool]]:
    """[None, a, b, None, c] -> [[a, b], [c]]: the launches of each prepare."""
    runs: list[list[bool]] = []
    for m in marks:
        if m is None:
            runs.append([])
        else:
            runs[-1].append(m)
    return runs
