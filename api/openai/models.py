"""GET /v1/models and GET /v1/models/{model}, in OpenAI's shape (https://platform.openai.com/docs/api-reference/models)
or, for a client that sends `anthropic-version` (Anthropic's SDKs always do), Anthropic's
(https://docs.anthropic.com/en/api/models-list)."""

from __future__ import annotations

import datetime

from quart import Blueprint, request
from werkzeug.routing import PathConverter

from api.anthropic.protocol import ModelInfo, ModelInfoList
from api.openai.common import json_response
from api.openai.protocol import ModelCard, ModelList
from api.state import get_state

bp = Blueprint("openai_models", __name__)


class ModelIdConverter(PathConverter):
    """A model id in a URL: any text, slashes included, a leading one too (werkzeug's `path` converter refuses
    that), so a model served under a local path (`/root/model.gguf`) is retrieved as /v1/models listed it."""

    regex = ".+"
    part_isolating = False  # werkzeug would infer True from a regex without "/"


bp.record_once(lambda setup: setup.app.url_map.converters.setdefault("model_id", ModelIdConverter))


def _card():
    """The served model in the shape the client speaks."""
    state = get_state()
    name = state.config.served_model_name
    if "anthropic-version" in request.headers:
        created = datetime.datetime.fromtimestamp(state.started_s, datetime.timezone.utc)
        return ModelInfo(id=name, display_name=name, created_at=created.isoformat().replace("+00:00", "Z"))
    max_model_len = state.engine.max_model_len if state.engine is not None else state.config.max_model_len
    return ModelCard(id=name, created=state.started_s, max_model_len=max_model_len)


@bp.get("/v1/models")
async def list_models():
    """The one served model, with its context window."""
    card = _card()
    if isinstance(card, ModelInfo):
        return json_response(ModelInfoList(data=[card], first_id=card.id, last_id=card.id))
    return json_response(ModelList(data=[card]))


# merge_slashes off: werkzeug would answer `/v1/models//root/m.gguf` (how an SDK sends the id `/root/m.gguf`)
# with an HTML redirect to `/v1/models/root/m.gguf`
@bp.get("/v1/models/<model_id:model>", merge_slashes=False)
async def retrieve_model(model: str):
    """The served model by its name; any other name is a 404 (model_not_found)."""
    get_state().check_model(model)
    return json_response(_card())
