"""CUDA graphs for decode and mixed (prefill + decode) steps, replayed with padded static inputs.

Decode graphs: one per batch-size bucket b (one token per sequence, the decode attention kernel). Mixed graphs:
one per (b, P): up to b sequences holding up to b + P tokens, no sequence more than P of them; attention runs the
decode kernel for the sequences of one token and the varlen (prefill) kernel for sequences of >= 2 tokens
(`AttentionMetadata.split_decode`). A new request's prefill then shares a graph-replayed step with the running
sequences' decodes instead of making the whole step eager; under many streaming clients a request starts every
few steps (bench_decode.py --churn). Every graph is captured largest first into one shared memory pool (nano-vllm's
shape). Padded tokens write no KV (slot -1); each padded sequence has one padded token and one key of block 0;
their logits are dropped. Steps beyond the largest buckets run eagerly.

Verify graphs (speculative decoding): a mixed graph per bucket b with room for the most drafts that many
sequences verify (r * width(r) for the r sequences the bucket takes, `verify_width` = the ladder), plus one, with
logits and the greedy argmax for every token slot (a verify step needs the target's row after each draft); its
attention runs every token slot as a decode of the keys up to its position (`AttentionMetadata.rows_as_decodes`;
VOLTSERVE_ATTN_VERIFY=prefill: the mixed graphs' attention).
Captured only for buckets of at most `VERIFY_MAX_DRAFT_TOKENS` drafts; a bigger verify step runs eagerly.
"""

from __future__ import annotations

import functools

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from voltserve.backends.base import AttentionMetadata, StepInputs

logger = logging.getLogger(__name__)

# Query-token capacities P of the mixed graphs (capped by the step's token budget): short chat prompts, and up
# to one step's budget. More P buckets cost capture time and graph memory; a prefill above the largest runs
# eagerly, where launching costs less than the step computes.
MIXED_PREFILL_TOKENS = (64, 512)
# the most draft tokens (b * k) a verify graph is captured for; the ladder's widths usually shrink k as b grows
VERIFY_MAX_DRAFT_TOKENS = 128


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 64, ... below max_num_seqs, then max_num_seqs itself."""
    buckets, b = [], 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_seqs]


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """The mixed graphs' query-token capacities for a step budget of `max_num_batched_tokens` tokens."""
    return sorted({min(p, max_num_batched_tokens) for p in MIXED_PREFILL_TOKENS if max_num_batched_tokens > 1})


def verify_buckets(buckets: list[int], width: Callable[[int], int]) -> dict[int, int]:
    """Bucket b -> its verify graph's query tokens beyond one a sequence: the most drafts the r sequences it takes
    (previous bucket < r <= b) verify, r * width(r), plus one (a lone sequence's 1 + k tokens fit); buckets past
    VERIFY_MAX_DRAFT_TOKENS drafts, and those whose sequences never draft (the ladder's width 0), get none."""
    out, prev = {}, 0
    for b in buckets:
        drafts = max(r * width(r) for r in range(prev + 1, b + 1))
        prev = b
        if 0 < drafts <= VERIFY_MAX_DRAFT_TOKENS:
            out[b] = drafts + 1
    return out


@dataclass(frozen=True)
class GraphKey:
    """A captured graph: `seqs` sequence slots; prefill = 0 for a decode graph (one token per slot), else the
    mixed graph's query-token capacity P (seqs + P token slots, at most P per sequence); verify: a verify graph
    (a mixed graph with logits for every token slot)."""

    seqs: int
    prefill: int = 0
    verify: bool = False

    @property
    def tokens(self) -> int:
        return self.seqs + self.prefill if self.prefill else self.seqs


