"""Drive a LlamaModel step by step (a tensor-parallel rank or the whole model), logits of every step kept."""

from __future__ import annotations

import numpy as np
import torch

from voltserve.quant import QuantizedTensor
from voltserve.request import SamplingParams
from voltserve.runner import ModelRunner
from voltserve.scheduler import ScheduledSeq, StepPlan
from voltserve.sequence import Sequence

BLOCK_SIZE = 16


def dequantized(quant: QuantizedTensor) -> torch.Tensor:
    """[rows, cols] fp32 values of GGUF blocks, by the gguf package's reference dequantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(np.ascontiguousarray(quant.data), GGMLQuantizationType[quant.qtype])
    return torch.from_numpy(values.astype(np.float32).reshape(quant.shape))


def prefill_decode(model, backend, prompts: list[list[int]], num_decodes: int) -> dict:
    """Prefill every prompt in one step (logits of every row), then `num_decodes` batched greedy decode steps.

    Returns:
        {"prefill": [sum(len(p)), vocab] fp32 logits, "decode": [num_decodes, len(prompts), vocab] fp32 logits,
        "tokens": [len(prompts)][num_decodes + 1] greedy tokens, "kv_shape": the KV cache's shape}.
    """
    cfg = model.config
    blocks_each = -(-(max(map(len, prompts)) + num_decodes + 1) // BLOCK_SIZE)
    kv = backend.allocate_kv_cache(cfg.num_layers, blocks_each * len(prompts), BLOCK_SIZE, model.num_kv_heads,
                                   cfg.head_dim)
    seqs = [Sequence(i, f"r{i}", 0, list(ids), SamplingParams(), num_decodes + 1,
                     block_ids=list(range(i * blocks_each, (i + 1) * blocks_each))) for i, ids in enumerate(prompts)]
    runner = ModelRunner(model, backend, kv, (2,), seed=0)
    step = runner.prepare(StepPlan([ScheduledSeq(s, 0, s.num_tokens, True) for s in seqs]))
    step.logits_indices = torch.arange(step.input_ids.shape[0])
    out = {"decode": [], "kv_shape": tuple(kv.shape)}
    with torch.inference_mode():
        out["prefill"] = logits = model.forward(step, kv).float()
        last = logits[torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1]
        for _ in range(num_decodes):
            for s, tok in zip(seqs, last.argmax(-1).tolist()):
                s.output_ids.append(tok)
            plan = StepPlan([ScheduledSeq(s, s.num_tokens - 1, 1, True) for s in seqs])
            last = model.forward(runner.prepare(plan), kv).float()
            out["decode"].append(last)
        for s, tok in zip(seqs, last.argmax(-1).tolist()):
            s.output_ids.append(tok)
    out["decode"] = torch.stack(out["decode"])
    out["tokens"] = [s.output_ids for s in seqs]
    return out
