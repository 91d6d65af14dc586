"""The engine process's output sender (actors/core_outputs.py) when a write to the API process fails.

Before: any OSError was taken for "the API process is gone" and ended the sender thread quietly, while the engine
process ran on. A write that failed with the API process still alive (a pickling error, or BlockingIOError from a
socket left non-blocking) then left the API process waiting forever for outputs. Now the failure reaches
`on_send_error`, and `EngineCore` exits with code 1 (0 when the API process is really gone).
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from multiprocessing import Pipe

import pytest

from actors.core_outputs import OutputForwarder, api_gone
from actors.engine_core import EngineCore
from actors.engine_ipc import ReadyMsg, StopMsg


def _forwarder(send):
    errors: list[BaseException] = []
    failed = threading.Event()

    def on_error(exc):
        errors.append(exc)
        failed.set()

    return OutputForwarder(send, dict, on_send_error=on_error), errors, failed


@pytest.mark.parametrize("exc", [BlockingIOError(11, "would block"), pickle.PicklingError("no"), TypeError("x"),
                                 BrokenPipeError(), EOFError()])
def test_a_failed_write_is_reported_and_ends_the_sending(exc):
    sent: list = []

    def send(msg):
        if msg == "bad":
            raise exc
        sent.append(msg)

    fwd, errors, failed = _forwarder(send)
    fwd.send("first")
    fwd.send("bad")
    assert failed.wait(5)
    fwd.send("after")  # queued, never written: the thread has stopped
    fwd.close()
    assert sent == ["first"] and errors == [exc]


def test_api_gone_is_only_a_closed_peer():
    assert api_gone(EOFError()) and api_gone(BrokenPipeError()) and api_gone(ConnectionResetError())
    assert not api_gone(BlockingIOError()) and not api_gone(pickle.PicklingError()) and not api_gone(OSError())


def test_close_without_failure_reports_nothing():
    sent: list = []
    fwd, errors, failed = _forwarder(sent.append)
    fwd.send("a")
    fwd.close()
    assert sent == ["a"] and errors == [] and not failed.is_set()


class _TinyEngine:
    """What EngineCore needs of an AsyncEngine, nothing more."""

    model_config = tokenizer = chat_template = None
    max_model_len = 16

    def __init__(self, config, on_death):
        self.stopped = False

    async def start(self):
        pass

    async def stop(self):
        self.stopped = True

    def kv_stats(self):
        return {}


class _FailingSendConn:
    """The engine side of a real pipe whose writes fail with `exc` (reads and the descriptor are the pipe's)."""

    def __init__(self, conn, exc):
        self._conn, self._exc = conn, exc

    def send(self, msg):
        raise self._exc

    def __getattr__(self, name):
        return getattr(self._conn, name)


@pytest.mark.parametrize("exc,code", [(pickle.PicklingError("unpicklable output"), 1), (BrokenPipeError(), 0)])
def test_engine_core_exits_when_its_writes_fail(exc, code):
    """The ReadyMsg write fails: EngineCore.run returns (the process exits) instead of serving silently."""
    ours, theirs = Pipe()
    try:
        core = EngineCore(None, _FailingSendConn(ours, exc), engine_factory=_TinyEngine)
        assert asyncio.run(asyncio.wait_for(core.run(), 10)) == code
        assert core.engine.stopped
    finally:
        theirs.close()


def test_engine_core_serves_until_stopped_when_writes_work():
    ours, theirs = Pipe()
    core = EngineCore(None, ours, engine_factory=_TinyEngine)

    async def drive():
        task = asyncio.ensure_future(core.run())
        ready = await asyncio.to_thread(theirs.recv)
        assert isinstance(ready, ReadyMsg) and ready.max_model_len == 16
        theirs.send([StopMsg()])
        return await asyncio.wait_for(task, 10)

    try:
        assert asyncio.run(drive()) == 0
    finally:
        theirs.close()


async def test_open_requests_count_unfinished_sequences():
    """`open_requests` is what a shared engine aborts when the API process that sent them goes away: a request
    leaves it once every sequence put its final delta, or when it failed."""
    from voltserve.request import FinishReason, RequestOutput

    def out(rid, index, finish=None):
        return RequestOutput(rid, index, [5], "x", None, finish, None, 1, 0, 1)

    sent: list = []
    fwd, errors, _ = _forwarder(sent.append)
    pair, single = fwd.stream("pair", 2), fwd.stream("single")
    assert fwd.open_requests == {"pair": 2, "single": 1}
    pair.put(out("pair", 0), wake=False)
    pair.put(out("pair", 0, FinishReason.STOP), wake=False)
    assert fwd.open_requests == {"pair": 1, "single": 1}
    single.fail(RuntimeError("step failed"))
    pair.put(out("pair", 1, FinishReason.LENGTH), wake=False)
    assert fwd.open_requests == {}
    fwd.flush()
    fwd.close()
    fwd.stream("late").put(out("late", 0), wake=False)
    fwd.flush()  # closed: dropped, not queued
    assert len(sent) == 1 and [o[0] for o in sent[0].outputs] == ["pair"] * 3 and errors == []
    assert [rid for rid, _ in sent[0].failures] == ["single"]


class _SlowBrokenConn(_FailingSendConn):
    """A write that takes a while, then finds the API process gone."""

    def send(self, msg):
        time.sleep(0.3)
        raise BrokenPipeError()


def test_an_api_process_gone_mid_write_is_dropped_once():
    """EOF on its socket (the reader) and the failed write (the sender thread) both report the API process
    gone: the engine stops once, with code 0, and no error reaches the event loop."""
    errors: list[dict] = []

    async def drive() -> int:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        ours, theirs = Pipe()
        core = EngineCore(None, _SlowBrokenConn(ours, None), engine_factory=_TinyEngine)
        task = asyncio.ensure_future(core.run())
        await asyncio.sleep(0.05)
        theirs.close()
        code = await asyncio.wait_for(task, 10)
        await asyncio.sleep(0.5)  # the sender's report, after the reader's
        return code

    assert asyncio.run(drive()) == 0
    assert errors == []
