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
    reads the results), `account(timer, rows, tokens)` after the host has read them (both events are complete then, so reading
    them does not sync). With two steps in flight (asynchronous scheduling) each has its own timer; the second's
    start event completes only when the GPU reaches it, after the first step's work, so the intervals never
    overlap. Busy time is the sum of the intervals; the fraction divides it by the wall time of the window, idle
    stretches included, so measure it under a steady load. The line also gives the mean sequences (rows) and query
    tokens a step, so that two loads of equal busy share can be told apart by how full their steps were.

    Args:
        interval_s: seconds between log lines (and between resets of the counters).
        log: where the line goes (logger.info by default).
    """

    def __init__(self, interval_s: float, log=None):
        self.interval_s = interval_s
        self._log = log or logger.info
        self._free: list[StepTimer] = []
        self._reset(time.perf_counter())
        # the last logged window: busy_fraction, steps, gpu_ms_per_step, wall_s, rows_per_step, tokens_per_step
        self.last: dict | None = None

    def _reset(self, now: float) -> None:
        self._t0, self._busy_ms, self._steps, self._rows, self._tokens = now, 0.0, 0, 0, 0

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
        `tokens` query tokens in all (decode rows count one, prefill chunks their length)."""
        self.end(timer)
        self._busy_ms += timer.start.elapsed_time(timer.stop)
        self._free.append(timer)
        self._steps += 1
        self._rows += rows
        self._tokens += tokens
        now = time.perf_counter()
        wall = now - self._t0
        if wall >= self.interval_s:
            n = self._steps
            self.last = {"busy_fraction": self._busy_ms / 1e3 / wall, "steps": n, "gpu_ms_per_step": self._busy_ms / n,
                         "wall_s": wall, "rows_per_step": self._rows / n, "tokens_per_step": self._tokens / n}
            self._log("GPU busy %.1f%% of %.1f s: %d steps, %.3f ms of GPU work each, %.3f ms of wall each, "
                      "%.1f sequences and %.1f tokens a step", 100 * self.last["busy_fraction"], wall, n,
                      self.last["gpu_ms_per_step"], 1e3 * wall / n, self.last["rows_per_step"],
                      self.last["tokens_per_step"])
            self._reset(now)
