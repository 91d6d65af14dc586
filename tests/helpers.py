"""Factory helpers shared by tests (vLLM utils.py style)."""

from __future__ import annotations

import itertools

from voltserve.kv_cache import BlockPool
from voltserve.request import SamplingParams
from voltserve.scheduler import Scheduler
from voltserve.sequence import Sequence

_ids = itertools.count()


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                   eos=(0,), prefix_caching=True) -> Scheduler:
    pool = BlockPool(num_blocks, block_size, prefix_caching)
    return Scheduler(pool, max_num_seqs, max_num_batched_tokens, max_model_len, eos)


def make_seq(prompt, max_tokens=8, request_id=None, **params) -> Sequence:
    seq_id = next(_ids)
    return Sequence(seq_id=seq_id, request_id=request_id or f"r{seq_id}", index=0, prompt_ids=list(prompt),
                    params=SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens)


def run_step(scheduler: Scheduler, next_token=lambda seq: 7):
    """Schedule one step and feed back `next_token(seq)` for each sampling entry. Returns (plan, touched)."""
    plan = scheduler.schedule()
    sampled = {e.seq.seq_id: next_token(e.seq) for e in plan.entries if e.sample}
    return plan, scheduler.update(plan, sampled)
