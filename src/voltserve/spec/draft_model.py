"""Draft-model drafter: a smaller model with the target's tokenizer proposes the next k tokens.

Each drafted sequence has a shadow in the draft model's own paged KV cache: a `Sequence` whose tokens are the
target's tokens and its last proposal, of which the first `num_computed_tokens` have their K/V written. Before a
step, `prepare` brings every wanted shadow up to its target sequence (one catch-up forward over the tokens the
target accepted since, the first draft sampled from its last row), then decodes the other k - 1 drafts one
token a step for all shadows at once, through the draft's own `ModelRunner`: on a GPU its steps replay the
draft's CUDA graphs and each decode step takes its input ids from the step before on the device
(`ModelRunner.launch(feed=)`), two steps in flight, so the device runs them back to back. The drafts of
a rejected tail are overwritten by the next catch-up: only the prefix the shadow shares with the target is
kept.

A greedy request's drafts are the draft model's argmax, one token for certain (q a point mass). A sampled
request's are drawn from the draft model's distribution q under the request's temperature, top-k, top-p and
min-p, one step at a time, and q goes with them to the verify, which accepts a draft with probability
min(1, p / q) and samples a rejection from max(p - q, 0) (`voltserve.spec.verify.verify_sampled`): the output
keeps the target's distribution, and a draft model close to the target passes most drafts. This is speculative
decoding as Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et al.
2023 ("Accelerating Large Language Model Decoding with Speculative Sampling") give it; vLLM's `draft_model`
method.
"""

from __future__ import annotations

import torch

from voltserve.kv_cache import BlockPool
from voltserve.request import SamplingParams
from voltserve.sampling import generator_on
from voltserve.scheduler import ScheduledSeq, StepPlan
from voltserve.sequence import Sequence, SequenceStatus
from voltserve.spec.verify import exponential_race, sampling_distribution
from voltserve.transfer import indices_to_device

_GREEDY = SamplingParams(temperature=0.0)
_UNKNOWN = -1  # a draft launched and not collected yet (its step fed the next one on the device)


