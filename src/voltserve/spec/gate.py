"""The draft gate: drafting stays on only where it measurably emits more output tokens per second than plain decoding.

Speculative decoding pays when a verify step costs little more than a decode step and its drafts pass; it loses
when the model is small (a verify's k + 1 query rows cost more than a decode's one on the GPU, and a step with
drafts is never planned ahead, so the host's work is no longer hidden behind the device's) or the drafts fail.
Neither is known beforehand, and both change with the prompts, so the gate measures both modes, drafting on
("draft") and off ("plain"), per concurrency bucket (running sequences rounded up to a power of 2: the choice at
1 stream and at 64 is made apart), and picks the faster.

Policy per bucket, in epochs (deterministic, no random draws):
1. measure: `window` steps in one mode, then `window` steps in the other, back to back (both measured afresh,
   under the same load, adjacent in time); the mode that did not win the last epoch goes first (the first epoch:
   draft first), so each mode's first step is a switch into it and its cost (the asynchronous pipeline drained or
   refilled, a draft model's catch-up) is charged to that mode;
2. decide: draft only when its rate beats plain's by more than `margin` (a near-tie goes to plain: it keeps
   asynchronous scheduling and its step times vary less);
3. exploit: `exploit_steps` steps in the winner (no switch on a dip: a verify's output, 1..k + 1 tokens, is noisy
   and correlated along an answer); then the next epoch. A check at 4, 8, 16, ... windows into the phase sets the
   winner's steps so far against the loser's window: if the winner now loses by more than `margin`, the next
   epoch starts at once (a choice made on a lucky window costs ~4 windows, not a whole phase; a false alarm
   costs one epoch's measurement). The winner's exploit steps also join its next window's steps: drafts
   measured over ~1000 steps instead of 32 make the next decision far less noisy; the loser is always
   measured afresh, next to them in time.

Rate: the sum over the window's steps of (tokens the step emitted / sequences in it) over the sum of the steps'
seconds, i.e. output tokens per second per running sequence. Per sequence, because a bucket spans concurrencies
(5..8 share bucket 8) and a memory-bound step of 8 sequences emits ~8/5 the tokens of one of 5 in about the same
time: total tokens/s would favour whichever mode was measured at the higher concurrency. Step seconds are summed
(not per-step rates averaged), so a short step does not weigh more than a long one.
Outliers: a step longer than `outlier` times the median step of its window counts as that many medians (a GC
pause or a warm-up step of 100x a step costs the window at most `outlier` steps, not 100), while a switch's cost,
usually a few steps' worth, is still charged.

Only decode-only steps are measured: a step carrying a prompt chunk is dominated by the prefill (the first step
after the engine idled always carries one, so an idle gap is never measured either), and its time does not leak
into the next step's. A step whose mode is not the one the bucket is measuring (one planned ahead before a switch,
`Scheduler.schedule_ahead`) is not measured. The per-sequence backoff (`voltserve.spec.backoff`) still acts inside
the draft mode; the gate only sees what the mode as a whole delivers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from voltserve.errors import ConfigError

GATE_MODES = ("auto", "off")  # `EngineConfig.speculative_gate`: measure and choose / always draft

# 32 steps: a window's output of verify steps (1..k + 1 tokens each, correlated along an answer) is noisy over
# fewer; at ~1 ms a step on a GPU an epoch's two windows take ~64 ms. 1024 steps: the loser runs 32 of every
# 1088 steps (~3%), so a loser at 0.7x costs ~1% of throughput, while a change of workload is found within ~1 s at
# one stream on a GPU. 3%: below the run-to-run spread of the benchmarks, above which drafting must pay.
# 4 medians: above the step-to-step spread of decode and verify steps (a verify's time hardly depends on how
# many drafts pass), below a GC pause or a warm-up step.
DEFAULT_WINDOW = 32
DEFAULT_EXPLOIT_STEPS = 1024
DEFAULT_MARGIN = 0.03
DEFAULT_OUTLIER = 4.0

EXPLOIT = 2  # _Bucket.phase after both windows


def concurrency_bucket(num_running: int) -> int:
    """Running sequences rounded up to a power of 2 (1, 2, 4, ...); 0 counts as 1."""
    return 1 << (max(num_running, 1) - 1).bit_length()


@dataclass
class _Bucket:
    """One bucket's epoch: which mode it runs now and the current windows' steps."""

    order: tuple[bool, bool] = (True, False)  # the modes measured this epoch, in order (drafts_on values)
    phase: int = 0  # 0, 1: measuring order[phase]; EXPLOIT: running `choice`
    steps: int = 0  # steps of the current phase
    choice: bool = True  # the last epoch's winner
    # per mode: (tokens per sequence, seconds) of each step measured this epoch; the winner's list starts with its
    # last exploit phase's steps
    samples: dict[bool, list[tuple[float, float]]] = field(default_factory=lambda: {True: [], False: []})

    @property
    def mode(self) -> bool:
        return self.choice if self.phase == EXPLOIT else self.order[self.phase]


def window_rate(samples: list[tuple[float, float]], outlier: float = DEFAULT_OUTLIER) -> float:
    """Output tokens per second per sequence of a window's steps ((tokens / sequences, seconds) each), a step's
    seconds capped at `outlier` times the window's median. 0.0 for no steps or no time."""
    if not samples:
        return 0.0
    cap = outlier * statistics.median(s for _, s in samples)
    seconds = sum(min(s, cap) for _, s in samples)
    return sum(t for t, _ in samples) / seconds if seconds > 0 else 0.0


