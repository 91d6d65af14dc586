"""SchedulerActor: the engine's loop. Drain the inbox, schedule a step, run it on the worker, emit outputs.

Asynchronous scheduling: when the step just launched samples on the device and the next step would be the same
sequences decoding one more token each (`Scheduler.schedule_ahead`), that next step is launched, fed with this
step's ids on the device, in the same trip to the worker that waits for this step's ids (`StepMsg`), so the
device never waits for the host's bookkeeping between such steps. A step that runs at once (speculative verify
steps, whose next drafts need this step's tokens; every step on the CPU) has its results in the answer to its
launch: nothing else crosses to the worker thread between two such steps, whose gap the device sits idle through.

Detokenization and stop strings happen here. A sequence with stop strings is detokenized right after its step,
so a stop string ends it before the next step is planned and no KV block outlives its request by more than one
step (two when a step ahead was already running: its token for that sequence is dropped). When a step ahead
runs, every delta is emitted at once (the device is busy meanwhile); otherwise sequences without stop strings
are detokenized after the next step has been handed to the worker (`_emit_deferred`). The consumers of a step's
deltas are woken only after the next step has been handed to the worker thread too (see `_emit`), so their
per-token work (HTTP) also runs while the device computes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from actors.base import Actor, _Stop
from actors.request_ids import RequestIds
from actors.stream import RequestStream
from actors.worker import DraftMsg, StepMsg, WorkerActor
from voltserve.detok import IncrementalDetokenizer
from voltserve.errors import EngineDeadError, InvalidRequestError, StepFailedError
from voltserve.request import FinishReason, RequestOutput, TokenLogprob
from voltserve.scheduler import Scheduler
from voltserve.sequence import Sequence

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS_IN_ROW = 3


@dataclass(frozen=True)
class AddRequestMsg:
    """A new request: its sequences (n of them) and the stream their outputs go to."""

    seqs: tuple[Sequence, ...]
    stream: RequestStream


@dataclass(frozen=True)
class AbortRequestMsg:
    request_id: str


class SchedulerActor(Actor):
    """Args: scheduler: the pure policy; worker: the rank-0 worker; tokenizer: for detokenization; request_ids: the
    engine's ids in flight (`AsyncEngine.submit` claims an id, so no two requests here share one: requests are keyed
    by id), each freed here once its request is gone."""

    def __init__(self, scheduler: Scheduler, worker: WorkerActor, tokenizer, on_crash=None,
                 request_ids: RequestIds | None = None):
        super().__init__("scheduler", on_crash)
        self.scheduler = scheduler
        self.worker = worker
        self.tokenizer = tokenizer
        self.request_ids = RequestIds() if request_ids is None else request_ids
        self.streams: dict[str, RequestStream] = {}
        self.seqs: dict[str, list[Sequence]] = {}
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        # per seq_id that asked for logprobs: the TokenLogprobs of its tokens whose text is not out yet
        self.held_logprobs: dict[int, list[TokenLogprob]] = {}
        self._to_wake: list[RequestStream] = []  # streams given deltas whose consumers are not woken yet
        # (sequence, logprob) of the last step, emitted once the next step is with the worker
        self._deferred: list[tuple[Sequence, object]] = []
        self.num_steps = 0
        self.num_failed_steps_in_row = 0
        self.num_draft_failures = 0

    async def run_loop(self) -> None:
        plan, handle = None, None  # the step launched on the worker and not collected yet
        while True:
            # 1) drain the inbox; block on it only when idle
            messages = self.pending()
            if not messages and handle is None and not self.scheduler.has_work():
                self._emit_deferred()  # no next step to overlap with
                # with whatever arrived together with it: requests sent at once start in one step
                messages = [await self.next_message()] + self.pending()
            for msg, fut in messages:
                if isinstance(msg, _Stop):
                    self._emit_deferred()
                    if handle is not None:  # let the step in flight finish before its blocks go
                        await self.worker.ask(StepMsg(collect=handle))
                    self._abort_all()
                    return
                self._on_message(msg)
                if fut is not None:
                    fut.set_result(None)
            # 2) schedule and launch a step unless one is in flight; a failing step fails its requests, not the
            # engine
            if handle is None:
                if not self.scheduler.has_work():
                    continue
                await self._prepare_drafts()
                plan = self.scheduler.schedule()
                if not plan.entries:
                    raise RuntimeError("scheduler made no progress: KV pool too small for the waiting request")
                try:
                    handle, _ = await self._ask_then_emit_deferred(StepMsg(launch=plan))
                except EngineDeadError:
                    raise
                except Exception as exc:
                    self._fail_step(plan, exc)
                    continue
            # 3) asynchronous scheduling: launch the next step, fed on the device with this step's tokens, before
            # waiting for them (Scheduler.schedule_ahead says when that equals the step schedule() would pick). A
            # step that ran at once (verify steps, the CPU) brought its results back with its launch: no second trip
            ahead, ahead_handle = None, None
            if handle.is_async:
                ahead = self.scheduler.schedule_ahead(plan)
                try:
                    ahead_handle, (sampled, logprobs) = await self._ask_then_emit_deferred(
                        StepMsg(launch=ahead, feed=handle if ahead is not None else None, collect=handle))
                except EngineDeadError:
                    raise
                except Exception as exc:
                    self._fail_step(plan, exc)
                    plan, handle = None, None
                    continue
            else:
                sampled, logprobs = handle.result
            self.num_steps += 1
            self.num_failed_steps_in_row = 0
            # 4) apply it and stream the new tokens: now when the step ahead computes already; else those without
            # stop strings after the next step is handed to the worker
            before = self.scheduler.gate_output_len(plan)
            for seq in self.scheduler.update(plan, sampled):
                if seq.error is not None:
                    self._fail_grammar(seq)
                elif ahead is not None or seq.params.stop:
                    self._emit(seq, logprobs.get(seq.seq_id))
                else:
                    self._deferred.append((seq, logprobs.get(seq.seq_id)))
            # 5) the draft gate times the step from the last step's outputs to these (what the user sees), with
            # the tokens it added after stop strings (deferred sequences have none to cut)
            self.scheduler.record_step(plan, self.scheduler.gate_output_len(plan) - before)
            plan, handle = ahead, ahead_handle

    async def _prepare_drafts(self) -> None:
        """A draft model's drafts for the step about to be planned, computed on the worker's thread. A failure
        there costs this step its drafts, not its requests (the target's step reports a broken device)."""
        wanted = self.scheduler.draft_work()
        if not wanted:
            return
        try:
            # the last step's deferred deltas go out while the draft model runs (they have no stop strings: their
            # emission never calls into the scheduler or the drafter)
            await self._ask_then_emit_deferred(DraftMsg(self.scheduler.drafter, wanted))
        except EngineDeadError:
            raise
        except Exception:
            self.num_draft_failures += 1
            if _power_of_ten(self.num_draft_failures):  # a lasting fault is logged, not every step
                logger.exception("draft model: drafting failed (%d times so far); this step verifies no drafts",
                                 self.num_draft_failures)

    async def _ask_then_emit_deferred(self, msg: StepMsg | DraftMsg):
        """Ask the worker (the step goes to its compute thread at once, `WorkerActor.ask_nowait`); the deferred
        deltas are emitted on the loop after that, while the step runs."""
        reply = self.worker.ask_nowait(msg)
        if self._deferred:
            asyncio.get_running_loop().call_soon(self._emit_deferred)
        return await reply

    def _on_message(self, msg) -> None:
        if isinstance(msg, AddRequestMsg):
            rid = msg.stream.request_id
            self.streams[rid] = msg.stream
            self.seqs[rid] = list(msg.seqs)
            for seq in msg.seqs:
                p = seq.params
                self.detoks[seq.seq_id] = IncrementalDetokenizer(
                    self.tokenizer, stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output,
                    count_text_tokens=p.logprobs is not None, min_tokens=p.min_tokens)
                if p.logprobs is not None:
                    self.held_logprobs[seq.seq_id] = []
                self.scheduler.add(seq)
        elif isinstance(msg, AbortRequestMsg):
            self._emit_deferred()  # its last token goes out before the abort
            for seq in self.seqs.get(msg.request_id, []):
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ABORT)
                    self._emit(seq, None, new_token=False)
        else:
            raise TypeError(f"scheduler: unknown message {msg!r}")

    def _emit(self, seq: Sequence, logprob: TokenLogprob | None, new_token: bool = True) -> None:
        """Detokenize seq's newest tokens, apply stop strings, and deliver the delta (runs once per token: lean).

        Logprobs follow the text, not the tokens: the delta carries those of the tokens whose text it releases
        (`IncrementalDetokenizer.num_text_tokens`), so a token whose text is held back has its logprob held with
        it, and the tokens left out of the final text (the EOS or stop token, tokens from a matched stop string's
        start on) get none, streamed or not.

        The consumer is woken by a callback queued at the first delivery since the last wake-up; the next step
        reaches the worker thread as `ask_nowait` is called (`WorkerActor.ask_nowait` hands it to the compute
        thread directly), before any consumer formats and writes its chunk.
        """
        detok = self.detoks.get(seq.seq_id)
        if detok is None:
            return
        # the tokens of the last update: one, or a verify's accepted drafts and its own token
        tokens = seq.output_ids[len(detok.token_ids):] if new_token else []
        finished = seq.is_finished
        text = ""
        held = self.held_logprobs.get(seq.seq_id)  # None: no logprobs asked
        if held is not None:
            num_released = detok.num_text_tokens
            if logprob is not None:
                held.append(logprob)
        pushed = tokens[:-1] if tokens and finished and seq.stop_reason == tokens[-1] else tokens
        if pushed:
            if len(pushed) > 1 and seq.params.stop:
                text, matched, tokens = self._push_to_stop(seq, detok, pushed, tokens)
            else:
                text, matched = detok.push(pushed)
            if matched is not None:
                if finished:  # it also hit max_tokens or EOS this step: the stop string explains the end
                    seq.finish_reason, seq.stop_reason = FinishReason.STOP, matched
                else:
                    self.scheduler.finish(seq, FinishReason.STOP, matched)
                    finished = seq.is_finished
        if finished and seq.finish_reason is not FinishReason.ABORT and not isinstance(seq.stop_reason, str):
            text += detok.flush()
        logprobs = None
        if held is not None:
            num_out = detok.num_text_tokens - num_released
            logprobs = held[:num_out]
            del held[:num_out]
        rid = seq.request_id
        stream = self.streams[rid]
        stream.put(RequestOutput(
            rid, seq.index, tokens, text, logprobs, seq.finish_reason, seq.stop_reason,
            len(seq.prompt_ids), seq.num_cached_tokens, len(seq.output_ids),
        ), wake=False)
        if self._to_wake:
            self._to_wake.append(stream)
        else:
            try:
                asyncio.get_running_loop().call_soon(self._wake_streams)
                self._to_wake.append(stream)
            except RuntimeError:  # no running loop (a synchronous caller): wake at once
                stream.wake()
        if finished:
            self._forget(seq)

    def _push_to_stop(self, seq: Sequence, detok, pushed: list[int], tokens: list[int]):
        """Detokenize a verify's tokens (the detokenizer takes them one by one, up to the one that completes a stop
        string); the tokens after it are dropped from the sequence (as the plain engine never makes them).
        Returns (text, the matched stop string or None, the step's tokens kept)."""
        num_before = len(detok.token_ids)
        text, matched = detok.push(pushed)
        if matched is None:
            return text, None, tokens
        used = len(detok.token_ids) - num_before
        extra = len(tokens) - used
        if extra:
            seq.truncate_output(len(seq.output_ids) - extra, self.scheduler.block_size)
        return text, matched, tokens[:used]

    def _emit_deferred(self) -> None:
        """Emit the last step's deferred deltas (before the next update appends more tokens)."""
        deferred, self._deferred = self._deferred, []
        for seq, logprob in deferred:
            self._emit(seq, logprob)

    def _wake_streams(self) -> None:
        streams, self._to_wake = self._to_wake, []
        for stream in streams:
            stream.wake()

    def _forget(self, seq: Sequence) -> None:
        """Drop a sequence whose final delta went out; the request goes once all of its final deltas did."""
        self.detoks.pop(seq.seq_id, None)
        self.held_logprobs.pop(seq.seq_id, None)  # those left are of tokens outside the final text
        rid = seq.request_id
        if not any(s.seq_id in self.detoks for s in self.seqs.get(rid, [])):
            self.seqs.pop(rid, None)
            self.request_ids.release(rid, self.streams.pop(rid, None))

    def _fail_step(self, plan, exc: Exception) -> None:
        """A step raised: end its requests with StepFailedError and free their blocks. Several failures in a row
        mean the device is broken: re-raise, which kills the engine (EngineDeadError for everyone)."""
        self.num_failed_steps_in_row += 1
        if self.num_failed_steps_in_row >= MAX_FAILED_STEPS_IN_ROW:
            raise exc
        # the requests of the plan's sequences still here: an entry's request may have been aborted while the step
        # ran (a step planned ahead), and a later request may hold its id by now
        request_ids = {e.seq.request_id for e in plan.entries if e.seq in self.seqs.get(e.seq.request_id, ())}
        logger.error("step failed (%r); failing its %d requests", exc, len(request_ids), exc_info=exc)
        error = StepFailedError(f"internal error while running the request: {type(exc).__name__}")
        for rid in request_ids:
            self._fail_request(rid, error)

    def _fail_grammar(self, seq: Sequence) -> None:
        """`seq`'s grammar failed mid-output (`Sequence.error`): its request fails with InvalidRequestError (the
        client's schema is the cause: a 400, or an error event mid-stream) rather than ending as a stop."""
        rid = seq.request_id
        if rid not in self.streams:  # a sibling sequence failed it already this step
            return
        logger.warning("request %s: constrained decoding failed, failing the request: %s", rid, seq.error)
        self._fail_request(rid, InvalidRequestError(
            f"constrained decoding failed on the grammar this request asks for (its JSON schema or tool "
            f"parameters): {seq.error}"))

    def _fail_request(self, rid: str, error: Exception) -> None:
        """End every sequence of request `rid` (freeing their KV blocks) and fail its stream with `error`; the
        deltas already put still reach the consumer first."""
        stream = self.streams.pop(rid, None)
        self.request_ids.release(rid, stream)
        for seq in self.seqs.pop(rid, []):
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.detoks.pop(seq.seq_id, None)
            self.held_logprobs.pop(seq.seq_id, None)
        if stream is not None:
            stream.fail(error)

    def _abort_all(self) -> None:
        for rid in list(self.seqs):
            self._on_message(AbortRequestMsg(rid))

    def fail_all(self, exc: BaseException) -> None:
        """Engine death: every open stream ends with an error."""
        for stream in self.streams.values():
            stream.fail(exc)
        self.streams.clear()
        self.request_ids.clear()


def _power_of_ten(n: int) -> bool:
    return n > 0 and 10 ** (len(str(n)) - 1) == n
