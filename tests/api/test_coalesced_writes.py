"""Fewer writes per streamed token, the same bytes: SSE events that are ready together go out as one body chunk
(`drive_stream` over `RequestStream.pop_ready`, and the last deltas with usage and [DONE])."""

from __future__ import annotations

import orjson

from actors.stream import RequestStream
from api import sse
from api.openai import chat
from api.openai.protocol import ChatCompletionChunk, ChatCompletionRequest, parse_request
from tests.api.conftest import chat_body
from tests.api.fake_engine import ScriptedEngine, StreamedEngine
from voltserve.errors import StepFailedError
from voltserve.request import FinishReason, RequestOutput


def _out(index: int, text: str, finish=None, n: int = 1) -> RequestOutput:
    return RequestOutput("r", index, [3 + ord(text[:1] or "x")], text, None, finish, None, 2, 0, n)


def _events(stream, **body):
    """Chat's SSE body generator over `stream`, for a request with `body` fields (fixed id and clock)."""
    req = parse_request(ChatCompletionRequest, orjson.dumps(chat_body(stream=True, **body)))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return chat._stream_events(ScriptedEngine(), stream, req, chat._params(req), "chatcmpl-0", 1700000000,
                               include_usage)


async def _one_by_one(outputs: list, error: BaseException | None = None):
    """The same deltas from a source without `pop_ready`: one write per event, as before coalescing."""
    for out in outputs:
        yield out
    if error is not None:
        raise error


def _check_frames(data: bytes, include_usage: bool) -> None:
    """Every event of a body is exactly what its pydantic chunk renders to."""
    frames = data.split(b"\n\n")[:-2]
    assert data.endswith(b"\n\n" + sse.DONE)
    for f in frames:
        event = ChatCompletionChunk.model_validate(orjson.loads(f[6:]))
        assert f + b"\n\n" == sse.frame(event, exclude=None if include_usage else {"usage"}), f


async def test_ready_deltas_go_out_in_one_write_with_per_event_bytes():
    stream = RequestStream("r", 2, abort=lambda rid: None)
    writes = []
    events = _events(stream, n=2, stream_options={"include_usage": True}).__aiter__()
    writes += [await events.__anext__(), await events.__anext__()]  # the two role chunks, before any token
    steps = [[_out(0, "a"), _out(1, "x")], [_out(0, "b", FinishReason.STOP, 2), _out(1, "y", FinishReason.LENGTH, 2)]]
    for step in steps:  # one engine step: both choices' deltas are put before the consumer runs
        for out in step:
            stream.put(out)
        writes.append(await events.__anext__())
    assert [w async for w in events] == []
    assert len(writes) == 4
    assert writes[2].count(b"\n\n") == 2  # "a" and "x": one write
    assert writes[3].count(b"\n\n") == 4 and writes[3].endswith(sse.DONE)  # finals, usage, [DONE]: one write

    reference = [w async for w in _events(_one_by_one([o for step in steps for o in step]), n=2,
                                          stream_options={"include_usage": True})]
    assert len(reference) > len(writes)
    assert b"".join(writes) == b"".join(reference)
    _check_frames(b"".join(writes), include_usage=True)


async def test_error_and_done_after_ready_deltas_are_framed_in_band():
    stream = RequestStream("r", 1, abort=lambda rid: None)
    events = _events(stream).__aiter__()
    role = await events.__anext__()
    error = StepFailedError("internal error while running the request: RuntimeError")
    stream.put(_out(0, "a"))
    stream.fail(error)
    writes = [role] + [w async for w in events]
    assert writes[-1].startswith(b'data: {"error":') and writes[-1].endswith(b"\n\n" + sse.DONE)
    assert writes[-1].count(b"\n\n") == 2  # the error event and [DONE]: one write
    reference = [w async for w in _events(_one_by_one([_out(0, "a")], error))]
    assert b"".join(writes) == b"".join(reference)


async def test_keep_alive_comment_is_its_own_write():
    stream = RequestStream("r", 1, abort=lambda rid: None)
    req = parse_request(ChatCompletionRequest, orjson.dumps(chat_body(stream=True)))
    events = chat._stream_events(ScriptedEngine(), stream, req, chat._params(req), "chatcmpl-0", 1700000000,
                                 False, keep_alive_s=0.05).__aiter__()
    await events.__anext__()  # role
    assert await events.__anext__() == sse.KEEP_ALIVE
    stream.put(_out(0, "a", FinishReason.STOP))
    last = await events.__anext__()
    assert last.endswith(b"\n\n" + sse.DONE) and last.count(b"\n\n") == 2
    assert sse.KEEP_ALIVE not in last


async def test_app_stream_bytes_are_those_of_one_write_per_event(serve):
    """n=2 through a real RequestStream (both choices' deltas of a step arrive together and share a write) gives
    the body of the scripted per-event stream, byte for byte."""
    body = chat_body(stream=True, n=2, stream_options={"include_usage": True})

    async def run(engine) -> bytes:
        async with serve(engine) as (client, _):
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            return await response.get_data()

    coalesced = await run(StreamedEngine(scripts=["abc", "wxyz"], delay_s=0.01))
    assert coalesced == await run(ScriptedEngine(scripts=["abc", "wxyz"]))
    _check_frames(coalesced, include_usage=True)


async def test_stream_interval_groups_tokens_into_one_event_each():
    """RequestStream(interval=4) under chat's SSE body: the role chunk, the first token's event at once, then one
    event (one write) per 4 tokens, the finish with usage and [DONE] at once; every event as its chunk renders."""
    import asyncio

    stream = RequestStream("r", 1, abort=lambda rid: None, interval=4)
    events = _events(stream, stream_options={"include_usage": True}).__aiter__()
    writes = [await events.__anext__()]  # the role chunk
    stream.put(_out(0, "a"))
    writes.append(await asyncio.wait_for(events.__anext__(), 1))
    nxt = asyncio.ensure_future(events.__anext__())
    for n, text in enumerate("bcd", start=2):
        stream.put(_out(0, text, n=n))
        await asyncio.sleep(0)
    assert not nxt.done()
    stream.put(_out(0, "e", n=5))
    writes.append(await asyncio.wait_for(nxt, 1))
    stream.put(_out(0, "f", FinishReason.STOP, 6))
    writes.append(await asyncio.wait_for(events.__anext__(), 1))
    assert [w async for w in events] == []
    chunks = [[orjson.loads(f[6:]) for f in w.split(b"\n\n")[:-1] if f.startswith(b"data: {")] for w in writes]
    contents = [[c["choices"][0]["delta"].get("content") for c in w if c["choices"]] for w in chunks]  # not usage
    assert contents[1:3] == [["a"], ["bcde"]]
    assert contents[3][0] == "f" and writes[3].endswith(sse.DONE)
    _check_frames(b"".join(writes), include_usage=True)
