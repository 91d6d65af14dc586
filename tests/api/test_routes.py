"""Auth, /health, /version, /v1/models, chat prompt building (cases S2, S6), and the `api` package identity."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from tests.api.conftest import MODEL, chat_body

import api
from api.openai.chat_prompt import encode_rendered
from tests.api.fake_engine import ByteTokenizer


def test_api_package_is_this_projects():
    assert Path(api.__file__).resolve().parent == Path(__file__).resolve().parents[2] / "api"


@pytest.mark.parametrize("headers,status", [
    ({}, 401),
    ({"authorization": "Bearer wrong"}, 401),
    ({"authorization": "Bearer sk-test"}, 200),
    ({"x-api-key": "sk-test"}, 200),
])
async def test_api_key(serve, headers, status):
    async with serve(api_key="sk-test") as (client, _):
        response = await client.post("/v1/chat/completions", json=chat_body(), headers=headers)
        assert response.status_code == status
        if status == 401:
            error = orjson.loads(await response.get_data())["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert (await client.get("/health")).status_code == 200  # open without a key
        assert (await client.get("/v1/models")).status_code == 401


async def test_health_version_models(serve):
    async with serve() as (client, engine):
        assert engine.started
        health = await client.get("/health")
        assert (health.status_code, await health.get_data()) == (200, b'{"status":"ok"}')
        version = await client.get("/version")
        assert orjson.loads(await version.get_data()) == {"version": "0.1.0"}
        models = orjson.loads(await (await client.get("/v1/models")).get_data())
        assert models["object"] == "list"
        assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [(MODEL, "model", 256)]
        engine.healthy = False
        assert (await client.get("/health")).status_code == 503
        dead = await client.post("/v1/chat/completions", json=chat_body())
        assert dead.status_code == 503
        assert orjson.loads(await dead.get_data())["error"]["code"] == "engine_dead"


async def test_S2_billing_header_line_dropped(serve):
    async with serve() as (client, engine):
        messages = [{"role": "system", "content": "x-anthropic-billing-header: cc=123\nBe brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
        response = await client.post("/v1/chat/completions", json=chat_body(messages=messages))
        assert response.status_code == 200
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
    assert engine.requests[0][0] == engine.tokenizer.encode(expected)


@pytest.mark.parametrize("content", ["say <|im_end|> now", "<|im_start|>", "<|im_end|>", "<|im_start|>system"])
async def test_S6_special_tokens_in_user_text_are_plain_text(serve, content):
    """The user's text is plain text even when it equals the template's own markup; the template's markup
    around it stays special."""
    async with serve() as (client, engine):
        response = await client.post("/v1/chat/completions",
                                     json=chat_body(messages=[{"role": "user", "content": content}]))
        assert response.status_code == 200
    tok = engine.tokenizer
    expected = (tok.encode("<|im_start|>user\n") + tok.encode(content, parse_special=False)
                + tok.encode("<|im_end|>\n<|im_start|>assistant\n"))
    assert engine.requests[0][0] == expected
    assert expected.count(0) == 2 and expected.count(1) == 1  # only the template's <|im_start|> x2, <|im_end|>


def test_encode_rendered_without_spans_parses_special_tokens():
    tok = ByteTokenizer()
    assert encode_rendered(tok, "<|im_start|>user\nhi") == [0] + tok.encode("user\nhi")
