"""ModelRunner: turns a StepPlan into flat step inputs, runs the model and samples. Synchronous, one thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from voltserve.backends.base import ROWS_AS_DECODES_MAX_QUERY, AttentionMetadata, Backend, StepInputs
from voltserve.request import MAX_LOGPROBS, TokenLogprob
from voltserve.sampling import SampleRow, generator_on, sample
from voltserve.scheduler import StepPlan
from voltserve.sequence import Sequence
from voltserve.spec.verify import accept_checked, accept_greedy, verify_greedy, verify_sampled_many
from voltserve.transfer import indices_to_device

logger = logging.getLogger(__name__)


@dataclass
class StepHandle:
    """A launched step (`ModelRunner.launch`).

    Attributes:
        plan: the step's plan.
        result: the step's (sampled, logprobs) when it ran synchronously; else None.
        ids_dev: [n] int64 sampled ids on the device (asynchronous steps; valid until the bucket's next replay).
        ids_host: [n] int64 pinned host copy of ids_dev, complete once `done` is.
        done: CUDA event recorded after the copy.
        timer: the busy meter's StepTimer, if one runs.
        extras_host: pinned host copies of the device sampler's (logprobs [n], top_ids [n, 20], top_logprobs
            [n, 20]) when a row asked for logprobs; complete once `done` is.
    """

    plan: StepPlan
    result: tuple[dict[int, int], dict[int, TokenLogprob]] | None = None
    ids_dev: torch.Tensor | None = None
    ids_host: torch.Tensor | None = None
    done: object = None
    timer: object = None
    extras_host: tuple | None = None

    @property
    def is_async(self) -> bool:
        return self.ids_dev is not None


class ModelRunner:
    """Owns the model and the KV tensor of one device.

    Args:
        model: a model with `forward(StepInputs, kv_cache) -> logits` (e.g. LlamaModel).
        backend: the backend the model runs on.
        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] on the backend's device.
        eos_token_ids: ids masked while a sequence is below its min_tokens.
        seed: seed of the generator used by requests without their own seed.
    """

    def __init__(self, model, backend: Backend, kv_cache: torch.Tensor, eos_token_ids: tuple[int, ...],
                 seed: int | None = None, graphs=None):
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.graphs = graphs  # voltserve.graphs.StepGraphs, or None to run every step eagerly
        self.busy_meter = None  # voltserve.gpu_busy.GpuBusyMeter (CUDA only), or None
        self._timer = None  # the meter's StepTimer of the step `execute` runs
        self._ids_host: list[torch.Tensor | None] = [None, None]  # pinned sampled ids of two steps in flight
        self._ids_slot = 0
        self.block_size = kv_cache.shape[3]
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator()
        self._device_generators: dict[torch.device, torch.Generator] = {}  # `_generator_on`
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Lay the plan's tokens out flat (host tensors over numpy arrays): ids, positions, slot mapping, block
        tables, logits rows. Built with numpy and plain lists: this runs once per step, on the step's critical
        path."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        bs = self.block_size
        for e in plan.entries:
            seq = e.seq
            blocks = seq.block_ids
            if e.num_new == 1:  # decode: skip the range loop
                pos = e.start
                ids.append(seq.token_at(pos))
                positions.append(pos)
                slots.append(blocks[pos // bs] * bs + pos % bs)
            elif e.drafts:  # verify: the last token, then the drafts; logits for every row
                end = e.start + e.num_new
                ids.append(seq.token_at(e.start))
                ids.extend(e.drafts)
                positions.extend(range(e.start, end))
                slots.extend(blocks[pos // bs] * bs + pos % bs for pos in range(e.start, end))
                logits_rows.extend(range(query_start[-1], query_start[-1] + e.num_new - 1))
            else:
                end = e.start + e.num_new
                ids.extend(seq.token_ids()[e.start:end])
                positions.extend(range(e.start, end))
                slots.extend(blocks[pos // bs] * bs + pos % bs for pos in range(e.start, end))
            query_start.append(query_start[-1] + e.num_new)
            query_lens.append(e.num_new)
            seq_lens.append(e.start + e.num_new)
            if e.sample:
                logits_rows.append(query_start[-1] - 1)
        max_blocks = max(len(e.seq.block_ids) for e in plan.entries)
        tables = np.full((len(plan.entries), max_blocks), -1, dtype=np.int32)
        for i, e in enumerate(plan.entries):
            tables[i, :len(e.seq.block_ids)] = e.seq.block_ids
        attn = AttentionMetadata(
            query_start_loc=torch.from_numpy(np.array(query_start, dtype=np.int32)),
            seq_lens=torch.from_numpy(np.array(seq_lens, dtype=np.int32)),
            block_tables=torch.from_numpy(tables),
            slot_mapping=torch.from_numpy(np.array(slots, dtype=np.int64)),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            split_decode=1 in query_lens and max(query_lens) > 1,
            # a verify step of short spans (no long prompt chunk beside it): every query row as a decode
            rows_as_decodes=plan.has_drafts and max(query_lens) <= ROWS_AS_DECODES_MAX_QUERY,
        )
        return StepInputs(
            input_ids=torch.from_numpy(np.array(ids, dtype=np.int64)),
            positions=torch.from_numpy(np.array(positions, dtype=np.int64)),
            attn=attn,
            logits_indices=torch.from_numpy(np.array(logits_rows, dtype=np.int64)),
        )

    def to_device(self, step: StepInputs) -> StepInputs:
        """The same step with its tensors on the backend's device (host-side length lists kept)."""
        dev = self.backend.device
        if dev.type == "cpu":
            return step
        a = step.attn
        attn = AttentionMetadata(a.query_start_loc.to(dev), a.seq_lens.to(dev), a.block_tables.to(dev),
                                 a.slot_mapping.to(dev), a.max_query_len, a.max_seq_len, a.query_lens_cpu,
                                 a.seq_lens_cpu, a.split_decode, rows_as_decodes=a.rows_as_decodes)
        return StepInputs(step.input_ids.to(dev), step.positions.to(dev), attn, step.logits_indices.to(dev))

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Run a prepared step eagerly (steps a captured graph takes replay it instead: `execute`).

        Returns:
            logits [num_logits, vocab] in the backend dtype.
        """
        return self.model.forward(self.to_device(step), self.kv_cache)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
        """Run one step. Returns (seq_id -> sampled token, seq_id -> TokenLogprob for those that asked)."""
        self._timer = None
        try:
            result = self._execute(plan)  # starts the meter right before its first launch
        except BaseException:
            self._timer = None  # a failed step is not timed (its events may never complete)
            raise
        if self._timer is not None:
            self.busy_meter.account(self._timer, len(plan.entries), plan.num_tokens)
            self._timer = None
        return result

    def _begin_timer(self) -> None:
        if self.busy_meter is not None:
            self._timer = self.busy_meter.begin()

    def _end_timer(self) -> None:
        if self._timer is not None:
            self.busy_meter.end(self._timer)

    # -- asynchronous scheduling: launch a step, plan the next, then collect ----------------------------------

    def ahead_admission(self) -> tuple[int, Callable[[Sequence], bool] | None]:
        """What a step planned ahead may start (`Scheduler(ahead_prefill_tokens=, ahead_admissible=)`): prompts
        of up to the largest mixed graph's query tokens in all, of sequences the device samples (`launch` runs
        such a step asynchronously); (0, None) without mixed graphs."""
        g = self.graphs
        if g is None or not g.prefill_buckets:
            return 0, None
        return g.prefill_buckets[-1], _device_sampleable if hasattr(self.backend, "sample") else _plain_greedy

    def async_sampler(self, plan: StepPlan) -> str | None:
        """How `launch` runs `plan` asynchronously (so a step planned ahead can be fed from it), or None when it
        runs it at once: a step of a captured graph (decode or mixed, `StepGraphs.plan_key`) whose every entry
        samples, on the device and without host state, "greedy" (the graph's own argmax) or "device"
        (`CudaBackend.sample`: no penalties, no min_tokens masking due)."""
        g = self.graphs
        if g is None or plan.has_drafts or not all(e.sample for e in plan.entries) \
                or g.plan_key(plan.entries) is None:
            return None
        if all(_plain_greedy(e.seq) for e in plan.entries):
            return "greedy"
        if hasattr(self.backend, "sample") and all(_device_sampleable(e.seq) for e in plan.entries):
            return "device"
        return None

    @torch.inference_mode()
    def launch(self, plan: StepPlan, feed: StepHandle | None = None) -> StepHandle:
        """Start a step and return without waiting for it; `collect` gives its results.

        Args:
            plan: the step; run asynchronously when `async_sampler(plan)` names a sampler, else at once
                (`execute`).
            feed: an asynchronous step just launched whose sampled ids are the input ids of this step's first
                entries (`plan` comes from `Scheduler.schedule_ahead` of feed's plan: feed's sequences in the same
                order, less those that finished, one decode token each, then any sequences it admitted). The ids
                go device to device; the host never sees them before this step starts.
        Raises:
            ValueError: `feed` is given but this step cannot run asynchronously or its rows differ.
        """
        sampler = self.async_sampler(plan)
        if feed is None and sampler is None:
            return StepHandle(plan, result=self.execute(plan))
        entries = plan.entries
        n = len(entries)
        fed, ids_from = 0, None
        if feed is not None:
            rows = {e.seq.seq_id: i for i, e in enumerate(feed.plan.entries)}
            while fed < n and entries[fed].seq.seq_id in rows:
                fed += 1
            src = [rows[e.seq.seq_id] for e in entries[:fed]]
            if feed.ids_dev is None or sampler is None or not fed or any(e.num_new != 1 for e in entries[:fed]) \
                    or any(e.seq.seq_id in rows for e in entries[fed:]):
                raise ValueError("a fed step must be a graph step whose first entries decode sequences of the "
                                 "feeding step")
            ids_from = feed.ids_dev
            if src != list(range(len(rows))):  # some finished meanwhile: gather the ids of the others
                # the index goes up from pinned memory without a host sync (a pageable copy would wait for the
                # step in flight); the caching host allocator keeps the buffer until the copy is done
                index, = indices_to_device(ids_from.device, src)
                ids_from = ids_from[index]
        seqs = [e.seq for e in entries]
        offsets = [s.philox_offset for s in seqs]
        for s in seqs:  # one Philox counter per sampled token, as in execute
            s.philox_offset += 1
        g = self.graphs
        key = g.plan_key(entries)
        g.fill(key, entries, fed)
        timer = self.busy_meter.begin() if self.busy_meter is not None else None
        logits, ids = g.replay(key, n, ids_from=ids_from)
        extras_dev = None
        if sampler == "device":
            ids, lp, top_ids, top_lps = self._launch_device_sampler(logits, seqs, offsets)
            if any(s.params.logprobs is not None for s in seqs):
                extras_dev = (lp, top_ids, top_lps)
        self._ids_slot ^= 1
        host = self._ids_host[self._ids_slot]
        if host is None:
            host = self._ids_host[self._ids_slot] = torch.empty(g.buckets[-1], dtype=torch.int64).pin_memory()
        host[:n].copy_(ids, non_blocking=True)
        extras_host = None
        if extras_dev is not None:
            extras_host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in extras_dev)
            for h, d in zip(extras_host, extras_dev):
                h.copy_(d, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        if timer is not None:
            self.busy_meter.end(timer)
        return StepHandle(plan, ids_dev=ids, ids_host=host[:n], done=done, timer=timer, extras_host=extras_host)

    def collect(self, handle: StepHandle) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
        """Wait for a launched step; returns what `execute` returns."""
        if handle.result is not None:
            return handle.result
        handle.done.synchronize()
        tokens = handle.ids_host.tolist()
        if handle.timer is not None:
            self.busy_meter.account(handle.timer, len(handle.plan.entries), handle.plan.num_tokens)
        seqs = [e.seq for e in handle.plan.entries]
        sampled = {s.seq_id: t for s, t in zip(seqs, tokens)}
        if handle.extras_host is None:
            return sampled, {}
        return sampled, _token_logprobs(seqs, tokens, *handle.extras_host)

    @torch.inference_mode()
    def logits(self, plan: StepPlan, ids_from: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step (a graph replay where one takes it) and return its logits without sampling: [one row per
        sampling entry, vocab] in the backend dtype, on the device, no host sync (a draft model's sampled
        drafts, `voltserve.spec.draft_model`). Plans without drafts only.

        ids_from: [len(plan.entries)] int64 on the device, the input ids of a decode step (one token an entry)
            that the host does not know yet (the drafts sampled from the step before); needs a graph for the
            step (`can_feed`).
        Raises:
            ValueError: a plan with drafts, or ids_from for a step `can_feed` refuses.
        """
        if plan.has_drafts:
            raise ValueError("logits() takes plans without drafts")
        self._timer = None
        if ids_from is None:
            return self._step_logits(plan)[0]
        if not self.can_feed(plan) or ids_from.shape[0] != len(plan.entries):
            raise ValueError("logits(ids_from=) takes a decode step of a captured graph, an id per entry")
        key = self.graphs.plan_key(plan.entries)
        self.graphs.fill(key, plan.entries, len(plan.entries))
        return self.graphs.replay(key, len(plan.entries), ids_from=ids_from)[0]

    def can_feed(self, plan: StepPlan) -> bool:
        """Whether `logits(plan, ids_from=)` takes `plan`: a decode step (one token an entry) a graph runs."""
        return (self.graphs is not None and not plan.has_drafts and all(e.num_new == 1 for e in plan.entries)
                and self.graphs.plan_key(plan.entries) is not None)

    def _execute(self, plan: StepPlan) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
        logits, greedy_ids = self._step_logits(plan)
        if plan.has_drafts:
            return self._sample_verify(plan, logits, greedy_ids)
        return self._sample(plan, logits, greedy_ids)

    def _step_logits(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits rows (`prepare`'s) and, from a graph, their argmax (else None)."""
        g = self.graphs
        key = None
        if g is not None:  # a verify step needs every drafted row's logits: a verify graph's, else eager
            key = g.verify_key(plan.entries) if plan.has_drafts else g.plan_key(plan.entries)
        if key is not None:
            g.fill(key, plan.entries)  # no StepInputs on the graph path
            self._begin_timer()
            logits, greedy_ids = g.replay(key, len(plan.entries))
            rows = _verify_rows(plan) if key.verify else [i for i, e in enumerate(plan.entries) if e.sample]
            if key.verify or (rows and len(rows) < len(plan.entries)):  # keep the rows `prepare` would give
                logits, greedy_ids = _take_rows(logits, rows, greedy_ids)
        else:
            step = self.prepare(plan)
            self._begin_timer()
            logits, greedy_ids = self.forward(step), None
        return logits, greedy_ids

    def _sample_verify(self, plan: StepPlan, logits: torch.Tensor, greedy_ids: torch.Tensor | None
                       ) -> tuple[dict, dict[int, TokenLogprob]]:
        """Sample a verify step's rows (`prepare`'s: one row a sampling entry, 1 + len(drafts) for an entry with
        drafts; greedy_ids: their argmax from a verify graph, or None): all-greedy spans from one host copy of the
        argmax; on a GPU, spans of drafts proposed for certain (n-gram) in one device sampler launch with the
        plain entries it takes (`_verify_on_device`); else through `voltserve.spec.verify` where the logits
        are, with one host copy of their tokens. Other plain entries as `_sample` does."""
        plain, spans, row = [], [], 0  # (entry, its first row)
        for e in plan.entries:
            if e.drafts:
                spans.append((e, row))
                row += e.num_new
            elif e.sample:
                plain.append((e, row))
                row += 1
        all_greedy = all(e.seq.params.is_greedy for e, _ in spans)
        on_device = not all_greedy and hasattr(self.backend, "sample_verify") \
            and all(e.draft_probs is None for e, _ in spans)
        riders, rest = [], []  # plain entries that join the device launch, and the others
        for e, r in plain:
            (riders if on_device and _rides_along(e.seq) else rest).append((e, r))
        sampled, lps = {}, {}
        if rest:
            sampled, lps = self._sample(StepPlan([e for e, _ in rest]),
                                        *_take_rows(logits, [r for _, r in rest], greedy_ids))
        if all_greedy:  # one host copy of every argmax
            targets = greedy_ids if greedy_ids is not None else logits.argmax(-1)
            self._end_timer()
            targets = targets.tolist()
            for e, r in spans:
                sampled[e.seq.seq_id] = accept_greedy(targets[r:r + e.num_new], list(e.drafts))
            return sampled, lps
        if on_device:
            sampled.update(self._verify_on_device(logits, spans, riders))
            return sampled, lps
        # the drafted spans verified where the logits are, all sampled ones at once, every span's tokens back in
        # one host copy
        sampled_spans, at = [], 0  # (entry, its first row, its first draft)
        for e, r in spans:
            if not e.seq.params.is_greedy:
                sampled_spans.append((e, r, at))
            at += len(e.drafts)
        # the drafts and the sampled spans' rows go up in one copy
        drafts, rows = indices_to_device(logits.device, [t for e, _ in spans for t in e.drafts],
                                         [i for e, r, _ in sampled_spans for i in range(r, r + len(e.drafts) + 1)])
        width = max(e.num_new for e, _ in spans)  # tokens a span may emit
        results, at = [], 0
        for e, r in spans:
            k = len(e.drafts)
            if e.seq.params.is_greedy:
                tokens, accepted = verify_greedy(greedy_ids[r:r + k + 1] if greedy_ids is not None
                                                 else logits[r:r + k + 1], drafts[at:at + k])
                results.append(torch.cat([accepted.view(1), tokens, tokens.new_zeros(width - k - 1)]))
            at += k
        if sampled_spans:
            d = torch.cat([drafts[at:at + len(e.drafts)] for e, _, at in sampled_spans])
            # the engine's generator: seeded sampled requests are never drafted (`verify.draftable`)
            tokens, accepted = verify_sampled_many(
                logits.index_select(0, rows), d, [len(e.drafts) for e, _, _ in sampled_spans],
                [e.seq.params for e, _, _ in sampled_spans], self._generator_on(logits.device),
                [e.draft_probs for e, _, _ in sampled_spans])
            results.append(torch.cat([accepted.view(-1, 1), tokens, tokens.new_zeros(len(sampled_spans),
                                                                                     width - tokens.shape[1])], 1))
        self._end_timer()
        host = torch.cat([t.view(-1, width + 1) for t in results]).tolist()  # [accepted, tokens..., padding]
        order = [e for e, _ in spans if e.seq.params.is_greedy] + [e for e, _, _ in sampled_spans]
        for e, out in zip(order, host):
            sampled[e.seq.seq_id] = out[1:out[0] + 2]
        return sampled, lps

    def _verify_on_device(self, logits: torch.Tensor, spans: list, riders: list) -> dict[int, list[int] | int]:
        """Check drafts proposed for certain on the device: spans and riders are (entry, its first row of logits
        [rows, vocab]), the spans' entries with drafts, the riders' plain sampling entries (no logprobs). One
        `CudaBackend.sample_verify` launch over their rows (greedy ones at temperature 0) and one host copy.
        Row i of an entry uses Philox counter philox_offset + i; the offset then moves past its rows.

        Returns:
            seq_id -> the tokens a span emits (`accept_checked`), or a rider's sampled token.
        """
        rows, params = [], []
        for e, r in [*spans, *riders]:
            s, k = e.seq, len(e.drafts)
            params += [_row_params(s, s.philox_offset + i, e.drafts[i] if i < k else -1) for i in range(k + 1)]
            rows.extend(range(r, r + k + 1))
            s.philox_offset += k + 1
        checked = self.backend.sample_verify(_take_rows(logits, rows), params)
        self._end_timer()
        tokens, passed = checked.tolist()
        out, at = {}, 0
        for e, _ in spans:
            k = len(e.drafts)
            out[e.seq.seq_id] = accept_checked(e.drafts, passed[at:at + k], tokens[at:at + k + 1])
            at += k + 1
        for e, _ in riders:
            out[e.seq.seq_id] = tokens[at]
            at += 1
        return out

    def _generator_on(self, device: torch.device) -> torch.Generator:
        """The engine's generator for requests without a seed, on `device` (an engine seed fixes both)."""
        return generator_on(device, self.generator, self._device_generators)

    def _sample(self, plan: StepPlan, logits: torch.Tensor, greedy_ids: torch.Tensor | None
                ) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
        """Sample the step's logits [sampling entries, vocab] (greedy_ids: the graph's argmax of each, or None)."""
        sampling = [e.seq for e in plan.entries if e.sample]
        if not sampling:
            return {}, {}
        vocab = logits.shape[-1]
        rows = [SampleRow(s.params, s.generator, s.prompt_ids, s.output_ids, self.eos_token_ids,
                          s.grammar.allowed(vocab) if s.grammar is not None else None) for s in sampling]
        offsets = [s.philox_offset for s in sampling]
        for s in sampling:  # one Philox counter per sampled token, whichever path samples it
            s.philox_offset += 1
        if logits.is_cuda and hasattr(self.backend, "sample_greedy") and all(_plain_greedy(r) for r in rows):
            ids = greedy_ids if greedy_ids is not None else self.backend.sample_greedy(logits.contiguous())[0]
            self._end_timer()
            # only the ids cross to the host
            return {s.seq_id: t for s, t in zip(sampling, ids.tolist())}, {}
        # route each row by its own parameters only, so a seeded request samples the same way whatever else is
        # in the batch (case R1): supported rows on the device (Philox), the rest on the host (torch.Generator)
        on_device = [logits.is_cuda and hasattr(self.backend, "sample") and _device_supported(r) for r in rows]
        sampled: dict[int, int] = {}
        lps: dict[int, TokenLogprob] = {}
        dev_idx = [i for i, d in enumerate(on_device) if d]
        if dev_idx:
            d_sampled, d_lps = self._sample_on_device(logits[dev_idx], [sampling[i] for i in dev_idx],
                                                      [offsets[i] for i in dev_idx])
            sampled.update(d_sampled)
            lps.update(d_lps)
        host_idx = [i for i, d in enumerate(on_device) if not d]
        self._end_timer()  # no-op after _sample_on_device's; the host sampler has no device work
        if host_idx:
            tokens, logprobs = sample(logits[host_idx].float().cpu(), [rows[i] for i in host_idx], self.generator)
            for i, t, lp in zip(host_idx, tokens, logprobs):
                sampled[sampling[i].seq_id] = t
                if lp is not None:
                    lps[sampling[i].seq_id] = lp
        return sampled, lps

    def _launch_device_sampler(self, logits: torch.Tensor, seqs: list, offsets: list[int]):
        """Launch CudaBackend.sample on logits [len(seqs), vocab] (CUDA); row i uses Philox key
        seqs[i].philox_seed and counter offsets[i]. Returns its device tensors (ids, logprobs, top_ids,
        top_logprobs) without a host sync."""
        params = [_row_params(s, off, num_logprobs=s.params.logprobs or 0) for s, off in zip(seqs, offsets)]
        ids, lp, (top_ids, top_lps) = self.backend.sample(logits.contiguous(), params)
        return ids, lp, top_ids, top_lps

    def _sample_on_device(self, logits: torch.Tensor, seqs: list, offsets: list[int]
                          ) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
        """Device sampling of logits [len(seqs), vocab] and the host copy of its results (a sync)."""
        ids, lp, top_ids, top_lps = self._launch_device_sampler(logits, seqs, offsets)
        self._end_timer()
        tokens = ids.tolist()
        sampled = {s.seq_id: t for s, t in zip(seqs, tokens)}
        if all(s.params.logprobs is None for s in seqs):
            return sampled, {}
        return sampled, _token_logprobs(seqs, tokens, lp, top_ids, top_lps)


def _take_rows(t: torch.Tensor, rows: list[int], *more: torch.Tensor | None):
    """t[rows] for t [n, ...] (any dtype and device), and each of `more` ([n, ...] too, or None: None) at the
    same rows, as a tuple: a view where rows are consecutive, else a gather whose index goes up in one copy."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        taken = [x[rows[0]:rows[0] + len(rows)] if x is not None else None for x in (t, *more)]
    else:
        index, = indices_to_device(t.device, rows)
        taken = [x[index] if x is not None else None for x in (t, *more)]
    return tuple(taken) if more else taken[0]


def _row_params(seq, offset: int, draft: int = -1, num_logprobs: int = 0):
    """The device sampler's row (`backends.cuda.params.SampleRowParams`) for a token of `seq` at Philox counter
    `offset`: its seed and sampling parameters (temperature 0 when greedy), `draft` (< 0: none) and the top
    alternatives it wants."""
    from voltserve.backends.cuda.params import SampleRowParams  # ctypes only; no CUDA import

    p = seq.params
    return SampleRowParams(seq.philox_seed & _U64, offset & _U64, 0.0 if p.is_greedy else p.temperature, p.top_p,
                           p.min_p, max(p.top_k, 0), num_logprobs, draft)


def _verify_rows(plan: StepPlan) -> list[int]:
    """A verify graph's rows (its token slots, in plan order) that `prepare` would give logits for: every row of an
    entry with drafts, the last row of another sampling entry."""
    rows, start = [], 0
    for e in plan.entries:
        if e.drafts:
            rows.extend(range(start, start + e.num_new))
        elif e.sample:
            rows.append(start + e.num_new - 1)
        start += e.num_new
    return rows


def _token_logprobs(seqs: list, tokens: list[int], lp: torch.Tensor, top_ids: torch.Tensor,
                    top_lps: torch.Tensor) -> dict[int, TokenLogprob]:
    """TokenLogprob of each sequence that asked for logprobs, from the device sampler's results (host tensors:
    lp [n] fp32, top_ids [n, 20] int64, top_lps [n, 20] fp32; or device tensors, read with a sync)."""
    lp_l, tid_l, tlp_l = lp.tolist(), top_ids.tolist(), top_lps.tolist()
    lps = {}
    for i, s in enumerate(seqs):
        k = s.params.logprobs
        if k is not None:
            lps[s.seq_id] = TokenLogprob(tokens[i], lp_l[i], tuple(zip(tid_l[i][:k], tlp_l[i][:k])))
    return lps


_U64 = (1 << 64) - 1


def _device_params_ok(p) -> bool:
    """SamplingParams CudaBackend.sample takes: no penalties, logprobs <= 20, no grammar (its mask is the
    host's)."""
    return not p.has_penalties and (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS) and p.grammar is None


def _device_supported(row: SampleRow) -> bool:
    """Rows CudaBackend.sample handles: `_device_params_ok`, no min_tokens masking."""
    p = row.params
    masked = len(row.output_ids) < p.min_tokens and (row.eos_token_ids or p.stop_token_ids)
    return not masked and _device_params_ok(p)


def _device_sampleable(seq) -> bool:
    """_device_supported for a sequence's next token, decided from the sequence alone (no min_tokens masking
    due: min_tokens is met already, and stays met for later tokens)."""
    return len(seq.output_ids) >= seq.params.min_tokens and _device_params_ok(seq.params)


def _rides_along(seq) -> bool:
    """A plain sampling entry of a verify step that joins its drafts' `sample_verify` launch: the device
    sampler takes it as it is (`_device_sampleable`) and it wants no logprobs (that launch returns none)."""
    return seq.params.logprobs is None and _device_sampleable(seq)


def _plain_greedy(row) -> bool:
    """A SampleRow, or a Sequence's next token, that the greedy argmax alone samples: no penalties, no logprobs,
    min_tokens met (it stays met for later tokens)."""
    p = row.params
    return (p.is_greedy and not p.has_penalties and p.logprobs is None and len(row.output_ids) >= p.min_tokens
            and p.grammar is None)
