"""Pure scheduling policy: continuous batching, chunked prefill, prefix-cache admission, preemption.

`Scheduler.schedule()` picks the work of one step under a token budget; `Scheduler.update()` applies the step's
sampled tokens and finishes sequences. No I/O, no threads: the SchedulerActor drives it.

Policy (the shape of vLLM v1's scheduler): running sequences first (a decode token or their next prefill chunk),
in arrival order; then waiting sequences FIFO while the budget, `max_num_seqs` and free KV blocks allow. When a
running sequence needs a block and none is free, the most recently admitted running sequence is preempted by
recompute: its blocks are freed (full ones stay findable in the prefix cache) and it goes back to the front of
the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from voltserve.kv_cache import BlockPool
from voltserve.request import FinishReason
from voltserve.sequence import Sequence, SequenceStatus
from voltserve.spec.backoff import DEFAULT_MAX_PAUSE, drafting_paused, record_verify
from voltserve.spec.gate import DraftGate
from voltserve.spec.ladder import DraftLadder
from voltserve.spec.verify import draftable


@dataclass
class ScheduledSeq:
    """One sequence's share of a step.

    Attributes:
        seq: the sequence.
        start: position of its first token in this step (= tokens already in the KV cache).
        num_new: tokens it computes this step (1 for decode).
        sample: whether this step reaches its last known token, so a new token is sampled.
        drafts: draft tokens verified after its last token (speculative decoding; `num_new` = 1 + their number):
            the step then emits 1..len(drafts) + 1 tokens for it (`voltserve.spec.verify`).
        draft_probs: the distribution each draft was sampled from ([vocab] fp32 tensors, on the draft model's
            device; a draft model's drafts of a sampled request), or None: the drafts were proposed for certain.
    """

    seq: Sequence
    start: int
    num_new: int
    sample: bool
    drafts: tuple[int, ...] = ()
    draft_probs: tuple | None = None


@dataclass
class StepPlan:
    """The work of one step, in the order the worker lays the tokens out."""

    entries: list[ScheduledSeq]
    has_drafts: bool = False  # an entry verifies drafts: the runner runs the step eagerly, every row's logits
    # the draft gate's mode for this step (`Scheduler.gate`): True drafts allowed, False held back; None: no gate,
    # or the ladder gives no drafts at this concurrency
    drafts_on: bool | None = None

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new for e in self.entries)

    @property
    def is_decode_only(self) -> bool:
        """Every entry decodes its sequence's last output token (with or without drafts): no prompt chunk."""
        return all(e.start >= len(e.seq.prompt_ids) and e.num_new == 1 + len(e.drafts) for e in self.entries)


class Scheduler:
    """Continuous-batching scheduler over a BlockPool.

    Args:
        pool: the KV block pool (owned by this scheduler).
        max_num_seqs: most running sequences.
        max_num_batched_tokens: token budget of one step.
        max_model_len: context window; a sequence reaching it finishes with "length".
        eos_token_ids: ids that end a sequence unless `ignore_eos`.
        ahead_prefill_tokens: most prompt tokens `schedule_ahead` admits into a step planned ahead (the runner's
            largest mixed graph; 0 = no admission there: a waiting request waits for a synchronous step).
        ahead_admissible: whether a waiting sequence may start in a step planned ahead (the runner samples it on
            the device); None = any.
        admission_wait_steps: how many steps a new request may wait before it starts when starting it would turn
            a decode-only step of running sequences into a mixed one (`_holds_back`); 0 = it starts at once.
            Under a CUDA graph a mixed step costs about the same whether it carries one short prompt or several
            (its graph is padded to a prompt-token bucket), so gathering the requests that arrive within a few
            steps into one mixed step spends fewer of them; each waits at most this many steps (its time to
            first token grows by up to as many step times). The same idea as the max_waiting_tokens of Hugging
            Face text-generation-inference's router.
        drafter: speculative decoding's drafter (`voltserve.spec.ngram.NgramDrafter`: `propose(seq, k)`), or
            None: decoding sequences that may be drafted (`voltserve.spec.verify.draftable`) verify up to
            `ladder.width(running sequences)` drafts a step. Steps are then never planned ahead while such a
            sequence runs, its drafting is not paused and the gate lets it draft (its drafts need the token the
            step before samples).
        ladder: the verify width per concurrency (`voltserve.spec.ladder.DraftLadder`); needed with a drafter.
        draft_max_pause: the longest pause, in output tokens, of a sequence whose drafts keep failing
            (`voltserve.spec.backoff`); 0: it never pauses.
        gate: with a drafter, decides per step whether drafting is on at all, from measured output tokens per
            second (`voltserve.spec.gate.DraftGate`; fed by `record_step`); while it says plain, steps get no
            drafts and are planned ahead like any plain step. None: drafting is always on.
    """

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], ahead_prefill_tokens: int = 0,
                 ahead_admissible: Callable[[Sequence], bool] | None = None, admission_wait_steps: int = 0,
                 drafter=None, ladder: DraftLadder | None = None, draft_max_pause: int = DEFAULT_MAX_PAUSE,
                 gate: DraftGate | None = None):
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.ahead_prefill_tokens = ahead_prefill_tokens
        self.ahead_admissible = ahead_admissible
        self.admission_wait_steps = admission_wait_steps
        self._num_plans = 0  # plans handed out (schedule and schedule_ahead): the clock of admission_wait_steps
        self._added_at: dict[int, int] = {}  # seq_id of a new waiting sequence -> _num_plans when it was added
        if drafter is not None and ladder is None:
            raise ValueError("a drafter needs a ladder (DraftLadder(num_drafts))")
        self.drafter = drafter
        self.ladder = ladder
        self.draft_max_pause = draft_max_pause
        self.gate = gate
        self._forget_drafts = getattr(drafter, "forget", None)
        self._draft_probs = getattr(drafter, "proposal_probs", None)  # q of sampled drafts (a draft model's)
        self.num_verify_steps = 0  # sequence-steps that verified drafts
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # drafts accepted (the acceptance length is 1 + this / num_verify_steps)
        self.num_gate_draft_steps = 0  # steps run with the gate's drafting on
        self.num_gate_plain_steps = 0  # steps the gate held drafts back in (measuring plain, or plain won)

    # -- queue management ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if self.admission_wait_steps:
            self._added_at[seq.seq_id] = self._num_plans

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a sequence now (abort, stop string): frees its blocks. Idempotent."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
            self._added_at.pop(seq.seq_id, None)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    # -- one step -----------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Choose this step's work. Returns an empty plan when nothing can run."""
        budget = self.max_num_batched_tokens
        entries: list[ScheduledSeq] = []
        preempted = False
        i = 0
        width, drafts_on = self._draft_width(len(self.running))
        reserve = self._queue_head_reserve(width)  # drafts never take the budget the queue's head could start with
        # 1) running sequences: one decode token (with drafts to verify) or their next prefill chunk each
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if width and num_new == 1:
                # drafts leave a token of the budget to every running sequence after this one
                spare = budget - (len(self.running) - i) - reserve
                entry = self._draft_entry(seq, min(width, spare)) if spare > 0 else None
                if entry is not None:
                    entries.append(entry)
                    budget -= entry.num_new
                    i += 1
                    continue
            while not self._grow(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            entries.append(self._entry(seq, num_new))
            budget -= num_new
            i += 1
        # 2) waiting sequences, FIFO; none after a preemption (the pool is short)
        if not preempted and not self._holds_back(entries):
            self._admit(entries, budget)
        self._num_plans += 1
        return StepPlan(entries, has_drafts=any(e.drafts for e in entries) if width else False, drafts_on=drafts_on)

    def draft_work(self) -> list[tuple[Sequence, int]]:
        """The (sequence, most drafts) pairs the next `schedule()` asks drafts for, for a drafter that computes
        them beforehand (`needs_prepare`: a draft model, `voltserve.spec.draft_model`); [] for others. Call it
        right before `schedule()` with nothing applied in between, then the drafter's `prepare` with it."""
        if not getattr(self.drafter, "needs_prepare", False):
            return []
        width, _ = self._draft_width(len(self.running))
        # schedule()'s budget walk, every proposal taken whole: a sequence it would give no room gets no drafts
        budget, reserve, wanted, n = self.max_num_batched_tokens, self._queue_head_reserve(width), [], len(self.running)
        for i, seq in enumerate(self.running):
            if budget <= 0:
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            k = min(width, budget - (n - i) - reserve) if num_new == 1 else 0
            k = self._draft_room(seq, k, len(seq.output_ids)) if k > 0 else 0
            if k > 0:
                wanted.append((seq, k))
            budget -= num_new + k
        return wanted

    def _draft_width(self, num_running: int) -> tuple[int, bool | None]:
        """(drafts each decoding sequence may verify in a step of `num_running` running sequences, the gate's
        mode for that step: `StepPlan.drafts_on`): the ladder's width, 0 while the gate holds drafts back."""
        width = self.ladder.width(num_running) if self.drafter is not None else 0
        if not width or self.gate is None:
            return width, None
        drafts_on = self.gate.drafts_on(num_running)
        return (width if drafts_on else 0), drafts_on

    def _queue_head_reserve(self, width: int) -> int:
        """Budget tokens drafts leave to the head of the queue (its remaining prompt), when it could start."""
        if width and self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            return head.num_tokens - head.num_computed_tokens
        return 0

    def _draft_room(self, seq: Sequence, k: int, output_len: int) -> int:
        """How many drafts (<= k) `seq` may verify in a step that starts from `output_len` output tokens: fewer
        where the context or max_tokens ends sooner, 0 when it is not draftable or its drafting is paused. The
        rule of both `schedule()` and `schedule_ahead` (which asks it for the step after `plan`)."""
        if not draftable(seq, output_len) or drafting_paused(seq, output_len):
            return 0
        num_tokens = len(seq.prompt_ids) + output_len
        return min(k, self.max_model_len - num_tokens - 1, seq.max_tokens - output_len - 1)

    def _draft_entry(self, seq: Sequence, k: int) -> ScheduledSeq | None:
        """A decoding sequence's entry with up to k drafts (fewer where the context or max_tokens ends sooner),
        its blocks grown for them; None when it gets none (not draftable, no proposal, the pool short)."""
        k = self._draft_room(seq, k, len(seq.output_ids))
        if k < 1:
            return None
        drafts = self.drafter.propose(seq, k)[:k]
        if not drafts:
            return None
        # drafts never take the blocks the other running sequences' next tokens need
        need = self._blocks_needed(seq, seq.num_tokens + len(drafts))
        if need and self.pool.num_free - need < len(self.running):
            return None
        self._grow(seq, seq.num_tokens + len(drafts))
        probs = self._draft_probs(seq, len(drafts)) if self._draft_probs is not None else None
        return ScheduledSeq(seq, seq.num_computed_tokens, 1 + len(drafts), True, tuple(drafts), probs)

    def _holds_back(self, entries: list[ScheduledSeq], decode_only: bool = False) -> bool:
        """Whether the head of the queue waits for a later step (`admission_wait_steps`): it is a new request
        (not a preempted one) with more than one token to compute (one more token keeps a step decode-only) that
        has waited fewer than that many plans, sequences run on (`entries`), and the step so far is decode-only
        (`decode_only`: known to be; a step that already carries a prompt chunk takes more at little cost)."""
        if not self.admission_wait_steps or not self.waiting or not entries:
            return False
        head = self.waiting[0]
        added = self._added_at.get(head.seq_id)
        return (added is not None and self._num_plans - added < self.admission_wait_steps
                and head.num_tokens - head.num_computed_tokens > 1
                and (decode_only or all(e.num_new == 1 or e.drafts for e in entries)))

    def _admit(self, entries: list[ScheduledSeq], budget: int, whole_prompts: int = 0) -> bool:
        """Start waiting sequences, FIFO, while the token budget, `max_num_seqs` and free KV blocks allow, appending
        their entries. whole_prompts > 0 (a step planned ahead): only sequences whose whole remaining prompt fits,
        at most that many prompt tokens in all, and `ahead_admissible` ones. Returns False when such a limit (not
        the budget, the slots or the pool) stopped the first waiting sequence."""
        ahead = whole_prompts > 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_ids:
                self._match_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            if ahead and (remaining > min(budget, whole_prompts)
                                  or (self.ahead_admissible is not None and not self.ahead_admissible(seq))):
                self._release(seq)  # as before the call: schedule() matches it again
                return False
            num_new = min(remaining, budget)
            if not self._grow(seq, seq.num_computed_tokens + num_new):
                self._release(seq)
                break
            self.waiting.popleft()
            self._added_at.pop(seq.seq_id, None)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            entries.append(self._entry(seq, num_new))
            budget -= num_new
            whole_prompts -= num_new
        return True

    def schedule_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The step after `plan`, chosen before `plan`'s tokens are known (asynchronous scheduling): the same
        sequences in the same order, each decoding the token `plan` samples for it, so the device can read those
        ids from `plan`'s output and the host never holds the device up; then, with `ahead_prefill_tokens` set,
        waiting sequences admitted as `schedule()` would, whole prompts only.

        Returns None unless that is what `schedule()` would choose once `plan` is applied: every running
        sequence (the sequences of `plan` but those finished already, in the same order) samples in `plan` (a
        decode token or its prompt's last chunk), the context has room for one more token, and the blocks it
        needs are free (no preemption ahead); and no waiting request would be admitted by
        `schedule()` but not here (its prompt too long for one chunk or for `ahead_prefill_tokens`, or not
        `ahead_admissible`). A sequence that finishes with `plan`'s token (EOS, stop, max_tokens) still computes
        the step ahead; `update` then skips it, and its blocks, freed by that finish, are only reused by steps that
        run after this one (its slot too: admission here counts it as running).
        Call `update(plan, ...)` before `update` of the returned plan, and no `schedule()` in between.
        The draft gate's mode (`StepPlan.drafts_on`) is read here, before `plan` is recorded: when recording
        `plan` ends the gate's plain phase, `schedule()` would draft but this step still runs plain (the gate
        does not measure it); the switch takes effect one step later.
        """
        # a sequence that finished while `plan` ran (aborted, or by the token of the step before) is dropped:
        # its blocks are free again and may go to a sequence admitted below
        if plan.has_drafts:
            return None  # how many tokens its verifies emit is known only after it ran
        entries = [e for e in plan.entries if e.seq.status is not SequenceStatus.FINISHED]
        if not entries or len(entries) != len(self.running) or len(entries) > self.max_num_batched_tokens:
            return None
        width, drafts_on = self._draft_width(len(entries))
        if width and any(self._draft_room(e.seq, width, len(e.seq.output_ids) + 1) > 0 for e in entries):
            return None  # schedule() may draft for it, from the token `plan` samples (the gate as of now)
        need = 0
        for e, seq in zip(entries, self.running):
            if e.seq is not seq or not e.sample or seq.num_computed_tokens != e.start:
                return None
            if e.start + e.num_new + 1 > self.max_model_len:
                return None
            need += self._blocks_needed(seq, e.start + e.num_new + 1)
        if need > self.pool.num_free:
            return None
        room = self.waiting and len(self.running) < self.max_num_seqs
        if room and self.admission_wait_steps:
            # the step ahead decodes only; a sequence that reaches max_tokens with plan's token is gone before it
            # matters: if all are, schedule() would find nothing running and start the head at once, so here too
            room = not self._holds_back([e for e in entries if len(e.seq.output_ids) + 1 < e.seq.max_tokens],
                                        decode_only=True)
        if room and not self.ahead_prefill_tokens:
            return None  # schedule() would admit (or try to admit) a waiting sequence
        for e in entries:
            self._grow(e.seq, e.start + e.num_new + 1)
        ahead = [ScheduledSeq(e.seq, e.start + e.num_new, 1, True) for e in entries]
        if room and not self._admit(ahead, self.max_num_batched_tokens - len(ahead), self.ahead_prefill_tokens) \
                and len(ahead) == len(entries):
            return None  # the head of the queue needs schedule(); the blocks grown above serve that step too
        self._num_plans += 1
        return StepPlan(ahead, drafts_on=drafts_on)

    def update(self, plan: StepPlan, sampled: dict[int, int]) -> list[Sequence]:
        """Apply a finished step.

        Args:
            plan: the plan that ran.
            sampled: seq_id -> sampled token id, for every entry with `sample` set; for an entry with drafts the
                list of tokens its verify emits (the accepted drafts, then the target's own token).
        Returns:
            The sequences that got new tokens, in plan order (finished ones have `finish_reason` set; one whose
            grammar failed has `error` set, finish_reason ABORT, and its request must fail); one token each, but
            1..len(drafts) + 1 for entries with drafts.
        """
        touched = []
        for entry in plan.entries:  # per sequence per step: kept lean
            seq = entry.seq
            if seq.status is SequenceStatus.FINISHED:  # aborted while the step ran
                continue
            if entry.drafts:
                self._apply_verified(seq, entry, sampled[seq.seq_id])
                touched.append(seq)
                continue
            self._add_computed(seq, entry.num_new)
            if not entry.sample:
                continue
            token = sampled[seq.seq_id]
            seq.output_ids.append(token)
            touched.append(seq)
            if seq.grammar is not None:
                seq.grammar.accept(token)
                if seq.grammar.error is not None:  # llguidance failed mid-output: a failure, not a stop
                    seq.error = seq.grammar.error
                    self.finish(seq, FinishReason.ABORT)
                    continue
            reason, stop_reason = self._check_stop(seq, token)
            if reason is not None:
                self.finish(seq, reason, stop_reason)
        return touched

    def gate_output_len(self, plan: StepPlan) -> int:
        """Output tokens the sequences of `plan` hold (0 unless the draft gate measures such a step): the engine's
        loop takes it before `update(plan)` and after the step's stop strings were applied, and hands
        `record_step` the difference, the tokens the step really added (per step: walks the entries)."""
        if self.gate is None or not self.gate.is_auto or plan.drafts_on is None:
            return 0
        return sum(len(e.seq.output_ids) for e in plan.entries)

    def record_step(self, plan: StepPlan, num_tokens: int) -> None:
        """Feed the draft gate a step whose outputs `update` just applied; num_tokens: the output tokens it added
        (`gate_output_len` after less before: past EOS, stop ids and stop strings, none for a sequence that had
        finished before it ran). The engine's loop calls it right after applying every step, in order: the gate's
        clock times a step from one call to the next. A no-op without a gate."""
        if self.gate is None:
            return
        if plan.drafts_on is not None:
            if plan.drafts_on:
                self.num_gate_draft_steps += 1
            else:
                self.num_gate_plain_steps += 1
        decode_only = plan.drafts_on is not None and self.gate.is_auto and plan.is_decode_only
        self.gate.record(len(plan.entries), plan.drafts_on, num_tokens, decode_only)

    def _apply_verified(self, seq: Sequence, entry: ScheduledSeq, tokens: list[int]) -> None:
        """Append a verify's tokens up to the first that ends the sequence. The K / V of the last token fed and
        of the accepted drafts are valid; the rejected drafts' slots are overwritten when those positions are
        computed again."""
        self.num_verify_steps += 1
        self.num_draft_tokens += len(entry.drafts)
        self.num_accepted_tokens += len(tokens) - 1
        reason = stop_reason = None
        kept = 0
        for token in tokens:
            seq.output_ids.append(token)
            kept += 1
            reason, stop_reason = self._check_stop(seq, token)
            if reason is not None:
                break
        self._add_computed(seq, kept)
        record_verify(seq, len(tokens) - 1, self.draft_max_pause)
        if reason is not None:
            self.finish(seq, reason, stop_reason)

    # -- helpers ------------------------------------------------------------------------------------------

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(seq, start, num_new, sample=start + num_new == seq.num_tokens)

    def _check_stop(self, seq: Sequence, token: int) -> tuple[FinishReason | None, int | None]:
        params = seq.params
        num_out = len(seq.output_ids)
        if num_out > params.min_tokens:  # the sampler masks EOS/stop ids before min_tokens
            if token in self.eos_token_ids and not params.ignore_eos:
                return FinishReason.STOP, None
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
        if seq.grammar is not None and seq.grammar.done:  # complete (even at max_tokens): nothing more allowed
            return FinishReason.STOP, None
        if num_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq lacks to hold num_tokens tokens (0 when it has room)."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's blocks hold num_tokens tokens; False (allocating nothing) if the pool is short."""
        need = self._blocks_needed(seq, num_tokens)
        if need == 0:  # most decode steps: the last block has room
            return True
        if need > self.pool.num_free:
            return False
        for _ in range(need):
            seq.block_ids.append(self.pool.allocate())
        return True

    def _match_prefix(self, seq: Sequence) -> None:
        """Take cached blocks for seq's leading full blocks; at least one token is left to compute. Its block hashes
        are computed once (`Sequence.block_hash_chain`; its prompt's once for all of a request's choices): an admission
        the pool defers, or one after a preemption, looks the same hashes up again."""
        seq.block_ids = self.pool.match_prefix(seq.block_hash_chain, seq.num_tokens)
        seq.num_computed_tokens = len(seq.block_ids) * self.block_size
        if not seq.output_ids:  # usage counts cached prompt tokens of the first admission
            seq.num_cached_tokens = seq.num_computed_tokens

    def _add_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Count `num_tokens` more of seq's tokens as computed and publish the blocks they filled (the ones before
        were published when they filled, or came from the prefix cache). Per sequence per step: no call unless a
        block filled."""
        first = seq.num_computed_tokens // self.block_size
        seq.num_computed_tokens += num_tokens
        end = seq.num_computed_tokens // self.block_size
        if end > first:
            self.pool.publish(seq.block_ids, seq.block_hash_chain, first, end)

    def _release(self, seq: Sequence) -> None:
        if self._forget_drafts is not None:  # a draft model's K/V of it goes too
            self._forget_drafts(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids = []  # its block hashes stay: its tokens do
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
