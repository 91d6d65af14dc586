"""The draft gate: drafting stays on only where it measurably emits more output tokens per second than plain decoding.

Speculative decoding pays when a verify step costs little more than a decode step and its drafts pass; it loses
when the model is small (a verify's k + 1 query rows cost more than a decode's one on the GPU, and a step with
drafts is never planned ahead, so the host's work is no longer hidden behind the device's) or the drafts fail.
Neither is known beforehand, and both change with the prompts, so the gate measures: output tokens per wall-clock
second of recent decode-only steps with drafting on ("draft") and off ("plain"), per concurrency bucket (running
sequences rounded up to a power of 2: the choice at 1 stream and at 64 is made apart), and picks the faster mode.

Policy per bucket (explore, then exploit; deterministic, no random draws):
1. draft until it has `window` measured steps (explore), then plain until it has as many;
2. then the mode with the higher tokens/s estimate; draft only when it beats plain by more than `margin`
   (a near-tie goes to plain: it keeps asynchronous scheduling and its step times vary less);
3. every `probe_every` measured steps the losing mode's estimate is dropped and it runs `window` steps again
   (rule 1), so the choice follows the workload (acceptance depends on the prompts).

The estimates are EWMAs of tokens per step and seconds per step whose weight is max(1 / window, 1 / n) for the
n-th step since the mode was (re)measured: a probe's estimate is the plain mean of its `window` steps, later ones
forget with a memory of about 2 * window steps. Their ratio (not an EWMA of per-step rates) keeps a short step
from weighing more than a long one. The per-sequence backoff (`voltserve.spec.backoff`) still acts inside the
draft mode; the gate only sees what the mode as a whole delivers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from voltserve.errors import ConfigError

GATE_MODES = ("auto", "off")  # `EngineConfig.speculative_gate`: measure and choose / always draft

# 16 steps: a probe's mean of tokens per verify step (1..k + 1 each, correlated along an answer) is noisy over
# fewer; at ~1 ms a step on a GPU a probe takes ~16 ms. 512 steps: the losing mode's probe runs 16 of every ~530
# steps (~3%), so a loser at 0.7x costs ~1% of throughput, while a change of workload is found within ~0.5 s at
# one stream on a GPU. 3%: below the run-to-run spread of the benchmarks, above which drafting must pay.
DEFAULT_WINDOW = 16
DEFAULT_PROBE_EVERY = 512
DEFAULT_MARGIN = 0.03


def concurrency_bucket(num_running: int) -> int:
    """Running sequences rounded up to a power of 2 (1, 2, 4, ...); 0 counts as 1."""
    return 1 << (max(num_running, 1) - 1).bit_length()


@dataclass
class _Mode:
    """One mode's measurements in one bucket."""

    num_steps: int = 0  # steps measured since the mode was last (re)measured
    tokens: float = 0.0  # EWMA of output tokens per step
    seconds: float = 0.0  # EWMA of wall time per step (s)

    def add(self, num_tokens: int, seconds: float, alpha: float) -> None:
        self.num_steps += 1
        w = max(alpha, 1.0 / self.num_steps)  # a running mean over the first 1 / alpha steps
        self.tokens += w * (num_tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    draft: _Mode = field(default_factory=_Mode)
    plain: _Mode = field(default_factory=_Mode)
    since_probe: int = 0  # steps measured in this bucket since the loser was last re-probed


class DraftGate:
    """Chooses, per step, whether decoding sequences get drafts, from measured output tokens per second.

    The scheduler asks `drafts_on(running sequences)` when it plans a step; the engine's loop calls `record` each
    time a step's outputs have been applied. A step's time is the wall time from the previous step's `record` to
    its own: host work, and whatever asynchronous scheduling hides, included (what a user sees). Only decode-only
    steps are measured: a step carrying a prompt chunk is dominated by the prefill; the first step after the
    engine idled always carries one (a new request), so an idle gap is never measured. Neither is the first step
    after a switch of mode: it refills (or drains) the asynchronous pipeline, a cost paid once per switch.

    Args:
        mode: "auto" (measure and choose) or "off" (always draft: speculative decoding as without a gate).
        window: steps each mode is measured for when it is (re)probed (W).
        probe_every: measured steps of a bucket between two re-probes of its losing mode (P).
        margin: draft's lead over plain in tokens/s (a fraction) below which plain is chosen.
        clock: seconds, monotonic (`time.perf_counter`; a fake one in tests).
    Raises:
        ConfigError: an unknown mode; window < 1, probe_every < window or margin < 0.
    """

    def __init__(self, mode: str = "auto", window: int = DEFAULT_WINDOW, probe_every: int = DEFAULT_PROBE_EVERY,
                 margin: float = DEFAULT_MARGIN, clock: Callable[[], float] = time.perf_counter):
        if mode not in GATE_MODES:
            raise ConfigError(f"speculative_gate must be one of {', '.join(GATE_MODES)}, not {mode!r}")
        if window < 1 or probe_every < window or margin < 0:
            raise ConfigError(f"draft gate: need window >= 1, probe_every >= window and margin >= 0, not "
                              f"{window}, {probe_every} and {margin}")
        self.is_auto = mode == "auto"
        self.window = window
        self.probe_every = probe_every
        self.margin = margin
        self.clock = clock
        self._alpha = 1.0 / window
        self._buckets: dict[int, _Bucket] = {}
        self._last_s: float | None = None  # clock() at the last record
        self._last_drafts_on: bool | None = None  # the mode of the last step recorded

    def drafts_on(self, num_running: int) -> bool:
        """Whether a step with `num_running` running sequences may draft. Reads the measurements only: the
        scheduler may ask several times for one step (`Scheduler.draft_work`, `schedule_ahead`)."""
        if not self.is_auto:
            return True
        bucket = self._buckets.get(concurrency_bucket(num_running))
        if bucket is None:
            return True
        return self._choose(bucket)

    def _choose(self, bucket: _Bucket) -> bool:
        draft, plain = bucket.draft, bucket.plain
        if draft.num_steps < self.window:
            return True
        if plain.num_steps < self.window:
            return False
        return draft.tokens_per_s > plain.tokens_per_s * (1.0 + self.margin)

    def record(self, num_running: int, drafts_on: bool | None, num_tokens: int, is_decode_only: bool) -> None:
        """A step's outputs were just applied; call it for every step, in order (each one's time runs from the
        call before).

        Args:
            num_running: sequences in the step.
            drafts_on: the mode it ran in (`drafts_on`'s answer when it was planned); None: not the gate's choice
                (the ladder gave no drafts at that concurrency), not measured.
            num_tokens: output tokens the step emitted (1 per decoding sequence; 1 + accepted drafts for each
                that verified).
            is_decode_only: no entry of the step computed a prompt chunk.
        """
        now = self.clock()
        elapsed_s = now - self._last_s if self._last_s is not None else 0.0
        self._last_s = now
        switched = drafts_on is not self._last_drafts_on
        self._last_drafts_on = drafts_on
        if not self.is_auto or drafts_on is None or not is_decode_only or switched or elapsed_s <= 0:
            return
        key = concurrency_bucket(num_running)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        (bucket.draft if drafts_on else bucket.plain).add(num_tokens, elapsed_s, self._alpha)
        bucket.since_probe += 1
        if bucket.since_probe >= self.probe_every and min(bucket.draft.num_steps, bucket.plain.num_steps) >= \
                self.window:
            bucket.since_probe = 0
            # the loser is measured afresh: its estimate is as old as the last probe
            if self._choose(bucket):
                bucket.plain = _Mode()
            else:
                bucket.draft = _Mode()
