"""Draft backoff: a sequence whose drafts keep failing decodes without drafts for a while.

A verify that accepts no draft emits one token, as a plain decode step does, at a verify's cost: on a GPU at low
concurrency the verify's GEMM over k + 1 rows costs more than the decode GEMV, and a step with drafts is never
planned ahead (`Scheduler.schedule_ahead`), so the host's work is no longer hidden. After m verifies in a row that
accepted nothing, the sequence's next 2^m output tokens (at most `max_pause`) come from plain decode steps; one
accepted draft ends the streak. Free prose then pays little for drafts it rarely passes, while copying output,
whose drafts pass, keeps drafting.
"""

from __future__ import annotations

DEFAULT_MAX_PAUSE = 64  # output tokens; `EngineConfig.draft_max_pause`


def drafting_paused(seq, output_len: int) -> bool:
    """Whether `seq` (a `voltserve.sequence.Sequence`) decodes without drafts at output length `output_len` (the
    tokens it will have generated when the step runs)."""
    return output_len < seq.drafts_resume_at


def record_verify(seq, accepted: int, max_pause: int) -> None:
    """Update `seq`'s backoff after a verify that accepted `accepted` drafts (its output already extended by
    the verify's tokens). max_pause: the longest pause in output tokens; 0 never pauses."""
    if accepted or max_pause <= 0:
        seq.draft_misses = 0
        return
    seq.draft_misses = min(seq.draft_misses + 1, max_pause.bit_length())  # 2^misses stays near max_pause
    seq.drafts_resume_at = len(seq.output_ids) + min(max_pause, 1 << seq.draft_misses)
