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


MESSAGES_BODY = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
SLASHED = [  # (method, a path with repeated slashes, its single-slash form, body)
    ("POST", "/v1//chat/completions", "/v1/chat/completions", chat_body()),
    ("POST", "//v1/chat/completions", "/v1/chat/completions", chat_body()),
    ("POST", "/v1/chat//completions", "/v1/chat/completions", chat_body()),
    ("POST", "/v1///completions", "/v1/completions", {"model": MODEL, "prompt": "Hi"}),
    ("POST", "/v1//responses", "/v1/responses", {"model": MODEL, "input": "Hi"}),
    ("POST", "/v1//messages", "/v1/messages", MESSAGES_BODY),
    ("POST", "/v1/messages//count_tokens", "/v1/messages/count_tokens", MESSAGES_BODY),
    ("GET", "/v1//models", "/v1/models", None),
    ("GET", "//health", "/health", None),
]


@pytest.mark.parametrize("method, path, single, body", SLASHED, ids=[c[1] for c in SLASHED])
async def test_repeated_slashes_are_served_as_the_single_slash_path(serve, method, path, single, body):
    """Werkzeug answered `/v1//models` with an HTML 308 redirect: the request is served as `/v1/models` instead
    (the same status and bytes; a POST body is read once, no client has to follow a redirect)."""
    async with serve() as (client, _):
        kwargs = {"json": body} if body is not None else {}
        slashed = await client.open(path, method=method, **kwargs)
        plain = await client.open(single, method=method, **kwargs)
        assert (slashed.status_code, slashed.content_type) == (200, "application/json")
        assert (await slashed.get_data()) == (await plain.get_data())


INVALID_URL = {"type": "invalid_request_error", "param": None, "code": "unknown_url"}


@pytest.mark.parametrize("method, path, body, status, error", [
    ("POST", "/v1//nope", chat_body(), 404, {"error": {"message": "Invalid URL (POST /v1//nope)", **INVALID_URL}}),
    ("POST", "/v1/chat/completions//", chat_body(), 404,
     {"error": {"message": "Invalid URL (POST /v1/chat/completions//)", **INVALID_URL}}),
    ("GET", "/v1//chat/completions", None, 405, {"error": {
        "message": "The method is not allowed for the requested URL.", "type": "invalid_request_error", "param": None,
        "code": "method_not_allowed"}}),
    # the Messages routes answer in Anthropic's shape, with slashes repeated too
    ("POST", "/v1//messages/nope", MESSAGES_BODY, 404,
     {"type": "error", "error": {"type": "not_found_error", "message": "Invalid URL (POST /v1//messages/nope)"}}),
    ("POST", "/v1//messages", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, 400,
     {"type": "error", "error": {"type": "invalid_request_error", "message": "missing required field 'max_tokens'"}}),
    # the model-id route keeps its slashes: `/v1/models//x` asks for the model `/x`
    ("GET", "/v1/models//x", None, 404, {"error": {
        "message": f"The model `/x` does not exist (this server serves `{MODEL}`).", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}}),
])
async def test_repeated_slashes_keep_json_errors(serve, method, path, body, status, error):
    """Unknown routes, wrong methods and bad bodies under paths with repeated slashes: the JSON errors of their
    single-slash forms (the shape the route's API speaks), never an HTML page or a redirect."""
    async with serve() as (client, _):
        response = await client.open(path, method=method, **({"json": body} if body is not None else {}))
        assert (response.status_code, response.content_type) == (status, "application/json")
        assert orjson.loads(await response.get_data()) == error
        if status == 405:  # RFC 9110 section 15.5.6: the methods of the route, as the single-slash path says
            plain = await client.get(path.replace("//", "/"))
            assert _methods(response.headers["Allow"]) == _methods(plain.headers["Allow"]) == {"OPTIONS", "POST"}


def _methods(allow: str) -> set[str]:
    return {m.strip() for m in allow.split(",")}


async def test_repeated_slashes_answer_options_as_the_single_slash_path(serve):
    """A CORS preflight (OPTIONS) got the redirect too: it gets the route's own answer."""
    async with serve() as (client, _):
        slashed = await client.options("/v1//chat/completions")
        plain = await client.options("/v1/chat/completions")
    assert (slashed.status_code, await slashed.get_data()) == (plain.status_code, await plain.get_data()) == (200, b"")
    assert _methods(slashed.headers["Allow"]) == _methods(plain.headers["Allow"]) == {"OPTIONS", "POST"}


async def test_repeated_slashes_and_the_api_key(serve):
    """`//health` is `/health`, open without a key; `/v1//models` is `/v1/models`, a JSON 401 without one."""
    async with serve(api_key="sk-test") as (client, _):
        assert (await client.get("//health")).status_code == 200
        refused = await client.get("/v1//models")
        assert refused.status_code == 401
        assert orjson.loads(await refused.get_data())["error"]["code"] == "invalid_api_key"
        allowed = await client.get("/v1//models", headers={"x-api-key": "sk-test"})
        assert allowed.status_code == 200