class DraftGate:
    """Chooses, per step, whether decoding sequences get drafts, from measured output tokens per second.

    The scheduler asks `drafts_on(running sequences)` when it plans a step; the engine's loop calls `record` each
    time a step's outputs have been applied. A step's time is the wall time from the previous step's `record` to
    its own: host work, and whatever asynchronous scheduling hides, included (what a user sees).

    Args:
        mode: "auto" (measure and choose) or "off" (always draft: speculative decoding as without a gate).
        window: steps each mode is measured for in an epoch (W).
        exploit_steps: steps the winner runs between an epoch's measurements and the next epoch's (P).
        margin: draft's lead over plain in tokens/s (a fraction) below which plain is chosen.
        outlier: a measured step's seconds count at most this many times its window's median step.
        clock: seconds, monotonic (`time.perf_counter`; a fake one in tests).
    Raises:
        ConfigError: an unknown mode; window < 1, exploit_steps < 0, margin < 0 or outlier < 1.
    """

    def __init__(self, mode: str = "auto", window: int = DEFAULT_WINDOW, exploit_steps: int = DEFAULT_EXPLOIT_STEPS,
                 margin: float = DEFAULT_MARGIN, outlier: float = DEFAULT_OUTLIER,
                 clock: Callable[[], float] = time.perf_counter):
        if mode not in GATE_MODES:
            raise ConfigError(f"speculative_gate must be one of {', '.join(GATE_MODES)}, not {mode!r}")
        if window < 1 or exploit_steps < 0 or margin < 0 or outlier < 1:
            raise ConfigError(f"draft gate: need window >= 1, exploit_steps >= 0, margin >= 0 and outlier >= 1, "
                              f"not {window}, {exploit_steps}, {margin} and {outlier}")
        self.is_auto = mode == "auto"
        self.window = window
        self.exploit_steps = exploit_steps
        self.margin = margin
        self.outlier = outlier
        self.clock = clock
        self._buckets: dict[int, _Bucket] = {}
        self._last_s: float | None = None  # clock() at the last record
        self.num_epochs = 0  # epochs decided, all buckets

    def drafts_on(self, num_running: int) -> bool:
        """Whether a step with `num_running` running sequences may draft. Reads the state only: the scheduler
        may ask several times for one step (`Scheduler.draft_work`, `schedule`, `schedule_ahead`)."""
        if not self.is_auto:
            return True
        bucket = self._buckets.get(concurrency_bucket(num_running))
        return bucket.mode if bucket is not None else _Bucket().mode

    def record(self, num_running: int, drafts_on: bool | None, num_tokens: int, is_decode_only: bool) -> None:
        """A step's outputs were just applied; call it for every step, in order (each one's time runs from the
        call before).

        Args:
            num_running: sequences in the step (its entries).
            drafts_on: the mode it ran in (`drafts_on`'s answer when it was planned); None: not the gate's choice
                (the ladder gave no drafts at that concurrency), not measured.
            num_tokens: output tokens the step added to its sequences (after EOS, stop ids and stop strings cut
                a verify's tokens; 0 for a sequence that had finished before it ran).
            is_decode_only: no entry of the step computed a prompt chunk.
        """
        now = self.clock()
        elapsed_s = now - self._last_s if self._last_s is not None else 0.0
        self._last_s = now
        if not self.is_auto or drafts_on is None or not is_decode_only or elapsed_s <= 0 or num_running < 1:
            return
        key = concurrency_bucket(num_running)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        if bucket.phase == EXPLOIT:
            bucket.steps += 1
            if drafts_on is bucket.choice:
                bucket.samples[drafts_on].append((num_tokens / num_running, elapsed_s))
            if bucket.steps >= self.exploit_steps or self._check_fails(bucket):
                self._next_epoch(bucket)
            return
        if drafts_on is not bucket.mode:
            return  # planned before the switch to this window's mode
        bucket.samples[drafts_on].append((num_tokens / num_running, elapsed_s))
        bucket.steps += 1
        if bucket.steps < self.window:
            return
        bucket.phase, bucket.steps = bucket.phase + 1, 0
        if bucket.phase == EXPLOIT:
            bucket.choice = self._draft_wins(bucket.samples[True], bucket.samples[False])
            bucket.samples[bucket.choice] = []  # the exploit phase's steps go there; the loser's window stays
            self.num_epochs += 1
            if self.exploit_steps == 0:
                self._next_epoch(bucket)

    def _draft_wins(self, draft: list[tuple[float, float]], plain: list[tuple[float, float]]) -> bool:
        return window_rate(draft, self.outlier) > window_rate(plain, self.outlier) * (1.0 + self.margin)

    def _check_fails(self, bucket: _Bucket) -> bool:
        """At 4, 8, 16, ... windows into the exploit phase: whether the winner's steps there lose to the loser's
        window by more than `margin` (then the epoch ends early and the loser is measured afresh)."""
        n = bucket.steps // self.window
        if n < 4 or n & (n - 1) or bucket.steps % self.window:
            return False
        won = window_rate(bucket.samples[bucket.choice], self.outlier)
        lost = window_rate(bucket.samples[not bucket.choice], self.outlier)
        return won * (1.0 + self.margin) < lost

    @staticmethod
    def _next_epoch(bucket: _Bucket) -> None:
        """Start measuring again, the loser first: both windows then start on a switch into their mode."""
        bucket.order, bucket.phase, bucket.steps = (not bucket.choice, bucket.choice), 0, 0
        bucket.samples[not bucket.choice] = []
