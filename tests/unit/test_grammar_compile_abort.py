"""An abort while a request's grammar compiles (AsyncEngine.submit's thread): the stream must end, so a forwarded
request frees its id in the API process, and the cancelled compile must not drop a later request's compile
entry under the same id (its abort would then be lost and the request run unread)."""

import asyncio
import time
import types

import pytest

import actors.engine as engine_module
from actors.core_outputs import OutputForwarder
from actors.engine import AsyncEngine
from voltserve.config import EngineConfig
from voltserve.errors import RequestAbortedError
from voltserve.request import SamplingParams

GRAMMAR_PARAMS = SamplingParams(max_tokens=4, grammar='{"type": "object"}')


class _Scheduler:
    """Stands in for the scheduler actor: records what reaches it."""
    alive = True

    def __init__(self):
        self.messages = []

    def tell(self, msg):
        self.messages.append(msg)


@pytest.fixture
def engine(monkeypatch):
    def slow_compile(tokenizer, grammar, n):
        time.sleep(0.3)
        return [None] * n

    monkeypatch.setattr(engine_module, "GrammarState", types.SimpleNamespace(for_sequences=slow_compile))
    eng = AsyncEngine(EngineConfig(device="cpu"))
    eng._scheduler_actor, eng._worker = _Scheduler(), types.SimpleNamespace(alive=True)
    eng.model_config, eng.max_model_len, eng.tokenizer = types.SimpleNamespace(vocab_size=100), 64, None
    return eng


async def test_abort_while_compiling_ends_a_forwarded_stream(engine):
    sent = []
    forwarder = OutputForwarder(sent.append, lambda: {})
    engine.submit([1, 2], GRAMMAR_PARAMS, 4, forwarder.stream("dup", 1))
    await asyncio.sleep(0.05)
    engine.abort("dup")
    await asyncio.sleep(0.5)
    forwarder.flush()
    failures = [f for msg in sent for f in msg.failures]
    assert [(rid, type(exc)) for rid, exc in failures] == [("dup", RequestAbortedError)]
    assert forwarder.open_requests == {} and engine._scheduler_actor.messages == []


async def test_a_reused_id_keeps_its_compile_entry_and_its_abort(engine):
    first = engine.add_request([1, 2], GRAMMAR_PARAMS, request_id="dup")
    await asyncio.sleep(0.05)
    first.abort()  # settled at once: the id may be reused
    engine.add_request([1, 2], GRAMMAR_PARAMS, request_id="dup")
    await asyncio.sleep(0.05)  # the first compile's cancellation has run its cleanup by now
    assert engine._compiling.get("dup") is not None
    engine.abort("dup")  # the second request's client leaves while it compiles
    await asyncio.sleep(0.5)
    assert engine._scheduler_actor.messages == []  # never queued, no stray abort
