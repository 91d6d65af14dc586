"""Drive a LlamaModel directly (no actors): whole-prompt logits and a greedy loop, on any backend."""

from __future__ import annotations

import torch

from voltserve.kv_cache import BlockPool
from voltserve.offline import run_steps
from voltserve.request import SamplingParams
from voltserve.runner import ModelRunner
from voltserve.scheduler import ScheduledSeq, Scheduler, StepPlan
from voltserve.sequence import Sequence
from voltserve.spec.ladder import DraftLadder


def all_logits(model, backend, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 CPU logits of one prefill through the paged forward."""
    cfg = model.config
    num_blocks = -(-len(ids) // 16)
    kv = backend.allocate_kv_cache(cfg.num_layers, num_blocks, 16, cfg.num_kv_heads, cfg.head_dim)
    seq = Sequence(0, "r", 0, ids, SamplingParams(), 1, block_ids=list(range(num_blocks)))
    runner = ModelRunner(model, backend, kv, (2,), seed=0)
    step = runner.prepare(StepPlan([ScheduledSeq(seq, 0, len(ids), True)]))
    step.logits_indices = torch.arange(len(ids))
    with torch.inference_mode():
        return model.forward(runner.to_device(step), kv).float().cpu()


def greedy(model, backend, prompt_ids: list[int], num_tokens: int, graphs_factory=None,
           pipelined: bool = False) -> list[int]:
    """num_tokens greedy tokens (EOS ignored) through the scheduler and ModelRunner (pipelined: asynchronous
    scheduling, voltserve.offline.run_steps)."""
    return generate(model, backend, [prompt_ids], num_tokens, graphs_factory, pipelined, temperature=0)[0][0]


def generate(model, backend, prompts: list[list[int]], num_tokens: int, graphs_factory=None,
             pipelined: bool = False, arrive_every: int = 0, drafter=None, num_drafts: int = 0,
             **params) -> list[tuple[list[int], list]]:
    """(tokens, logprobs) of num_tokens tokens (EOS ignored) per prompt, with SamplingParams `params` (a seed
    makes it reproducible: Philox key seed + prompt index). All prompts start in one batch, or with
    arrive_every = k prompt i arrives after k * i steps were applied (its prefill shares steps with the others'
    decodes). The scheduler admits into steps planned ahead what the runner allows (`ahead_admission`). drafter:
    speculative decoding with this drafter, up to `num_drafts` drafts a step."""
    cfg = model.config
    kv = backend.allocate_kv_cache(cfg.num_layers, 64, 16, cfg.num_kv_heads, cfg.head_dim)
    graphs = graphs_factory(kv) if graphs_factory else None
    runner = ModelRunner(model, backend, kv, (2,), seed=0, graphs=graphs)
    spec = {"drafter": drafter, "ladder": DraftLadder(num_drafts)} if drafter is not None else {}
    sched = Scheduler(BlockPool(64, 16), 4, 512, 512, (2,), *runner.ahead_admission(), **spec)
    generate.last_scheduler = sched  # its counters, for the tests
    seqs = []
    for i, ids in enumerate(prompts):
        sp = SamplingParams(ignore_eos=True, **params)
        seqs.append(Sequence(i, f"r{i}", 0, list(ids), sp, num_tokens, philox_seed=(sp.seed or 0) + i))
    logprobs = {s.seq_id: [] for s in seqs}
    pending = list(seqs)
    applied = [0]  # steps applied so far

    def arrive() -> None:
        while pending and applied[0] >= arrive_every * (len(seqs) - len(pending)):
            sched.add(pending.pop(0))

    def keep(touched, lps):  # a step ahead of a sequence that just finished is dropped, its logprobs too
        for seq in touched:
            if seq.seq_id in lps:
                logprobs[seq.seq_id].append(lps[seq.seq_id])
        applied[0] += 1
        arrive()

    arrive()
    if pipelined:
        run_steps(sched, runner, pipelined=True, on_update=keep)
    else:
        while sched.has_work():  # the reference: ModelRunner.execute, one step at a time
            plan = sched.schedule()
            sampled, lps = runner.execute(plan)
            keep(sched.update(plan, sampled), lps)
    assert not pending, "a prompt arrived after the others had finished"
    return [(s.output_ids, logprobs[s.seq_id]) for s in seqs]
