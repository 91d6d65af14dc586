"""A failed step fails the requests of its own sequences only: a request aborted while its step ran (a step
planned ahead) may have its id taken by a later request before the failure is handled, and `_fail_step` used to
fail every request by id, the later one with it."""

from actors.request_ids import RequestIds
from actors.scheduler import AbortRequestMsg, AddRequestMsg, SchedulerActor
from actors.stream import RequestStream
from tests.api.fake_engine import ByteTokenizer
from tests.helpers import make_scheduler, make_seq
from voltserve.errors import StepFailedError
from voltserve.request import FinishReason
from voltserve.sequence import SequenceStatus


def _add(actor: SchedulerActor, ids: RequestIds, prompt: list[int]):
    stream = RequestStream("dup", 1, abort=lambda r: None)
    seq = make_seq(prompt, request_id="dup")
    ids.claim("dup", stream)
    actor._on_message(AddRequestMsg((seq,), stream))
    return stream, seq


def test_a_failed_step_spares_a_later_request_under_its_requests_id():
    ids = RequestIds()
    actor = SchedulerActor(make_scheduler(), None, ByteTokenizer(), request_ids=ids)
    old_stream, old_seq = _add(actor, ids, [1, 2, 3])
    plan = actor.scheduler.schedule()  # in flight from here on
    ids.drop("dup")  # AsyncEngine.abort: the id is free at once, the abort message queued
    actor._on_message(AbortRequestMsg("dup"))
    new_stream, new_seq = _add(actor, ids, [4, 5, 6])
    actor._fail_step(plan, RuntimeError("device fault"))
    assert old_seq.finish_reason is FinishReason.ABORT and old_stream.settled
    assert new_seq.status is SequenceStatus.WAITING and actor.scheduler.waiting[0] is new_seq
    assert actor.streams == {"dup": new_stream} and not new_stream.settled and "dup" in ids
    # the later request's own failed step does fail it, and frees its id
    actor._fail_step(actor.scheduler.schedule(), RuntimeError("device fault"))
    assert new_seq.finish_reason is FinishReason.ABORT and isinstance(new_stream._error, StepFailedError)
    assert "dup" not in ids and actor.scheduler.pool.num_free == actor.scheduler.pool.num_blocks
