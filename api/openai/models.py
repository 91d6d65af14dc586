"""GET /v1/models (https://platform.openai.com/docs/api-reference/models/list)."""

from __future__ import annotations

from quart import Blueprint

from api.openai.common import json_response
from api.openai.protocol import ModelCard, ModelList
from api.state import get_state

bp = Blueprint("openai_models", __name__)


@bp.get("/v1/models")
async def list_models():
    """The one served model, with its context window."""
    state = get_state()
    max_model_len = state.engine.max_model_len if state.engine is not None else state.config.max_model_len
    card = ModelCard(id=state.config.served_model_name, created=state.started_s, max_model_len=max_model_len)
    return json_response(ModelList(data=[card]))
