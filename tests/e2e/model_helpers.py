"""Drive a LlamaModel directly (no actors): whole-prompt logits and a greedy loop, on any backend."""

from __future__ import annotations

import torch

from voltserve.kv_cache import BlockPool
from voltserve.offline import run_steps
from voltserve.request import SamplingParams
from voltserve.runner import ModelRunner
from voltserve.scheduler import ScheduledSeq, Scheduler, StepPlan
from voltserve.sequence import Sequence


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
    cfg = model.config
    kv = backend.allocate_kv_cache(cfg.num_layers, 32, 16, cfg.num_kv_heads, cfg.head_dim)
    sched = Scheduler(BlockPool(32, 16), 4, 512, 512, (2,))
    seq = Sequence(0, "r", 0, list(prompt_ids), SamplingParams(temperature=0, ignore_eos=True), num_tokens)
    sched.add(seq)
    graphs = graphs_factory(kv) if graphs_factory else None
    runner = ModelRunner(model, backend, kv, (2,), seed=0, graphs=graphs)
    run_steps(sched, runner, pipelined=pipelined)
    return seq.output_ids
