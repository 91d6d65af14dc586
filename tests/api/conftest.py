"""Fixtures for the API tests: an app around a ScriptedEngine, with fixed ids and clock for exact bytes; and
`server_url`, the default model behind a real hypercorn (for the slow SDK tests)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from api import create_app
from tests.api.fake_engine import ScriptedEngine
from tests.helpers import stop_process
from voltserve.config import EngineConfig

MODEL = "test-model"
ROOT = Path(__file__).resolve().parents[2]
REAL_MODEL = "smollm2-135m-instruct"  # served by `server_url`


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


async def wait_for_abort(engine, turns: int = 50) -> None:
    """Give a left stream's cancelled generator the loop turns its `finally` (the abort) needs: until
    `engine.aborted` is non-empty, at most `turns` sleeps of 10 ms."""
    for _ in range(turns):
        if engine.aborted:
            return
        await asyncio.sleep(0.01)


async def leave_mid_stream(client, body: dict, chunks: int = 2, path: str = "/v1/chat/completions") -> bytes:
    """POST a streamed request (chat by default) to `path`, read `chunks` body chunks, then disconnect as a client
    that leaves.

    Returns:
        the first chunk read.
    """
    async with client.request(path, method="POST",
                              headers={"content-type": "application/json"}) as connection:
        await connection.send(orjson.dumps(body))
        await connection.send_complete()
        first = await connection.receive()
        for _ in range(chunks - 1):
            await connection.receive()
        await connection.disconnect()
    return first


async def stream_until_engine_dies(client, engine: ScriptedEngine, path: str, body: dict,
                                   after_s: float = 0.08) -> bytes:
    """POST a streamed request to `path` and mark `engine` dead `after_s` seconds in (mid-stream).

    Returns:
        the whole response body.
    """
    async def kill() -> None:
        await asyncio.sleep(after_s)
        engine.healthy = False

    killer = asyncio.create_task(kill())
    response = await client.post(path, json=body)
    assert response.status_code == 200
    data = await response.get_data()
    await killer
    return data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hypercorn(smollm2_gguf, log_dir: Path, **settings):
    """A hypercorn subprocess serving the default model with VOLTSERVE_* `settings` beside the tests' own; yields
    its base URL once healthy, stops it after."""
    port = _free_port()
    env = {**os.environ, "VOLTSERVE_MODEL": REAL_MODEL, "VOLTSERVE_MAX_MODEL_LEN": "1024",
           "VOLTSERVE_NUM_KV_BLOCKS": "512", "VOLTSERVE_API_KEY": "",
           **{f"VOLTSERVE_{k.upper()}": str(v) for k, v in settings.items()}}
    log_path = log_dir / "hypercorn.log"
    with open(log_path, "wb") as log:
        # as README and tools/voltserve.service run it: the API process on uvloop (the engine process follows
        # VOLTSERVE_EVENT_LOOP, auto = uvloop too)
        proc = subprocess.Popen([sys.executable, "-m", "hypercorn", "-k", "uvloop", "api:app",
                                 "--bind", f"127.0.0.1:{port}"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after 240 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def server_url(smollm2_gguf, tmp_path_factory):
    """Base URL of a hypercorn subprocess serving the default model; stopped at the end of the session."""
    yield from _hypercorn(smollm2_gguf, tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="session", params=["ngram", "draft_model"])
def spec_server_url(request, smollm2_gguf, tmp_path_factory):
    """The same with speculative decoding (k = 4): n-gram drafts, or the model as its own draft model; the draft
    gate off (the tests count verify steps, and several tokens a delta)."""
    draft = {"speculative_model": str(smollm2_gguf)} if request.param == "draft_model" else {}
    yield from _hypercorn(smollm2_gguf, tmp_path_factory.mktemp("spec_server"), speculative_method=request.param,
                          num_speculative_tokens=4, speculative_gate="off", **draft)
