"""The concurrency ladder: how many drafts a step verifies, by how many sequences run.

Verifying k drafts costs k more query rows per sequence. At low concurrency a step is bound by reading the
weights, so the extra rows are almost free; at high concurrency they are real compute, and fewer drafts pay
better. `concurrency_drafts` maps thresholds of running sequences to verify widths, e.g. {"4": 3, "5": 4}, and
`speculative_disable_by_batch_size` (vLLM's name for the same setting) stops drafting from a number of running
sequences on: their steps then decode plainly and, on a GPU, are planned ahead again (asynchronous scheduling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from voltserve.errors import ConfigError


@dataclass(frozen=True)
class DraftLadder:
    """Verify width per concurrency.

    Attributes:
        num_drafts: k, the width below the lowest threshold.
        rungs: (threshold, width) pairs, thresholds ascending: with R running sequences the rung with the largest
            threshold <= R sets the width.
        disable_at: no drafts while at least this many sequences run (width 0); 0 = drafts at every concurrency.
    """

    num_drafts: int
    rungs: tuple[tuple[int, int], ...] = ()
    disable_at: int = 0

    @classmethod
    def parse(cls, spec: str | dict | None, num_drafts: int, disable_at: int = 0) -> "DraftLadder":
        """Build from `concurrency_drafts` (a JSON object string, a dict, or ""/None for no rungs) and
        `speculative_disable_by_batch_size` (disable_at).

        Raises:
            ConfigError: not a JSON object of integer thresholds >= 2 to integer widths in 1..num_drafts;
                disable_at neither 0 nor >= 2.
        """
        if num_drafts < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, not {num_drafts}")
        if disable_at != 0 and disable_at < 2:
            raise ConfigError(f"speculative_disable_by_batch_size must be 0 (never) or >= 2 (one running sequence "
                              f"always drafts), not {disable_at}")
        if spec is None or spec == "":
            return cls(num_drafts, disable_at=disable_at)
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"concurrency_drafts is not JSON: {exc}") from exc
        if not isinstance(spec, dict):
            raise ConfigError('concurrency_drafts must be a JSON object such as {"4": 3, "5": 4}')
        rungs = []
        for key, width in spec.items():
            try:
                threshold = int(key)
            except ValueError:
                raise ConfigError(f"concurrency_drafts: threshold {key!r} is not an integer") from None
            if threshold < 2:
                raise ConfigError(f"concurrency_drafts: threshold {threshold} must be >= 2 (one running sequence "
                                  "verifies all num_speculative_tokens drafts)")
            if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= num_drafts:
                raise ConfigError(f"concurrency_drafts: width {width!r} at {threshold} must be an integer in "
                                  f"1..{num_drafts} (num_speculative_tokens)")
            rungs.append((threshold, width))
        return cls(num_drafts, tuple(sorted(rungs)), disable_at)

    def width(self, running: int) -> int:
        """Drafts each sequence verifies when `running` sequences run (0: none, `disable_at`)."""
        if self.disable_at and running >= self.disable_at:
            return 0
        width = self.num_drafts
        for threshold, w in self.rungs:
            if threshold > running:
                break
            width = w
        return width
