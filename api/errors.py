"""The single table that maps error classes to HTTP: status, OpenAI error type/code, Anthropic error type.

Core code raises `voltserve.errors` exceptions and knows nothing about HTTP; this module is the only place
where they become status codes and JSON bodies. OpenAI shape (https://platform.openai.com/docs/guides/error-codes):
`{"error": {"message", "type", "param", "code"}}`; Anthropic shape
(https://docs.anthropic.com/en/api/errors): `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson
from quart import Response
from werkzeug.exceptions import HTTPException

from api.routing import merged_path
from voltserve import errors as E

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ErrorKind:
    """How one error class looks on the wire.

    Attributes:
        status: HTTP status code.
        openai_type: OpenAI `error.type`.
        anthropic_type: Anthropic `error.type`.
        code: OpenAI `error.code` (None = null).
    """

    status: int
    openai_type: str
    anthropic_type: str
    code: str | None = None

    @property
    def reason(self) -> str:
        """What a request ended by this error is counted under (`/metrics`): the OpenAI code, else its type."""
        return self.code or self.openai_type


# Most specific classes first: lookup walks the exception's MRO.
ERROR_TABLE: dict[type[BaseException], ErrorKind] = {
    E.ContextLengthError: ErrorKind(400, "invalid_request_error", "invalid_request_error", "context_length_exceeded"),
    E.InvalidRequestError: ErrorKind(400, "invalid_request_error", "invalid_request_error"),
    E.AuthenticationError: ErrorKind(401, "invalid_request_error", "authentication_error", "invalid_api_key"),
    E.ModelNotFoundError: ErrorKind(404, "invalid_request_error", "not_found_error", "model_not_found"),
    E.QueueFullError: ErrorKind(503, "server_error", "overloaded_error", "queue_full"),
    E.RequestAbortedError: ErrorKind(503, "server_error", "api_error", "request_aborted"),
    E.EngineDeadError: ErrorKind(503, "server_error", "api_error", "engine_dead"),
    E.ServerShuttingDownError: ErrorKind(503, "server_error", "overloaded_error", "server_shutting_down"),
    E.StepFailedError: ErrorKind(500, "server_error", "api_error", "step_failed"),
}
INTERNAL = ErrorKind(500, "server_error", "api_error")
# Werkzeug HTTP errors raised by Quart's routing and body parsing (404, 405, 413, ...).
HTTP_KINDS: dict[int, ErrorKind] = {
    404: ErrorKind(404, "invalid_request_error", "not_found_error", "unknown_url"),
    405: ErrorKind(405, "invalid_request_error", "invalid_request_error", "method_not_allowed"),
    408: ErrorKind(408, "invalid_request_error", "invalid_request_error", "request_timeout"),
    413: ErrorKind(413, "invalid_request_error", "request_too_large", "request_too_large"),
}


def _http_kind(code: int) -> ErrorKind:
    """The row of a werkzeug HTTP error: listed, else the client's fault (4xx) or the server's."""
    if code in HTTP_KINDS:
        return HTTP_KINDS[code]
    if 400 <= code < 500:
        return ErrorKind(code, "invalid_request_error", "invalid_request_error")
    return ErrorKind(code, "server_error", "api_error")


def kind_of(exc: BaseException) -> ErrorKind:
    """The table row for `exc` (its most specific listed base class), or the 500 row."""
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return INTERNAL


def openai_payload(message: str, kind: ErrorKind, param: str | None = None) -> dict:
    """OpenAI error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind.openai_type, "param": param, "code": kind.code}}


def openai_body(message: str, kind: ErrorKind, param: str | None = None) -> bytes:
    """`openai_payload` as JSON bytes."""
    return orjson.dumps(openai_payload(message, kind, param))


def anthropic_payload(message: str, kind: ErrorKind) -> dict:
    """Anthropic error object: `{"type": "error", "error": {"type", "message"}}`."""
    return {"type": "error", "error": {"type": kind.anthropic_type, "message": message}}


def payload(message: str, kind: ErrorKind, param: str | None = None, *, anthropic: bool = False) -> bytes:
    """The error body in the shape of the API the client speaks, as JSON bytes (Anthropic's has no `param`)."""
    if anthropic:
        return orjson.dumps(anthropic_payload(message, kind))
    return openai_body(message, kind, param)


def describe(exc: BaseException) -> tuple[ErrorKind, str, str | None]:
    """(table row, client-safe message, param) of an exception; unexpected ones say only "internal server error"."""
    kind = kind_of(exc)
    if kind is INTERNAL:
        return kind, "internal server error", None
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return kind, message, getattr(exc, "param", None)


def _response(body: bytes, kind: ErrorKind) -> Response:
    response = Response(body, status=kind.status, content_type="application/json")
    if kind.status == 503:
        response.headers["Retry-After"] = "1"
    return response


def error_response(exc: BaseException, *, anthropic: bool = False) -> Response:
    """JSON error response for any exception; unexpected ones log a traceback and say nothing more.

    Args:
        exc: a VoltError, a werkzeug HTTPException or anything else (-> 500).
        anthropic: Anthropic's shape (routes under /v1/messages) instead of OpenAI's.
    """
    if isinstance(exc, HTTPException):
        kind = _http_kind(exc.code or 500)
        response = _response(payload(exc.description or exc.name, kind, anthropic=anthropic), kind)
        allowed = getattr(exc, "valid_methods", None)  # 405: RFC 9110 section 15.5.6 requires the Allow header
        if allowed:
            response.headers["Allow"] = ", ".join(allowed)
        return response
    kind, message, param = describe(exc)
    if kind is INTERNAL:
        # The traceback goes to the log only: clients must not see internals.
        logger.error("unexpected error while serving a request", exc_info=exc)
    return _response(payload(message, kind, param, anthropic=anthropic), kind)


def unknown_url_response(method: str, path: str, *, anthropic: bool = False) -> Response:
    """404 for a route that does not exist, worded like OpenAI's ("Invalid URL (POST /v1/x)")."""
    kind = HTTP_KINDS[404]
    return _response(payload(f"Invalid URL ({method} {path})", kind, anthropic=anthropic), kind)


ANTHROPIC_PREFIX = "/v1/messages"


def speaks_anthropic(path: str, headers=None) -> bool:
    """Whether errors take Anthropic's shape: on the Messages routes (`/v1/messages`,
    `/v1/messages/count_tokens`), and for a client that sends `anthropic-version` (Anthropic's SDKs, on any
    route: e.g. `GET /v1/models/{id}`). A path with repeated slashes counts as its single-slash form, as it is
    routed (`api.routing`)."""
    if headers is not None and "anthropic-version" in headers:
        return True
    path = merged_path(path)
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")
