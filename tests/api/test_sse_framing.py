"""Byte-exact SSE streams of both endpoints (fixed id and clock), usage chunks and n=2 indexing (case S5)."""

from __future__ import annotations

import orjson
from tests.api.conftest import MODEL, chat_body
from tests.api.fake_engine import ScriptedEngine

HEAD = b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":1700000000,"model":"test-model",'


def _chat_chunk(choices: bytes, usage: bytes | None = None) -> bytes:
    tail = b"" if usage is None else b',"usage":' + usage
    return HEAD + b'"choices":[' + choices + b"]" + tail + b"}\n\n"


async def test_chat_stream_bytes(serve):
    async with serve(ScriptedEngine(scripts=["Hé"])) as (client, _):
        response = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        body = await response.get_data()
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    expected = (
        _chat_chunk(b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}')
        + _chat_chunk(b'{"index":0,"delta":{"content":"H"},"logprobs":null,"finish_reason":null}')
        # "é" is two byte tokens: the first delta has no text and sends no chunk
        + _chat_chunk('{"index":0,"delta":{"content":"é"},"logprobs":null,"finish_reason":null}'.encode())
        + _chat_chunk(b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}')
        + b"data: [DONE]\n\n"
    )
    assert body == expected


async def test_completion_stream_bytes_with_usage(serve):
    async with serve(ScriptedEngine(scripts=["abc"], cached_tokens=1)) as (client, _):
        response = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "xy", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}})
        body = await response.get_data()
    head = b'data: {"id":"cmpl-0","object":"text_completion","created":1700000000,"model":"test-model","choices":['
    assert body == (
        head + b'{"index":0,"text":"a","logprobs":null,"finish_reason":null}],"usage":null}\n\n'
        + head + b'{"index":0,"text":"b","logprobs":null,"finish_reason":"length"}],"usage":null}\n\n'
        + head + b'],"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4,'
                 b'"prompt_tokens_details":{"cached_tokens":1}}}\n\n'
        + b"data: [DONE]\n\n"
    )


def _events(body: bytes) -> list:
    assert body.endswith(b"data: [DONE]\n\n")
    frames = body.split(b"\n\n")[:-2]
    assert all(f.startswith(b"data: ") for f in frames)
    return [orjson.loads(f[6:]) for f in frames]


async def test_S5_usage_n2_stream_indexes(serve):
    async with serve(ScriptedEngine(scripts=["ab", "xyz"], cached_tokens=3)) as (client, _):
        response = await client.post("/v1/chat/completions", json=chat_body(
            stream=True, n=2, stream_options={"include_usage": True}))
        events = _events(await response.get_data())
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    prompt_tokens = 3 + len(b"user\nHi\nassistant\n")  # 3 special tokens + one token per byte
    assert events[-1]["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": 3 + 4, "total_tokens": prompt_tokens + 7,
        "prompt_tokens_details": {"cached_tokens": 3}}
    per_index: dict[int, list] = {0: [], 1: []}
    for e in events[:-1]:
        (choice,) = e["choices"]
        per_index[choice["index"]].append(choice)
    for index, text in ((0, "ab"), (1, "xyz")):
        choices = per_index[index]
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == text
        assert [c["finish_reason"] for c in choices].count("stop") == 1 and choices[-1]["finish_reason"] == "stop"


async def test_chat_non_stream_exact_json(serve):
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        response = await client.post("/v1/chat/completions", json=chat_body(max_completion_tokens=1, logprobs=True,
                                                                            top_logprobs=1))
        body = await response.get_data()
    assert response.status_code == 200
    assert orjson.loads(body) == {
        "id": "chatcmpl-0", "object": "chat.completion", "created": 1700000000, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "o"}, "finish_reason": "length",
                     "logprobs": {"content": [{"token": "o", "logprob": 0.0, "bytes": [111],
                                               "top_logprobs": [{"token": "o", "logprob": 0.0, "bytes": [111]}]}]}}],
        "usage": {"prompt_tokens": 21, "completion_tokens": 1, "total_tokens": 22,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }


async def test_completion_logprobs_offsets(serve):
    async with serve(ScriptedEngine(scripts=["abc"])) as (client, _):
        response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "logprobs": 2,
                                                               "max_tokens": 3, "temperature": 0})
        choice = orjson.loads(await response.get_data())["choices"][0]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    # ScriptedEngine: logprob = -0.25 * (position % 4); top k = token ids id, id+1, ... with logprob - k
    assert choice["logprobs"] == {
        "tokens": ["a", "b", "c"], "token_logprobs": [0.0, -0.25, -0.5],
        "top_logprobs": [{"a": 0.0, "b": -1.0}, {"b": -0.25, "c": -1.25}, {"c": -0.5, "d": -1.5}],
        "text_offset": [0, 1, 2],
    }


TRICKY = 'a"b\\c\n\t\x01é€😀</script>\u2028'  # quotes, escapes, control bytes, 2-4 byte UTF-8, U+2028


async def test_stream_chunks_match_pydantic_rendering(serve):
    """Streamed chunks are assembled from bytes around each delta; every frame must be exactly what dumping the
    chunk's pydantic model gives (both endpoints, with and without usage, n=2, a stop string, a length finish)."""
    from api import sse
    from api.openai.protocol import ChatCompletionChunk, CompletionResponse

    cases = [
        ("/v1/chat/completions", ChatCompletionChunk, chat_body(stream=True, n=2)),
        ("/v1/chat/completions", ChatCompletionChunk, chat_body(stream=True, stop=["😀"],
                                                                stream_options={"include_usage": True})),
        ("/v1/chat/completions", ChatCompletionChunk, chat_body(stream=True, max_tokens=7)),
        ("/v1/completions", CompletionResponse, {"model": MODEL, "prompt": "x", "stream": True, "n": 2,
                                                 "max_tokens": 40}),
        ("/v1/completions", CompletionResponse, {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 9,
                                                 "stream_options": {"include_usage": True}}),
    ]
    for path, model, body in cases:
        async with serve(ScriptedEngine(scripts=[TRICKY, "ok"])) as (client, _):
            response = await client.post(path, json=body)
            data = await response.get_data()
        include_usage = "stream_options" in body
        frames = data.split(b"\n\n")[:-2]
        assert len(frames) >= 3 and data.endswith(b"data: [DONE]\n\n")
        for f in frames:
            event = model.model_validate(orjson.loads(f[6:]))
            assert f + b"\n\n" == sse.frame(event, exclude=None if include_usage else {"usage"}), f
