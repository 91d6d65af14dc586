"""Fixtures for the API tests: an app around a ScriptedEngine, with fixed ids and clock for exact bytes."""

from __future__ import annotations

import contextlib

import orjson
import pytest

from api import create_app
from tests.api.fake_engine import ScriptedEngine
from voltserve.config import EngineConfig

MODEL = "test-model"


def fixed_id(prefix: str) -> str:
    return prefix + "0"


@pytest.fixture
def serve():
    """`async with serve(engine, **config) as (client, engine)`: a running app with a Quart test client."""

    @contextlib.asynccontextmanager
    async def _serve(engine: ScriptedEngine | None = None, **config):
        engine = engine or ScriptedEngine()
        engine.config = EngineConfig(model=MODEL, **config).validate()
        app = create_app(engine, new_id=fixed_id, clock=lambda: 1700000000)
        async with app.test_app() as test_app:
            yield test_app.test_client(), engine

    return _serve


def chat_body(**extra) -> dict:
    """A valid chat request, with `extra` fields merged in."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}


async def leave_mid_stream(client, body: dict, chunks: int = 2) -> bytes:
    """POST a streamed chat request, read `chunks` body chunks, then disconnect as a client that leaves.

    Returns:
        the first chunk read.
    """
    async with client.request("/v1/chat/completions", method="POST",
                              headers={"content-type": "application/json"}) as connection:
        await connection.send(orjson.dumps(body))
        await connection.send_complete()
        first = await connection.receive()
        for _ in range(chunks - 1):
            await connection.receive()
        await connection.disconnect()
    return first
