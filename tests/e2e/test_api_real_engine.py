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


async def test_stop_sequences_match_the_generated_text_only_not_the_prefill(smollm2):
    """Anthropic Messages with an assistant prefill: `stop_sequences` are matched against the text the model
    generates, as Anthropic's are (the prefill is input, not output): a stop sequence that spans the prefill's end
    and the generated text ("...is Par" + "is." holds "Paris"), or one inside the prefill, does not stop the
    output; one inside the generated text does. Streamed alike. Greedy answers of the default model:
    "The capital of France" + " is Paris."."""
    engine = AsyncEngine(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=128, max_model_len=2048),
                         loaded=smollm2)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    cases = [  # (prefill, stop_sequences, text, stop_reason, stop_sequence)
        ("The capital of France is Par", ["Paris"], "is.", "end_turn", None),
        ("The capital of France", ["France is", "capital"], " is Paris.", "end_turn", None),
        ("The capital of France", ["France is", " Paris"], " is", "stop_sequence", " Paris"),
    ]
    async with create_app(engine).test_app() as test_app:
        client = test_app.test_client()
        for prefill, stops, text, stop_reason, stop_sequence in cases:
            body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stop_sequences": stops,
                    "messages": [*question, {"role": "assistant", "content": prefill}]}
            response = await client.post("/v1/messages", json=body)
            assert response.status_code == 200
            message = await response.get_json()
            assert (message["content"], message["stop_reason"], message["stop_sequence"]) == \
                ([{"type": "text", "text": text}], stop_reason, stop_sequence), (prefill, stops)
            streamed = await client.post("/v1/messages", json={**body, "stream": True})
            events = [orjson.loads(line.removeprefix(b"data: ")) for line in (await streamed.get_data()).split(b"\n")
                      if line.startswith(b"data: ")]
            deltas = [e["delta"] for e in events if e["type"] in ("content_block_delta", "message_delta")]
            assert "".join(d.get("text", "") for d in deltas) == text
            assert (deltas[-1]["stop_reason"], deltas[-1]["stop_sequence"]) == (stop_reason, stop_sequence)
