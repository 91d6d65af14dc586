"""API-key check: `Authorization: Bearer <key>` or `x-api-key: <key>` on every route but /health."""

from __future__ import annotations

import hmac

from api.routing import merged_path
from voltserve.errors import AuthenticationError

OPEN_PATHS = frozenset({"/health"})


def check_api_key(expected: str, path: str, headers) -> None:
    """Raises AuthenticationError unless no key is configured, the path is open, or a header carries the key.

    Args:
        expected: the configured key ("" = auth off).
        path: the request path (with repeated slashes, its single-slash form is checked: the route it is served by).
        headers: the request headers (case-insensitive mapping).
    """
    if not expected or merged_path(path) in OPEN_PATHS:
        return
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    candidates = [headers.get("x-api-key"), token.strip() if scheme.lower() == "bearer" else None]
    # either header may carry the key; compare_digest: the time taken must not reveal how much matched
    if not any(c is not None and hmac.compare_digest(c.encode(), expected.encode()) for c in candidates):
        raise AuthenticationError("Incorrect or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key'.")
