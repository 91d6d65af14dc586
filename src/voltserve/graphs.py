"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with padded static inputs.

Each graph is captured largest bucket first into one shared memory pool (nano-vllm's shape). Padded rows write
no KV (slot -1) and attend to one key of block 0; their logits are dropped. Steps with more sequences than the
largest bucket, and prefill steps, run eagerly.
"""

from __future__ import annotations

import logging

import torch

from voltserve.backends.base import AttentionMetadata, StepInputs

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 64, ... below max_num_seqs, then max_num_seqs itself."""
    buckets, b = [], 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_seqs]


class DecodeGraphs:
    """Captured decode steps of `model` over `kv_cache`.

    Args:
        model: has forward(StepInputs, kv_cache) -> logits [rows, vocab].
        backend: the CUDA backend (needs `refresh_stream()` and `device`).
        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        max_num_seqs: largest bucket.
        max_model_len: longest context; sizes the block tables and the attention split grid.
    """

    def __init__(self, model, backend, kv_cache: torch.Tensor, max_num_seqs: int, max_model_len: int):
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        block_size = kv_cache.shape[3]
        n, dev = self.buckets[-1], backend.device
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def _static_step(self, b: int) -> StepInputs:
        attn = AttentionMetadata(self.query_start_loc[:b + 1], self.seq_lens[:b], self.block_tables[:b],
                                 self.slot_mapping[:b], 1, self.max_model_len, [1] * b, [1] * b)
        return StepInputs(self.input_ids[:b], self.positions[:b], attn, self.logits_indices[:b])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (largest first, one pool). Runs each step eagerly once first (loads modules)."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            step = self._static_step(b)
            self.model.forward(step, self.kv_cache)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.backend.refresh_stream()
                self._logits[b] = self.model.forward(step, self.kv_cache)
            self.backend.refresh_stream()
            self._graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def can_run(self, step: StepInputs) -> bool:
        return bool(self._graphs) and step.attn.is_decode_only and step.attn.num_seqs <= self.buckets[-1]

    def run(self, step: StepInputs) -> torch.Tensor:
        """Replay the smallest bucket that fits. step: a decode-only step (host or device tensors).

        Returns:
            logits [num_seqs, vocab] (a view of the graph's output: read it before the next replay).
        """
        n = step.attn.num_seqs
        b = next(x for x in self.buckets if x >= n)
        width = step.attn.block_tables.shape[1]
        self.input_ids[:n].copy_(step.input_ids, non_blocking=True)
        self.positions[:n].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(step.attn.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(step.attn.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(step.attn.block_tables, non_blocking=True)
        if b > n:  # padding rows: no KV write, one key of block 0
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b, 0].fill_(0)
        self._graphs[b].replay()
        return self._logits[b][:n]
