"""A request's way to its first token: the engine process gets a new request at once (aborts still wait for the
end of the loop turn), short prompts are rendered and tokenized on the event loop, and the body is read without
`asyncio.wait_for`'s task, keeping get_data's checks."""

from __future__ import annotations

import asyncio

import orjson

from actors.engine_ipc import AbortMsg, AddMsg
from actors.engine_process import ProcessEngine
from api.openai import common
from api.openai.chat_prompt import chat_prompt_ids
from api.openai.protocol import ChatCompletionRequest, parse_request
from tests.api.conftest import MODEL, chat_body
from tests.api.fake_engine import ScriptedEngine
from voltserve.config import EngineConfig, ModelConfig
from voltserve.request import SamplingParams


class _Conn:
    def __init__(self):
        self.sent = []

    def send(self, obj) -> None:
        self.sent.append(obj)


async def test_process_engine_sends_a_new_request_at_once_and_batches_aborts():
    engine = ProcessEngine(EngineConfig(model=MODEL))
    engine._loop, engine._conn, engine._started = asyncio.get_running_loop(), _Conn(), True
    engine.model_config, engine.max_model_len = ModelConfig("t", 256, 64, 64, 1, 1, 1, 64), 64
    engine.abort("old")
    stream = engine.add_request([1, 2], SamplingParams(max_tokens=4))
    # no loop turn yet: the add went out, after the abort queued before it
    assert [[type(c) for c in batch] for batch in engine._conn.sent] == [[AbortMsg, AddMsg]]
    assert engine._conn.sent[0][1].request_id == stream.request_id
    engine.abort(stream.request_id)
    assert len(engine._conn.sent) == 1  # aborts wait for the end of the loop turn
    await asyncio.sleep(0)
    assert engine._conn.sent[1] == [AbortMsg(stream.request_id)]


async def test_short_prompts_skip_the_thread_long_ones_take_it(monkeypatch):
    threaded = []

    async def to_thread(fn, *args):
        threaded.append(fn)
        return fn(*args)

    monkeypatch.setattr(common.asyncio, "to_thread", to_thread)
    engine = ScriptedEngine()

    async def ids(**body) -> list[int]:
        return await chat_prompt_ids(engine, parse_request(ChatCompletionRequest, orjson.dumps(chat_body(**body))))

    short = await ids()
    assert threaded == [] and short == engine.tokenizer.encode(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", parse_special=True)
    long_text = "x" * (common.INLINE_PROMPT_CHARS + 1)
    assert await ids(messages=[{"role": "user", "content": long_text}]) == await ids(
        messages=[{"role": "user", "content": [{"type": "text", "text": long_text}]}])
    assert len(threaded) == 2
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    await ids(tools=tools)
    assert len(threaded) == 3
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    await ids(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    assert len(threaded) == 4


async def test_request_body_keeps_get_data_checks():
    """`request_body` (no wait_for task) answers as `get_data` would: the body, 413 over MAX_CONTENT_LENGTH, and
    RequestTimeout when the body does not arrive in BODY_TIMEOUT."""
    from quart import Quart

    app = Quart("body-test")
    app.config["MAX_CONTENT_LENGTH"] = 16

    @app.post("/echo")
    async def echo():
        return await common.request_body()

    client = app.test_client()
    assert await (await client.post("/echo", data=b"0123456789")).get_data() == b"0123456789"
    assert (await client.post("/echo", data=b"x" * 17)).status_code == 413

    async with app.test_request_context("/echo", method="POST"):
        from quart import request

        request.body_timeout = 0.01
        request.body = asyncio.get_running_loop().create_future()  # a body that never completes
        try:
            await common.request_body()
        except Exception as exc:
            assert type(exc).__name__ == "RequestTimeout"
        else:
            raise AssertionError("no RequestTimeout")
