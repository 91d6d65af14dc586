"""Start a real AsyncEngine on the default model for a test."""

from __future__ import annotations

import contextlib

import pytest

from actors.engine import AsyncEngine
from voltserve.config import EngineConfig
from voltserve.errors import EngineDeadError
from voltserve.request import SamplingParams


@contextlib.asynccontextmanager
async def running_engine(loaded, **config):
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("max_model_len", 2048)
    config.setdefault("device", "cpu")
    engine = AsyncEngine(EngineConfig(model="smollm2-135m-instruct", **config), loaded=loaded)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def assert_engine_dead(engine, stream) -> None:
    """The contract of a dead engine (AsyncEngine or ProcessEngine): the open stream ends in EngineDeadError,
    the engine reports unhealthy, and a new request is refused with EngineDeadError."""
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    assert not engine.is_healthy
    with pytest.raises(EngineDeadError):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))


def chat_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.chat_template.render([{"role": "user", "content": text}]))


async def complete(engine, prompt_ids, **params) -> tuple[str, list[int], object]:
    """Run one request to the end; returns (text, token ids, last output)."""
    text, tokens, last = "", [], None
    async for out in engine.generate(prompt_ids, SamplingParams(**params)):
        text += out.text
        tokens += out.token_ids
        last = out
    return text, tokens, last
