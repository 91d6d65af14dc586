"""Errors about the output token limit name the request's own field, in the message and in `param`: Responses'
`max_output_tokens`, Chat Completions' `max_completion_tokens` where given (`api.openai.common.add_request`,
`voltserve.request.check_output_budget`), never the engine's `max_tokens` (which these requests do not have).

The ScriptedEngine's window is 256 tokens; `body()`'s prompt ("Hi" in ChatML, one byte a token) is 21 tokens.
"""

from __future__ import annotations

import orjson
import pytest

from tests.api.conftest import MODEL, chat_body
from tests.api.fake_engine import ScriptedEngine

CONTEXT = ("This model's maximum context length is 256 tokens. However, you requested {total} tokens (21 in the "
           "prompt, {limit} for the completion). Reduce the prompt or {name}.")
REST = ("min_tokens ({min_tokens}) must be <= {name}; without {name} that is the rest of the context window: 235 "
        "tokens (256 less 21 in the prompt)")


def error(message: str, param: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def cases(name: str) -> list[tuple[dict, dict]]:
    """(request fields, expected error JSON) for every error that can speak of the token limit `name`."""
    return [
        ({name: 0}, error(f"{name} must be >= 1", name)),
        ({name: -3}, error(f"{name} must be >= 1", name)),
        ({name: 1000}, error(CONTEXT.format(total=1021, limit=1000, name=name), name, "context_length_exceeded")),
        ({name: 236}, error(CONTEXT.format(total=257, limit=236, name=name), name, "context_length_exceeded")),
        ({name: 2**70}, error(CONTEXT.format(total=2**70 + 21, limit=2**70, name=name), name,
                              "context_length_exceeded")),
        ({"min_tokens": 5, name: 2}, error(f"min_tokens must be <= {name}", "min_tokens")),
        ({"min_tokens": 500}, error(REST.format(min_tokens=500, name=name), "min_tokens")),
    ]


RESPONSES = cases("max_output_tokens")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fields, expected", RESPONSES, ids=[str(c[0]) for c in RESPONSES])
async def test_responses_errors_name_max_output_tokens(serve, fields, expected, stream):
    """Every 400 about the token limit of a Responses request says `max_output_tokens` (message and param), whether
    it streams or not (the checks run before any byte of a stream)."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, engine):
        response = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "stream": stream,
                                                            **fields})
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, expected)
        assert engine.requests == []
        # the highest limit that fits is served
        fits = await client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 235})
        assert fits.status_code == 200


# its range checks: tests/api/test_bad_input.py; without max_completion_tokens the request's name is max_tokens
CHAT = cases("max_completion_tokens")[2:-1]


@pytest.mark.parametrize("fields, expected", CHAT, ids=[str(c[0]) for c in CHAT])
async def test_chat_errors_name_max_completion_tokens(serve, fields, expected):
    """Chat Completions with `max_completion_tokens` (OpenAI's current name): the errors name it, not max_tokens."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        response = await client.post("/v1/chat/completions", json=chat_body(**fields))
        assert (response.status_code, orjson.loads(await response.get_data())) == (400, expected)


async def test_chat_errors_still_name_max_tokens(serve):
    """A request that says `max_tokens` (Chat Completions' older name, Completions') reads max_tokens."""
    async with serve(ScriptedEngine(scripts=["ok"])) as (client, _):
        chat = await client.post("/v1/chat/completions", json=chat_body(max_tokens=1000))
        completion = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 21, "min_tokens": 500})
    assert orjson.loads(await chat.get_data()) == error(
        CONTEXT.format(total=1021, limit=1000, name="max_tokens"), "max_tokens", "context_length_exceeded")
    assert orjson.loads(await completion.get_data()) == error(
        "min_tokens must be <= max_tokens", "min_tokens")
