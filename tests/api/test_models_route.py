"""GET /v1/models and /v1/models/{model}: OpenAI's shape, and Anthropic's for a client that sends
`anthropic-version` (read by both SDKs in-process over ASGI); a model id that starts with "/" (a model served under
its local path) retrieved as listed."""

from __future__ import annotations

import anthropic
import httpx
import httpx2
import openai
import orjson
import pytest

from api import create_app
from tests.api.conftest import MODEL, fixed_id
from tests.api.fake_engine import ScriptedEngine
from voltserve.config import EngineConfig

ANTHROPIC = {"anthropic-version": "2023-06-01"}


async def test_openai_shape(serve):
    async with serve() as (client, _):
        one = await client.get(f"/v1/models/{MODEL}")
        missing = await client.get("/v1/models/gpt-9")
    card = orjson.loads(await one.get_data())
    assert isinstance(card.pop("created"), int)  # when the server started
    assert card == {"id": MODEL, "object": "model", "owned_by": "voltserve", "max_model_len": 256}
    assert missing.status_code == 404
    assert orjson.loads(await missing.get_data())["error"]["code"] == "model_not_found"


async def test_anthropic_shape_for_anthropic_clients(serve):
    async with serve() as (client, _):
        listed = orjson.loads(await (await client.get("/v1/models", headers=ANTHROPIC)).get_data())
        one = orjson.loads(await (await client.get(f"/v1/models/{MODEL}", headers=ANTHROPIC)).get_data())
        missing = await client.get("/v1/models/claude-x", headers=ANTHROPIC)
    assert listed == {"data": [one], "has_more": False, "first_id": MODEL, "last_id": MODEL}
    assert (one["type"], one["id"], one["display_name"], one["lifecycle"]) == ("model", MODEL, MODEL, "active")
    assert one["created_at"].endswith("Z")
    assert missing.status_code == 404
    assert orjson.loads(await missing.get_data())["error"]["type"] == "not_found_error"


async def test_both_sdks_read_them():
    engine = ScriptedEngine()
    engine.config = EngineConfig(model=MODEL).validate()
    app = create_app(engine, new_id=fixed_id, clock=lambda: 1700000000)
    async with app.test_app():
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test") as http:
            claude = anthropic.AsyncAnthropic(base_url="http://test", api_key="x", http_client=http, max_retries=0)
            listed = [m.id async for m in claude.models.list()]
            info = await claude.models.retrieve(MODEL)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            gpt = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
            models = [m.id async for m in gpt.models.list()]
            model = await gpt.models.retrieve(MODEL)
    assert listed == [MODEL] and (info.id, info.type) == (MODEL, "model")
    assert models == [MODEL] and model.id == MODEL


@pytest.mark.parametrize("name", ["/root/.cache/voltserve/SmolLM2-135M-Instruct.Q4_1.gguf", "/srv/models/qwen/"])
async def test_a_model_id_with_a_leading_slash_is_retrieved(name):
    """A model served under its path is listed with its id; GET /v1/models/{id} (a double slash, or the id
    percent-encoded as the SDK sends it) retrieves it; another id that starts with "/" is a 404 in JSON."""
    engine = ScriptedEngine()
    engine.config = EngineConfig(model=MODEL, served_model_name=name).validate()
    app = create_app(engine, new_id=fixed_id, clock=lambda: 1700000000)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        listed = orjson.loads(await (await client.get("/v1/models")).get_data())
        plain = await client.get(f"/v1/models/{name}")
        encoded = await client.get("/v1/models/" + name.replace("/", "%2F"))
        missing = await client.get("/v1/models//root/other.gguf")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            gpt = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
            retrieved = await gpt.models.retrieve(name)
            with pytest.raises(openai.NotFoundError):
                await gpt.models.retrieve("/root/other.gguf")
        card = {"id": name, "object": "model", "created": app.extensions["voltserve"].started_s,
                "owned_by": "voltserve", "max_model_len": 256}
        assert listed == {"object": "list", "data": [card]}
        for response in (plain, encoded):
            assert (response.status_code, orjson.loads(await response.get_data())) == (200, card)
        assert (missing.status_code, missing.content_type) == (404, "application/json")
        assert orjson.loads(await missing.get_data()) == {"error": {
            "message": f"The model `/root/other.gguf` does not exist (this server serves `{name}`).",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert retrieved.id == name
