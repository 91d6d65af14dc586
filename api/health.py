"""GET /health (open even with an API key: load balancers probe it) and GET /version."""

from __future__ import annotations

import orjson
from quart import Blueprint, Response

import voltserve
from api.state import get_state

bp = Blueprint("health", __name__)


@bp.get("/health")
async def health():
    """200 `{"status": "ok"}` while the engine serves; 503 in the OpenAI error shape once it is dead."""
    get_state().ready_engine()  # raises EngineDeadError -> 503
    return Response(orjson.dumps({"status": "ok"}), content_type="application/json")


@bp.get("/version")
async def version():
    """`{"version": "<voltserve version>"}`."""
    return Response(orjson.dumps({"version": voltserve.__version__}), content_type="application/json")
