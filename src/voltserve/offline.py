"""Drive a Scheduler and a ModelRunner in one thread, without actors (benchmarks, tests, offline batch use)."""

from __future__ import annotations

from collections.abc import Callable

from voltserve.runner import ModelRunner
from voltserve.scheduler import Scheduler
from voltserve.sequence import Sequence


def run_steps(scheduler: Scheduler, runner: ModelRunner, max_steps: int | None = None,
              pipelined: bool = True, on_update: Callable[[list[Sequence], dict], None] | None = None) -> int:
    """Run steps until the scheduler has no work or `max_steps` steps have run. Returns the steps run.

    pipelined: asynchronous scheduling where a step allows it: step N+1 is planned (`Scheduler.schedule_ahead`)
    and launched with its input ids fed on the device from step N (`ModelRunner.launch(feed=...)`) before the
    host waits for step N's tokens, so the GPU never waits on the host between such steps.
    on_update: called after each step is applied with (the sequences that got a token, their seq_id ->
    TokenLogprob); a step ahead of a sequence that just finished gives it nothing, as in the engine.

    Raises:
        RuntimeError: the scheduler made no progress (KV pool too small for a waiting sequence).
    """
    steps = 0
    plan, handle = None, None
    while max_steps is None or steps < max_steps:
        if handle is None:
            if not scheduler.has_work():
                break
            wanted = scheduler.draft_work()  # a draft model's drafts, computed before the plan that verifies them
            if wanted:
                scheduler.drafter.prepare(wanted)
            plan = scheduler.schedule()
            if not plan.entries:
                raise RuntimeError("scheduler made no progress: KV pool too small for the waiting request")
            handle = runner.launch(plan)
            steps += 1
        ahead = None
        if pipelined and handle.is_async and (max_steps is None or steps < max_steps):
            ahead = scheduler.schedule_ahead(plan)
        ahead_handle = runner.launch(ahead, feed=handle) if ahead is not None else None
        _apply(scheduler, plan, runner.collect(handle), on_update)
        if ahead is None:
            handle = None
        else:
            plan, handle = ahead, ahead_handle
            steps += 1
    if handle is not None:  # max_steps reached with a step in flight
        _apply(scheduler, plan, runner.collect(handle), on_update)
    return steps


def _apply(scheduler: Scheduler, plan, results, on_update) -> None:
    sampled, logprobs = results
    before = scheduler.gate_output_len(plan)
    touched = scheduler.update(plan, sampled)
    if on_update is not None:
        on_update(touched, logprobs)
    # after on_update, as the engine's loop records after its deltas went out: the gate times host work too
    scheduler.record_step(plan, scheduler.gate_output_len(plan) - before)
