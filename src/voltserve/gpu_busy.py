"""GpuBusyMeter: the share of wall time the GPU spends on engine steps, from CUDA events (issue "Performance",
target 5: is the GPU kept busy, or does it wait on the host between steps?)."""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


class StepTimer:
    """The two CUDA events around one step's device work (see GpuBusyMeter)."""

    __slots__ = ("start", "stop", "stopped")

    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.stop = torch.cuda.Event(enable_timing=True)
        self.stopped = False


class GpuBusyMeter:
    """Times each step's device work with two CUDA events and logs the busy fraction every `interval_s`.

    Per step: `begin()` right before the step's first launch, `end(timer)` after its last launch (before the host
    reads the results), `account(timer, rows, tokens)` after the host has read them (both events are complete
    then, so reading them does not sync). With two steps in flight (asynchronous scheduling) each has its own
    timer; the second's start event completes only when the GPU reaches it, after the first step's work, so the
    intervals never overlap. Busy time is the sum of the intervals; the fraction divides it by the wall time of
    the window, idle stretches included, so measure it under a steady load. The line also splits the steps into
    decode-only ones and those with prompt tokens (prefill chunks), with the GPU time of each kind, and gives the
    mean sequences and query tokens a step: two loads of equal busy share differ in how full and how costly
    their steps were (staggered arrivals make more steps with a prompt in them).

    Args:
        interval_s: seconds between log lines (and between resets of the counters).
        log: where the line goes (logger.info by default).
    """

    def __init__(self, interval_s: float, log=None):
        self.interval_s = interval_s
        self._log = log or logger.info
        self._free: list[StepTimer] = []
        self._reset(time.perf_counter())
        # the last logged window: busy_fraction, wall_s, steps, gpu_ms_per_step, rows_per_step, tokens_per_step,
        # prompt_steps (steps with prompt tokens), prompt_gpu_ms_per_step, decode_gpu_ms_per_step (None: none)
        self.last: dict | None = None

    def _reset(self, now: float) -> None:
        self._t0 = now
        self._busy_ms = self._prompt_ms = 0.0
        self._steps = self._prompt_steps = self._rows = self._tokens = 0

    def begin(self) -> StepTimer:
        timer = self._free.pop() if self._free else StepTimer()
        timer.start.record()
        timer.stopped = False
        return timer

    def end(self, timer: StepTimer) -> None:
        """Mark the end of the step's device work; only the first call for a timer counts."""
        if not timer.stopped:
            timer.stop.record()
            timer.stopped = True

    def account(self, timer: StepTimer, rows: int, tokens: int) -> None:
        """Account a finished step (its results were read, so both events have completed) of `rows` sequences and
        `tokens` query tokens in all (a decode row counts one; more tokens than rows means prompt tokens)."""
        self.end(timer)
        ms = timer.start.elapsed_time(timer.stop)
        self._free.append(timer)
        self._busy_ms += ms
        self._steps += 1
        self._rows += rows
        self._tokens += tokens
        if tokens > rows:
            self._prompt_steps += 1
            self._prompt_ms += ms
        now = time.perf_counter()
        wall = now - self._t0
        if wall >= self.interval_s:
            self._report(wall)
            self._reset(now)

    def _report(self, wall: float) -> None:
        n, p = self._steps, self._prompt_steps
        last = self.last = {
            "busy_fraction": self._busy_ms / 1e3 / wall, "wall_s": wall, "steps": n,
            "gpu_ms_per_step": self._busy_ms / n, "rows_per_step": self._rows / n,
            "tokens_per_step": self._tokens / n, "prompt_steps": p,
            "prompt_gpu_ms_per_step": self._prompt_ms / p if p else None,
            "decode_gpu_ms_per_step": (self._busy_ms - self._prompt_ms) / (n - p) if n > p else None}

        def ms(v):
            return "-" if v is None else "%.3f ms" % v
        self._log("GPU busy %.1f%% of %.1f s: %d steps, %.3f ms of GPU work each (%d decode-only %s, %d with prompt "
                  "tokens %s), %.3f ms of wall each, %.1f sequences and %.1f tokens a step",
                  100 * last["busy_fraction"], wall, n, last["gpu_ms_per_step"], n - p,
                  ms(last["decode_gpu_ms_per_step"]), p, ms(last["prompt_gpu_ms_per_step"]), 1e3 * wall / n,
                  last["rows_per_step"], last["tokens_per_step"])
