"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with padded static inputs.

Each graph is captured largest bucket first into one shared memory pool (nano-vllm's shape). Padded rows write
no KV (slot -1) and attend to one key of block 0; their logits are dropped. Steps with more sequences than the
largest bucket, and prefill steps, run eagerly.
"""

from __future__ import annotations

import logging

import numpy as np
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

    The static inputs of every bucket are views into one int32 device buffer (ids, positions and slots as int64
    pairs, seq_lens, then the block tables [max bucket, max_blocks]); a step fills the pinned host mirror with
    numpy and uploads the used prefix in one copy. Each graph also runs the greedy argmax of its logits.

    Args:
        model: has forward(StepInputs, kv_cache) -> logits [rows, vocab].
        backend: the CUDA backend (needs `refresh_stream()`, `device` and `sample_greedy`).
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
        self.max_blocks = -(-max_model_len // block_size)
        # int32 word offsets: ids, positions, slots (int64 = 2 words each), seq_lens, block tables last (a step
        # uploads the prefix up to its bucket's table rows)
        self._off_pos, self._off_slot, self._off_lens, self._off_tab = 2 * n, 4 * n, 6 * n, 7 * n
        words = self._off_tab + n * self.max_blocks
        self._dev = torch.zeros(words, dtype=torch.int32, device=dev)
        self._host = torch.zeros(words, dtype=torch.int32).pin_memory()
        h = self._host.numpy()
        self._h_ids = h[:self._off_pos].view(np.int64)
        self._h_pos = h[self._off_pos:self._off_slot].view(np.int64)
        self._h_slots = h[self._off_slot:self._off_lens].view(np.int64)
        self._h_lens = h[self._off_lens:self._off_tab]
        self._h_tab = h[self._off_tab:].reshape(n, self.max_blocks)
        self._h_slots[:] = -1
        self._h_lens[:] = 1
        d = self._dev
        self.input_ids = d[:self._off_pos].view(torch.int64)
        self.positions = d[self._off_pos:self._off_slot].view(torch.int64)
        self.slot_mapping = d[self._off_slot:self._off_lens].view(torch.int64)
        self.seq_lens = d[self._off_lens:self._off_tab]
        self.block_tables = d[self._off_tab:].view(n, self.max_blocks)
        self._dev.copy_(self._host)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._greedy: dict[int, torch.Tensor] = {}

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
            self.backend.sample_greedy(self.model.forward(step, self.kv_cache))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.backend.refresh_stream()
                self._logits[b] = self.model.forward(step, self.kv_cache)
                self._greedy[b] = self.backend.sample_greedy(self._logits[b])[0]
            self.backend.refresh_stream()
            self._graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def can_run(self, step: StepInputs) -> bool:
        return bool(self._graphs) and step.attn.is_decode_only and step.attn.num_seqs <= self.buckets[-1]

    def run(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the smallest bucket that fits. step: a decode-only step with host (CPU) tensors.

        Returns:
            (logits [num_seqs, vocab], greedy ids [num_seqs] int64): views of the graph's outputs, valid until
            the next replay.
        """
        n = step.attn.num_seqs
        b = next(x for x in self.buckets if x >= n)
        width = step.attn.block_tables.shape[1]
        self._h_ids[:n] = step.input_ids.numpy()
        self._h_pos[:n] = step.positions.numpy()
        self._h_slots[:n] = step.attn.slot_mapping.numpy()
        self._h_lens[:n] = step.attn.seq_lens.numpy()
        self._h_tab[:n, :width] = step.attn.block_tables.numpy()
        if b > n:  # padding rows: no KV write, one key of block 0
            self._h_slots[n:b] = -1
            self._h_lens[n:b] = 1
            self._h_tab[n:b, 0] = 0
        # the previous step's upload finished: the runner read that step's results (a sync) before this call
        end = self._off_tab + b * self.max_blocks
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        self._graphs[b].replay()
        return self._logits[b][:n], self._greedy[b][:n]
