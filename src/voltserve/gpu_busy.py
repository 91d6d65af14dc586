"""GpuBusyMeter: the share of wall time the GPU spends on engine steps, from CUDA events (issue "Performance",
target 5: is the GPU kept busy, or does it wait on the host between steps?)."""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


class GpuBusyMeter:
    """Times each step's device work with two CUDA events and logs the busy fraction every `interval_s`.

    Per step: `start()` before the step's first launch, `stop()` after its last launch (before the host reads the
    results), `step_done()` after the host has read them (the events are complete then, so reading them does not
    sync). Busy time is the sum of event-to-event times; the fraction divides it by the wall time of the interval,
    idle stretches included, so measure it under a steady load.

    Args:
        interval_s: seconds between log lines (and between resets of the counters).
        log: where the line goes (logger.info by default).
    """

    def __init__(self, interval_s: float, log=None):
        self.interval_s = interval_s
        self._log = log or logger.info
        self._start_ev = torch.cuda.Event(enable_timing=True)
        self._stop_ev = torch.cuda.Event(enable_timing=True)
        self._started = self._stopped = False
        self._reset(time.perf_counter())
        self.last: dict | None = None  # the last logged window: busy_fraction, steps, gpu_ms_per_step, wall_s

    def _reset(self, now: float) -> None:
        self._t0, self._busy_ms, self._steps = now, 0.0, 0

    def start(self) -> None:
        self._start_ev.record()
        self._started, self._stopped = True, False

    def stop(self) -> None:
        """Mark the end of the step's device work; only the first call of a step counts."""
        if self._started and not self._stopped:
            self._stop_ev.record()
            self._stopped = True

    def step_done(self) -> None:
        """Account the finished step (its results were read, so both events have completed)."""
        if not self._started:
            return
        self.stop()
        self._started = False
        self._busy_ms += self._start_ev.elapsed_time(self._stop_ev)
        self._steps += 1
        now = time.perf_counter()
        wall = now - self._t0
        if wall >= self.interval_s:
            self.last = {"busy_fraction": self._busy_ms / 1e3 / wall, "steps": self._steps,
                         "gpu_ms_per_step": self._busy_ms / self._steps, "wall_s": wall}
            self._log("GPU busy %.1f%% of %.1f s: %d steps, %.3f ms of GPU work each, %.3f ms of wall each",
                      100 * self.last["busy_fraction"], wall, self._steps, self.last["gpu_ms_per_step"],
                      1e3 * wall / self._steps)
            self._reset(now)
