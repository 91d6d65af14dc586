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


class PackedStepInputs:
    """The host side of a decode graph's static inputs: one int32 buffer holding ids, positions and slots (int64
    as word pairs), seq_lens, then the block tables [rows, max_blocks], so that one copy uploads a step.

    Args:
        rows: largest batch (bucket) it holds.
        max_blocks: block-table width.
        block_size: tokens per KV block (for slot numbers).
        pin: page-lock the buffer (needs CUDA); False for tests on the CPU.
    Attributes:
        buffer: the int32 host tensor; `words(b)` of it is what a bucket of b rows uses.
    """

    def __init__(self, rows: int, max_blocks: int, block_size: int, pin: bool = True):
        self.rows, self.max_blocks, self.block_size = rows, max_blocks, block_size
        n = rows
        self.off_pos, self.off_slot, self.off_lens, self.off_tab = 2 * n, 4 * n, 6 * n, 7 * n
        buffer = torch.zeros(self.off_tab + n * max_blocks, dtype=torch.int32)
        self.buffer = buffer.pin_memory() if pin else buffer
        h = self.buffer.numpy()
        self.ids = h[:self.off_pos].view(np.int64)
        self.positions = h[self.off_pos:self.off_slot].view(np.int64)
        self.slots = h[self.off_slot:self.off_lens].view(np.int64)
        self.seq_lens = h[self.off_lens:self.off_tab]
        self.tables = h[self.off_tab:].reshape(n, max_blocks)
        self.slots[:] = -1
        self.seq_lens[:] = 1

    def words(self, b: int) -> int:
        """int32 words a bucket of b rows reads (the block tables come last)."""
        return self.off_tab + b * self.max_blocks

    def fill_from_plan(self, entries, ids: bool = True) -> None:
        """Rows 0..len(entries) from the scheduler's entries (`voltserve.scheduler.ScheduledSeq`, one decode token
        each), read straight from the sequences: no StepInputs on the step's critical path. ids=False leaves the
        input ids out (a step planned ahead: they come from the previous step's output on the device)."""
        n, bs = len(entries), self.block_size
        positions, slots = [], []
        tables = self.tables
        if ids:
            self.ids[:n] = [e.seq.token_at(e.start) for e in entries]
        for i, e in enumerate(entries):
            seq, pos = e.seq, e.start
            blocks = seq.block_ids
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            tables[i, :len(blocks)] = blocks  # entries past the sequence's blocks are never read (seq_lens bound them)
        self.positions[:n] = positions
        self.slots[:n] = slots
        self.seq_lens[:n] = self.positions[:n] + 1

    def pad(self, n: int, b: int) -> None:
        """Rows n..b are padding: no KV write (slot -1), one key of block 0."""
        self.slots[n:b] = -1
        self.seq_lens[n:b] = 1
        self.tables[n:b, 0] = 0


class DecodeGraphs:
    """Captured decode steps of `model` over `kv_cache`.

    The static inputs of every bucket are views into one int32 device buffer laid out as `PackedStepInputs`; a
    step fills a pinned host mirror (`self.host`) and uploads the used prefix in one copy; there are two mirrors,
    used in turn, so a step can be filled while the previous step's upload may still be pending (asynchronous
    scheduling keeps two steps in flight; the runner syncs on step N-1 before it fills step N+1). Each graph also runs
    the greedy argmax of its logits.

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
        self._hosts = [PackedStepInputs(n, self.max_blocks, block_size) for _ in range(2)]
        self.host = self._hosts[0]  # the mirror the next step fills
        self._dev = torch.zeros_like(self.host.buffer, device=dev)
        h = self.host
        d = self._dev
        self.input_ids = d[:h.off_pos].view(torch.int64)
        self.positions = d[h.off_pos:h.off_slot].view(torch.int64)
        self.slot_mapping = d[h.off_slot:h.off_lens].view(torch.int64)
        self.seq_lens = d[h.off_lens:h.off_tab]
        self.block_tables = d[h.off_tab:].view(n, self.max_blocks)
        self._dev.copy_(h.buffer)
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

    def can_run_plan(self, entries) -> bool:
        """Whether `host.fill_from_plan` + `replay` take these plan entries: one sampled decode token each, within the
        largest bucket."""
        return bool(self._graphs) and len(entries) <= self.buckets[-1] and \
            all(e.num_new == 1 and e.sample for e in entries)

    def replay(self, n: int, ids_from: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Upload rows 0..n of `self.host` (filled by the caller; padding added here) and replay the bucket of n
        sequences. ids_from: [n] int64 device ids to use as the input ids instead of the host's (the previous
        step's greedy output, copied after the upload and before the replay overwrites it).

        Returns:
            (logits [n, vocab], greedy ids [n] int64): views of the graph's outputs, valid until the bucket's
            next replay.
        """
        b = next(x for x in self.buckets if x >= n)
        if b > n:
            self.host.pad(n, b)
        end = self.host.words(b)
        self._dev[:end].copy_(self.host.buffer[:end], non_blocking=True)
        self.host = self._hosts[self.host is self._hosts[0]]  # the next step fills the other mirror
        if ids_from is not None:
            self.input_ids[:n].copy_(ids_from)
        self._graphs[b].replay()
        return self._logits[b][:n], self._greedy[b][:n]