class DraftModelDrafter:
    """Proposes up to k tokens per sequence with a draft model, keeping each sequence's draft K/V.

    `prepare` runs the draft model and must be called, on the thread that owns the device, before the
    `Scheduler.schedule()` whose drafts it computes (`Scheduler.draft_work` says for which sequences; the
    scheduler actor and `voltserve.offline.run_steps` do this); `propose` then hands out the drafts.

    Args:
        runner: the draft model's `voltserve.runner.ModelRunner` (its own KV cache; CUDA graphs optional).
        pool: the BlockPool of the draft's KV cache (its blocks are the shadows'; with prefix caching on, full
            blocks of target tokens are shared between shadows, as the target's are between sequences).
        num_drafts: the most tokens proposed at once (k).
        vocab_size: the target's vocabulary: a draft id at or above it ends the proposal (padded vocabularies).
        max_chunk_tokens: the most tokens one catch-up forward computes (long prompts take several).
        draft_vocab_size: the draft model's embedding rows (default: vocab_size): a sequence holding a token id at
            or above it (a tokenizer's id the smaller model's padded vocabulary lacks) is never drafted.
    Raises:
        ValueError: num_drafts < 1 or max_chunk_tokens < 1.
    """

    needs_prepare = True

    def __init__(self, runner, pool: BlockPool, num_drafts: int, vocab_size: int, max_chunk_tokens: int = 2048,
                 draft_vocab_size: int | None = None):
        if num_drafts < 1 or max_chunk_tokens < 1:
            raise ValueError(f"bad draft-model drafter settings: num_drafts {num_drafts}, "
                             f"max_chunk_tokens {max_chunk_tokens}")
        self.runner = runner
        self.pool = pool
        self.block_size = pool.block_size
        self.num_drafts = num_drafts
        self.vocab_size = vocab_size
        self.max_chunk_tokens = max_chunk_tokens
        self.draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        self._undraftable: set[int] = set()  # seq_ids holding a token the draft model cannot read
        self._probs: dict[int, tuple] = {}  # target seq_id -> q of each draft of a sampled request
        self.generator = torch.Generator()  # draws sampled requests' drafts (never seeded ones: not draftable)
        self.generator.seed()
        self._device_generators: dict[torch.device, torch.Generator] = {}  # `_generator_on`
        # target seq_id -> [target, shadow, base]: base = the target's length at the last sync (tokens the shadow
        # holds for certain: a target only grows)
        self._shadows: dict[int, list] = {}
        self._ready: dict[int, list[int]] = {}  # target seq_id -> drafts of the coming step
        self.num_forwards = 0  # draft model steps run (catch-up chunks and decode steps)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """The drafts `prepare` computed for `seq` (at most k); [] when it computed none."""
        return self._ready.pop(seq.seq_id, [])[:min(k, self.num_drafts)]

    def proposal_probs(self, seq: Sequence, n: int) -> tuple | None:
        """q of the first n drafts `propose` gave `seq` (a sampled request's: the distributions they were drawn
        from, [vocab] fp32 each on the draft model's device), or None (a greedy request's: proposed for certain)."""
        probs = self._probs.pop(seq.seq_id, None)
        return None if probs is None else probs[:n]

    def prepare(self, wanted: list[tuple[Sequence, int]]) -> None:
        """Compute the drafts of the coming step: up to k tokens for each (sequence, k) of `wanted`.

        A sequence whose shadow cannot get the blocks it needs gets no drafts this step (shadows of sequences not
        wanted now are freed first to make room). Drafts left over from an earlier call are dropped. Shadows of
        sequences that stop running go in `forget`, which the scheduler calls.
        """
        self._ready.clear()
        self._probs.clear()
        keep = {seq.seq_id for seq, _ in wanted}
        jobs: list[tuple[Sequence, Sequence, int, int]] = []  # (target, shadow, k, target length)
        for seq, k in wanted:
            k = min(k, self.num_drafts)
            if k < 1:
                continue
            if seq.seq_id in self._undraftable:
                continue
            tokens = seq.token_ids()
            entry = self._entry(seq, tokens)
            shadow = entry[1]
            if max(tokens[entry[2]:], default=0) >= self.draft_vocab_size:  # the tokens new since the last sync
                self._free(seq.seq_id)
                self._undraftable.add(seq.seq_id)
                continue
            _sync(shadow, tokens, entry[2])
            entry[2] = len(tokens)
            # the last draft's K/V is never written: positions up to len(tokens) + k - 2
            if not self._grow(shadow, len(tokens) + k - 1, keep):
                continue
            jobs.append((seq, shadow, k, len(tokens)))
        if not jobs:
            return
        greedy = [job for job in jobs if job[0].params.is_greedy]
        if greedy:
            self._run_chain(self._steps(greedy))
        if len(greedy) < len(jobs):
            self._run_sampled([job for job in jobs if not job[0].params.is_greedy])
        for seq, shadow, _, length in jobs:
            self._publish(shadow, length)
            drafts = shadow.prompt_ids[length:]
            cut = next((i for i, t in enumerate(drafts) if t >= self.vocab_size), len(drafts))
            self._ready[seq.seq_id] = drafts[:cut]
            if seq.seq_id in self._probs:
                self._probs[seq.seq_id] = tuple(self._probs[seq.seq_id][:cut])

    def forget(self, seq: Sequence) -> None:
        """Free `seq`'s shadow (the scheduler calls this when it frees seq's own blocks: finished, preempted)."""
        entry = self._shadows.get(seq.seq_id)
        if entry is not None and entry[0] is seq:
            self._free(seq.seq_id)
        self._ready.pop(seq.seq_id, None)
        self._probs.pop(seq.seq_id, None)
        self._undraftable.discard(seq.seq_id)

    def release_all(self) -> None:
        """Free every shadow's blocks (the engine stops, or a test checks for leaks)."""
        for seq_id in list(self._shadows):
            self._free(seq_id)
        self._ready.clear()
        self._probs.clear()
        self._undraftable.clear()

    # -- internals ----------------------------------------------------------------------------------------

    def _steps(self, jobs):
        """The draft forwards of `prepare`, each a list of ScheduledSeq built once the one before is launched:
        the catch-up, in forwards of at most max_chunk_tokens tokens (a shadow's tail chunk samples its first
        draft), then decode steps, each feeding every shadow still short of its k its latest draft."""
        pending = [shadow for _, shadow, _, _ in jobs]
        while pending:
            entries, budget, later = [], self.max_chunk_tokens, []
            for shadow in pending:
                left = shadow.num_tokens - shadow.num_computed_tokens
                if budget < 1:
                    later.append(shadow)
                    continue
                n = min(left, budget)
                entries.append(ScheduledSeq(shadow, shadow.num_computed_tokens, n, n == left))
                budget -= n
                if n < left:
                    later.append(shadow)
            yield entries
            pending = later
        for step in range(1, max(k for _, _, k, _ in jobs)):
            yield [ScheduledSeq(shadow, shadow.num_tokens - 1, 1, True) for _, shadow, k, _ in jobs if k > step]

    def _run_chain(self, steps) -> None:
        """Launch the steps in order, two in flight at most: where the runner can (a greedy graph step after an
        asynchronous one, `ModelRunner.launch(feed=)`), a decode step takes its input ids from the step before on
        the device and that step is collected after it is launched, so the device runs the draft's steps back to
        back; otherwise the step before is collected first (its tokens are this step's inputs)."""
        prev = None  # (plan, handle) launched and not collected
        for entries in steps:
            plan = StepPlan(entries)
            feed = None
            if prev is not None:
                rows = {e.seq.seq_id for e in prev[0].entries if e.sample}
                if (prev[1].is_async and all(e.num_new == 1 and e.seq.seq_id in rows for e in entries)
                        and self.runner.async_sampler(plan) is not None):
                    feed = prev[1]
                else:
                    self._collect(*prev)
                    prev = None
            handle = self.runner.launch(plan, feed=feed)
            self.num_forwards += 1
            for e in entries:  # the sampled token's place, filled by _collect
                e.seq.num_computed_tokens = e.start + e.num_new
                if e.sample:
                    e.seq.prompt_ids.append(_UNKNOWN)
            if prev is not None:
                self._collect(*prev)
            prev = (plan, handle)
        if prev is not None:
            self._collect(*prev)

    def _run_sampled(self, jobs) -> None:
        """The steps of sampled requests: each draft is drawn from q, the draft model's distribution under the
        request's own temperature, top-k, top-p and min-p, and q is kept for the verify (speculative sampling: a
        draft then passes with probability min(1, p / q), `voltserve.spec.verify.verify_sampled`).

        q is computed and drawn from where the logits are, with no host sync (`verify.exponential_race`): where
        the runner can (`ModelRunner.can_feed`: a decode step over a CUDA graph), a decode step takes the drafts
        just drawn as its input ids on the device, so the steps of a prepare run back to back and one host copy at
        the end brings every draft back; otherwise the drafts drawn so far come back first (their ids are the
        step's inputs)."""
        params = {seq.seq_id: seq.params for seq, _, _, _ in jobs}
        drawn: list[tuple[list[tuple[Sequence, int]], torch.Tensor]] = []  # ((shadow, draft's place) each, the
        # drafts on the device) of the steps whose drafts the host has not read yet
        last: dict[int, int] = {}  # shadow seq_id -> its row in drawn[-1]
        for entries in self._steps(jobs):
            plan = StepPlan(entries)
            ids_from = None
            if drawn and all(e.seq.seq_id in last for e in entries) and self.runner.can_feed(plan):
                ids_from = drawn[-1][1]
                rows = [last[e.seq.seq_id] for e in entries]
                if rows != list(range(ids_from.shape[0])):  # some shadows have all their drafts already
                    ids_from = ids_from[indices_to_device(ids_from.device, rows)[0]]
            else:
                self._read_drafts(drawn)
            # the sampling entries' rows, in order
            logits = self.runner.logits(plan) if ids_from is None else self.runner.logits(plan, ids_from=ids_from)
            self.num_forwards += 1
            shadows = []
            for e in entries:
                e.seq.num_computed_tokens = e.start + e.num_new
                if e.sample:
                    shadows.append((e.seq, len(e.seq.prompt_ids)))
                    e.seq.prompt_ids.append(_UNKNOWN)
            last = {shadow.seq_id: i for i, (shadow, _) in enumerate(shadows)}
            if shadows:
                # q of every row at once, over the target's ids only: a draft past them would be cut, and a draft
                # that exists only for some values of the draw would not follow q
                q = sampling_distribution(logits[:, :self.vocab_size].float(),
                                          [params[shadow.seq_id] for shadow, _ in shadows])
                drawn.append((shadows, exponential_race(q, self._generator_on(logits.device))))
                for (shadow, _), q_row in zip(shadows, q):
                    self._probs.setdefault(shadow.seq_id, []).append(q_row)
        self._read_drafts(drawn)

    @staticmethod
    def _read_drafts(drawn: list) -> None:
        """Bring the drafts drawn on the device to their shadows' places (one host copy); empties `drawn`."""
        if not drawn:
            return
        tokens = iter(torch.cat([ids for _, ids in drawn]).tolist())
        for shadows, _ in drawn:
            for shadow, place in shadows:
                shadow.prompt_ids[place] = next(tokens)
        drawn.clear()

    def _generator_on(self, device: torch.device) -> torch.Generator:
        """The drafter's generator on `device`, following `self.generator` (seeded requests are never drafted)."""
        return generator_on(device, self.generator, self._device_generators)

    def _collect(self, plan: StepPlan, handle) -> None:
        sampled, _ = self.runner.collect(handle)
        for e in plan.entries:
            if e.sample:
                e.seq.prompt_ids[e.start + e.num_new] = sampled[e.seq.seq_id]

    def _entry(self, seq: Sequence, tokens: list[int]) -> list:
        """seq's [target, shadow, base]; a new sequence's shadow starts with the K/V of the leading full blocks of
        `tokens` (its tokens) that the draft pool's prefix cache holds (`_publish`): a prompt shared by many
        requests, or the choices of one, is computed by the draft model once."""
        entry = self._shadows.get(seq.seq_id)
        if entry is None or entry[0] is not seq:
            if entry is not None:
                self._free(seq.seq_id)
            shadow = Sequence(seq.seq_id, seq.request_id, seq.index, tokens, _GREEDY, max_tokens=1)
            shadow.status = SequenceStatus.RUNNING
            shadow.block_ids = self.pool.match_prefix(shadow.block_hash_chain, len(tokens))
            del shadow.block_hashes[len(shadow.block_ids):]  # those of its registered blocks: `_publish` goes on
            matched = len(shadow.block_ids) * self.block_size
            shadow.prompt_ids, shadow.num_computed_tokens = tokens[:matched], matched
            entry = self._shadows[seq.seq_id] = [seq, shadow, matched]
        return entry

    def _publish(self, shadow: Sequence, certain: int) -> None:
        """Register the shadow's full blocks of target tokens (the first `certain` positions; never drafts, which
        a verify may reject and the next catch-up overwrite) whose K/V are written, under the prefix hash chain
        the target's blocks use (`voltserve.kv_cache.hash_block`), all but the block of the last one. Published
        blocks are never written again: `_sync` keeps at least the target's previous length less one token."""
        # not the block of the last target token: a prepare before the target grows computes that token again
        full = min(certain - 1, shadow.num_computed_tokens) // self.block_size
        self.pool.publish(shadow.block_ids, shadow.block_hash_chain, len(shadow.block_hashes), full)

    def _grow(self, shadow: Sequence, num_tokens: int, keep: set[int]) -> bool:
        """Blocks for num_tokens positions; frees shadows not in `keep` (least recently made first) when short."""
        need = max(0, -(-num_tokens // self.block_size) - len(shadow.block_ids))
        for seq_id in list(self._shadows):
            if need <= self.pool.num_free:
                break
            if seq_id not in keep:
                self._free(seq_id)
        if need > self.pool.num_free:
            return False
        shadow.block_ids.extend(self.pool.allocate() for _ in range(need))
        return True

    def _free(self, seq_id: int) -> None:
        shadow = self._shadows.pop(seq_id)[1]
        self.pool.free(shadow.block_ids)
        shadow.block_ids = []


def _sync(shadow: Sequence, tokens: list[int], base: int) -> None:
    """Make `shadow` hold `tokens` (the target's, a copy), keeping the K/V of the prefix both share: the drafts
    the target accepted keep theirs, a rejected tail is recomputed. At least the last token is left to compute
    (its row gives the first draft). base: how many leading tokens are known to agree (the target's length at
    the last sync), so only the drafts since are compared."""
    old, have = shadow.prompt_ids, shadow.num_computed_tokens
    limit = min(have, len(tokens) - 1)
    same = min(base, limit)
    while same < limit and old[same] == tokens[same]:
        same += 1
    shadow.prompt_ids = tokens
    shadow.num_computed_tokens = same