class PackedStepInputs:
    """The host side of a graph's static inputs: one int32 buffer holding, per token, ids, positions and slots
    (int64 as word pairs), per sequence the logits rows (int64), seq_lens and query_start_loc, then one word of
    the decode attention's plan (`AttentionMetadata.decode_splits`, written by `StepGraphs.fill`), then the block
    tables [seqs, max_blocks] last, so that one copy of a prefix uploads a step.

    Args:
        tokens: token slots (the largest graph's).
        seqs: sequence slots.
        max_blocks: block-table width.
        block_size: tokens per KV block (for slot numbers).
        pin: page-lock the buffer (needs CUDA); False for tests on the CPU.
    Attributes:
        buffer: the int32 host tensor; `words(b)` of it is what a graph of b sequence slots reads.
        longest: the longest context of the last step filled (tokens; host only).
    """

    def __init__(self, tokens: int, seqs: int, max_blocks: int, block_size: int, pin: bool = True):
        self.tokens, self.seqs, self.max_blocks, self.block_size = tokens, seqs, max_blocks, block_size
        t, s = tokens, seqs
        self.off_pos, self.off_slot, self.off_logits = 2 * t, 4 * t, 6 * t
        self.off_lens, self.off_qsl, self.off_splits = 6 * t + 2 * s, 6 * t + 3 * s, 6 * t + 4 * s + 1
        self.off_tab = self.off_splits + 1
        buffer = torch.zeros(self.off_tab + s * max_blocks, dtype=torch.int32)
        self.buffer = buffer.pin_memory() if pin else buffer
        (self.ids, self.positions, self.slots, self.logits_rows, self.seq_lens, self.query_start, self.decode_splits,
         self.tables) = self.fields(self.buffer.numpy(), np.int64)
        self.slots[:] = -1
        self.seq_lens[:] = 1
        self.longest = 1
        self.logits_rows[:] = np.arange(s)
        self.query_start[:] = np.minimum(np.arange(s + 1), t)

    def fields(self, buf, int64):
        """Views of `buf` (this layout's int32 words, numpy or torch): (ids, positions, slots, logits rows) viewed
        as `int64`, then seq_lens, query_start, the decode attention's split count ([1]) and the block tables
        [seqs, max_blocks] as int32."""
        bounds = (0, self.off_pos, self.off_slot, self.off_logits, self.off_lens)
        wide = [buf[a:b].view(int64) for a, b in zip(bounds, bounds[1:])]
        return (*wide, buf[self.off_lens:self.off_qsl], buf[self.off_qsl:self.off_splits],
                buf[self.off_splits:self.off_tab], buf[self.off_tab:].reshape(self.seqs, self.max_blocks))

    def words(self, seqs: int) -> int:
        """int32 words a graph of `seqs` sequence slots reads (the block tables come last)."""
        return self.off_tab + seqs * self.max_blocks

    def fill_from_plan(self, entries, fed: int = 0) -> None:
        """Decode rows 0..len(entries) from the scheduler's entries (`voltserve.scheduler.ScheduledSeq`, one token
        each), read straight from the sequences: no StepInputs on the step's critical path. The input ids of the
        first `fed` rows are left out (a step planned ahead: they come from the previous step's output on the
        device). Token i is sequence i's, so query_start and the logits rows keep their initial arange."""
        n, bs = len(entries), self.block_size
        positions, slots = [], []
        tables = self.tables
        if fed < n:
            self.ids[fed:n] = [e.seq.token_at(e.start) for e in entries[fed:]]
        for i, e in enumerate(entries):
            seq, pos = e.seq, e.start
            blocks = seq.block_ids
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            tables[i, :len(blocks)] = blocks  # entries past the sequence's blocks are never read (seq_lens bound them)
        self.positions[:n] = positions
        self.slots[:n] = slots
        self.seq_lens[:n] = self.positions[:n] + 1
        self.longest = max(positions) + 1  # padding rows (seq_len 1) never exceed it

    def pad(self, n: int, b: int) -> None:
        """Decode rows n..b are padding: no KV write (slot -1), one key of block 0."""
        self.slots[n:b] = -1
        self.seq_lens[n:b] = 1
        self.tables[n:b, 0] = 0

    def fill_mixed(self, entries, fed: int = 0) -> int:
        """Any step's tokens, in plan order, as `ModelRunner.prepare` lays them out; one logits row per entry
        (its last token). The ids of the first `fed` entries (one token each, at token slots 0..fed) are left out:
        they come from the previous step's output on the device. Returns the number of tokens."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        tables = self.tables
        for i, e in enumerate(entries):
            seq, start, n = e.seq, e.start, e.num_new
            blocks = seq.block_ids
            if n == 1:
                ids.append(seq.token_at(start) if i >= fed else 0)
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                if e.drafts:  # a verify: the last token, then the drafts
                    ids.append(seq.token_at(start))
                    ids.extend(e.drafts)
                else:
                    ids.extend(seq.token_ids()[start:start + n])
                positions.extend(range(start, start + n))
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            starts.append(starts[-1] + n)
            self.seq_lens[i] = start + n
            tables[i, :len(blocks)] = blocks
        t, k = starts[-1], len(entries)
        self.longest = max(e.start + e.num_new for e in entries)
        if fed:
            self.ids[fed:t] = ids[fed:]
        else:
            self.ids[:t] = ids
        self.positions[:t] = positions
        self.slots[:t] = slots
        self.query_start[:k + 1] = starts
        self.logits_rows[:k] = self.query_start[1:k + 1] - 1
        return t

    def pad_mixed(self, n: int, seqs: int, num_tokens: int, tokens: int) -> None:
        """Sequence slots n..seqs and token slots num_tokens..tokens are padding: each padded sequence has one
        query token of its own (a one-token sequence: the decode kernel's row) and one key of block 0; no token
        writes KV. Needs seqs - n <= tokens - num_tokens."""
        self.seq_lens[n:seqs] = 1
        self.tables[n:seqs, 0] = 0
        self.query_start[n + 1:seqs + 1] = np.arange(num_tokens + 1, num_tokens + 1 + seqs - n)
        self.logits_rows[n:seqs] = self.query_start[n + 1:seqs + 1] - 1
        self.ids[num_tokens:tokens] = 0
        self.positions[num_tokens:tokens] = 0
        self.slots[num_tokens:tokens] = -1


class _GraphInputs:
    """One device buffer of static inputs (`PackedStepInputs` layout) and its two pinned host mirrors, used in
    turn, so a step can be filled while the previous step's upload may still be pending (asynchronous
    scheduling keeps two steps in flight). Each mirror's upload records a CUDA event that `writable` waits for
    before the mirror is filled again: the runner does not wait for every step (one that samples nothing, e.g. a
    long prompt's chunks, is never collected), so two uploads may be pending at once."""

    def __init__(self, tokens: int, seqs: int, max_blocks: int, block_size: int, device: torch.device):
        pin = torch.device(device).type == "cuda"
        self._hosts = [PackedStepInputs(tokens, seqs, max_blocks, block_size, pin) for _ in range(2)]
        self._uploaded: list[torch.cuda.Event | None] = [None, None]  # per mirror, after its last upload
        self._turn = 0  # the mirror the next step fills
        self.host = h = self._hosts[0]
        self.dev = torch.zeros_like(h.buffer, device=device)
        self.all_rows = torch.arange(tokens, dtype=torch.int64, device=device)  # a verify graph's logits rows
        (self.input_ids, self.positions, self.slot_mapping, self.logits_rows, self.seq_lens, self.query_start,
         self.decode_splits, self.block_tables) = h.fields(self.dev, torch.int64)
        self.dev.copy_(h.buffer)

    def static_step(self, key: GraphKey, max_model_len: int) -> StepInputs:
        b, t = key.seqs, key.tokens
        q = key.prefill or 1
        attn = AttentionMetadata(self.query_start[:b + 1], self.seq_lens[:b], self.block_tables[:b],
                                 self.slot_mapping[:t], q, max_model_len, [q] * b, [1] * b,
                                 split_decode=bool(key.prefill), decode_splits=self.decode_splits,
                                 rows_as_decodes=key.verify)
        rows = self.all_rows[:t] if key.verify else self.logits_rows[:b]
        return StepInputs(self.input_ids[:t], self.positions[:t], attn, rows)

    def writable(self) -> PackedStepInputs:
        """The mirror the next step fills, once its previous upload has read it."""
        done = self._uploaded[self._turn]
        if done is not None:
            done.synchronize()
        return self._hosts[self._turn]

    def upload(self, seqs: int) -> None:
        """Copy the prefix a graph of `seqs` sequence slots reads from the mirror `writable` gave, then turn to
        the other mirror."""
        host = self._hosts[self._turn]
        end = host.words(seqs)
        self.dev[:end].copy_(host.buffer[:end], non_blocking=True)
        if self.dev.is_cuda:
            done = self._uploaded[self._turn] = self._uploaded[self._turn] or torch.cuda.Event()
            done.record()
        self._turn ^= 1


class StepGraphs:
    """Captured decode and mixed steps of `model` over `kv_cache`.

    Each graph also runs the greedy argmax of its logits. `plan_key` picks a step's graph; `fill` writes the
    step into a pinned host mirror; `replay` uploads the used prefix in one copy and replays.

    Args:
        model: has forward(StepInputs, kv_cache) -> logits [rows, vocab].
        backend: the CUDA backend (needs `refresh_stream()`, `device` and `sample_greedy`; where it has
            `graph_decode_splits(capacity, sequences, longest)`, `fill` writes that count for each step into
            `AttentionMetadata.decode_splits`, else 0).
        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        max_num_seqs: largest bucket.
        max_model_len: longest context; sizes the block tables and the attention split grid.
        prefill_tokens: the mixed graphs' query-token capacities P (`prefill_buckets`); empty = decode graphs
            only.
        verify_width: drafts a sequence verifies when r sequences run (speculative decoding:
            `voltserve.spec.ladder.DraftLadder.width`), or None: no verify graphs. Bucket b gets a verify graph of
            max(r * verify_width(r)) + 1 query tokens beyond one a sequence over the r it takes, where that is at
            most VERIFY_MAX_DRAFT_TOKENS + 1.
    """

    def __init__(self, model, backend, kv_cache: torch.Tensor, max_num_seqs: int, max_model_len: int,
                 prefill_tokens: tuple[int, ...] | list[int] = (),
                 verify_width: Callable[[int], int] | None = None):
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.buckets = batch_buckets(max_num_seqs)
        self.prefill_buckets = sorted(prefill_tokens)
        self.max_model_len = max_model_len
        block_size = kv_cache.shape[3]
        n, dev = self.buckets[-1], backend.device
        self.max_blocks = -(-max_model_len // block_size)
        self._decode = _GraphInputs(n, n, self.max_blocks, block_size, dev)
        self._mixed = None
        if self.prefill_buckets:
            self._mixed = _GraphInputs(n + self.prefill_buckets[-1], n, self.max_blocks, block_size, dev)
        self.verify_buckets = verify_buckets(self.buckets, verify_width) if verify_width is not None else {}
        self._verify = None
        if self.verify_buckets:
            b = max(self.verify_buckets)
            self._verify = _GraphInputs(b + self.verify_buckets[b], b, self.max_blocks, block_size, dev)
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._logits: dict[GraphKey, torch.Tensor] = {}
        self._greedy: dict[GraphKey, torch.Tensor] = {}
        self.replays: Counter[GraphKey] = Counter()  # replays per graph (tests, diagnostics)
        # the decode attention's split count for a step's longest context, where the backend plans one
        # (`AttentionMetadata.decode_splits`; the grid is sized for max_model_len)
        self._plan_decode_splits = getattr(backend, "graph_decode_splits", None)
        heads, kv_heads = getattr(model, "num_heads", None), getattr(model, "num_kv_heads", None)
        if self._plan_decode_splits is not None and heads and kv_heads:  # this model's plan (a draft model's differ)
            self._plan_decode_splits = functools.partial(self._plan_decode_splits,
                                                         shape=(kv_heads, kv_cache.shape[5], heads // kv_heads))

    def _inputs(self, key: GraphKey) -> _GraphInputs:
        return self._verify if key.verify else self._mixed if key.prefill else self._decode

    def keys(self) -> list[GraphKey]:
        """Every graph, largest first (the capture order)."""
        mixed = [GraphKey(b, p) for p in reversed(self.prefill_buckets) for b in reversed(self.buckets)]
        verify = [GraphKey(b, p, True) for b, p in sorted(self.verify_buckets.items(), reverse=True)]
        return mixed + verify + [GraphKey(b) for b in reversed(self.buckets)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph (largest first, one pool). Runs each step eagerly once first (loads modules)."""
        pool = torch.cuda.graph_pool_handle()
        for key in self.keys():
            step = self._inputs(key).static_step(key, self.max_model_len)
            self.backend.sample_greedy(self.model.forward(step, self.kv_cache))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.backend.refresh_stream()
                self._logits[key] = self.model.forward(step, self.kv_cache)
                self._greedy[key] = self.backend.sample_greedy(self._logits[key])[0]
            self.backend.refresh_stream()
            self._graphs[key] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s, mixed prefill + decode graphs for up to %s "
                    "query tokens, verify graphs for batch sizes %s", self.buckets, self.prefill_buckets or "no",
                    sorted(self.verify_buckets) or "none")

    def plan_key(self, entries) -> GraphKey | None:
        """The smallest graph that runs these plan entries, or None (run the step eagerly)."""
        if not self._graphs or not entries or len(entries) > self.buckets[-1]:
            return None
        n = len(entries)
        b = next(x for x in self.buckets if x >= n)
        if all(e.num_new == 1 for e in entries):
            return GraphKey(b)
        longest = max(e.num_new for e in entries)
        extra = sum(e.num_new for e in entries) - n  # tokens beyond one per sequence (padded sequences get one)
        p = next((x for x in self.prefill_buckets if x >= longest and x >= extra), None)
        return GraphKey(b, p) if p is not None else None

    def verify_key(self, entries) -> GraphKey | None:
        """The verify graph that runs these entries (some with drafts), or None (run the step eagerly)."""
        if not self._graphs or not self.verify_buckets or len(entries) > max(self.verify_buckets):
            return None
        n = len(entries)
        b = next(x for x in self.buckets if x >= n)
        p = self.verify_buckets.get(b)
        if p is None:
            return None
        longest = max(e.num_new for e in entries)
        extra = sum(e.num_new for e in entries) - n
        return GraphKey(b, p, True) if longest <= p and extra <= p else None

    def fill(self, key: GraphKey, entries, fed: int = 0) -> None:
        """Write a step of `entries` (which `plan_key` gave `key`) into its host mirror, padded to the graph; the
        first `fed` entries' ids are left out (`replay(ids_from=)` supplies them)."""
        host = self._inputs(key).writable()
        if key.prefill:
            num_tokens = host.fill_mixed(entries, fed)
            host.pad_mixed(len(entries), key.seqs, num_tokens, key.tokens)
        else:
            host.fill_from_plan(entries, fed)
            if key.seqs > len(entries):
                host.pad(len(entries), key.seqs)
        planner = self._plan_decode_splits
        # a verify graph's decode attention runs a unit per token slot where the backend runs its rows as decodes
        # (AttentionMetadata.rows_as_decodes; CudaBackend.attn_verify "decode"), else one per sequence
        rows = key.verify and getattr(self.backend, "attn_verify", "decode") == "decode"
        units = key.tokens if rows else key.seqs
        host.decode_splits[0] = planner(self.max_model_len, units, host.longest) if planner is not None else 0

    def replay(self, key: GraphKey, n: int,
               ids_from: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Upload the step `fill` wrote and replay its graph. key: the graph (`plan_key`); n: the step's sequences.
        ids_from: [k] int64 device ids for token slots 0..k (the previous step's sampled output, copied after the
        upload and before the replay overwrites it).

        Returns:
            (logits [n, vocab], greedy ids [n] int64): one row per sequence (its last token), views of the
            graph's outputs, valid until the graph's next replay; a verify graph's have a row per token slot
            ([key.tokens]: the step's tokens in plan order, then padding).
        """
        inputs = self._inputs(key)
        inputs.upload(key.seqs)
        if ids_from is not None:
            inputs.input_ids[:ids_from.shape[0]].copy_(ids_from)
        self._graphs[key].replay()
        self.replays[key] += 1
        if key.verify:
            return self._logits[key], self._greedy[key]
        return self._logits[key][:n], self._greedy[key][:n]
