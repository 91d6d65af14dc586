"""The HTTP app around the real engine: a client that disconnects mid-stream gets its KV blocks freed."""

import asyncio

import orjson

from actors.engine import AsyncEngine
from api import create_app
from voltserve.config import EngineConfig

MODEL = "smollm2-135m-instruct"


async def test_disconnect_mid_stream_frees_kv_blocks(smollm2):
    engine = AsyncEngine(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=128, max_model_len=2048),
                         loaded=smollm2)
    app = create_app(engine)
    body = {"model": MODEL, "stream": True, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one to one thousand."}]}
    async with app.test_app() as test_app:
        client = test_app.test_client()
        async with client.request("/v1/chat/completions", method="POST",
                                  headers={"content-type": "application/json"}) as connection:
            await connection.send(orjson.dumps(body))
            await connection.send_complete()
            assert (await connection.receive()).startswith(b"data: ")  # role delta
            assert b'"content"' in await connection.receive()  # a first token: blocks are in use now
            stats = engine.kv_stats()
            assert stats["num_running"] == 1 and stats["num_free_blocks"] < stats["num_blocks"]
            await connection.disconnect()
        for _ in range(200):  # abort is processed at the next step boundary
            stats = engine.kv_stats()
            if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
                break
            await asyncio.sleep(0.02)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["num_free_blocks"] == stats["num_blocks"]
        engine._scheduler_actor.scheduler.pool.check_invariants()
        # the server keeps serving
        response = await client.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3})
        assert response.status_code == 200
        assert (await response.get_json())["usage"]["completion_tokens"] == 3
