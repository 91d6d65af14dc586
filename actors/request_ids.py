"""The one rule for request ids inside an engine: at most one request in flight per id.

The scheduler actor keys a request's sequences, stream and aborts by its id, and a shared engine's API processes
(`--api-processes`, `EngineConfig.engine_socket`) each know only their own ids; so the engine itself refuses an
id still in flight, where every request enters it (`AsyncEngine.submit`), for embedded callers and API processes
alike.
"""

from __future__ import annotations

from voltserve.errors import InvalidRequestError


def duplicate_request_id(request_id: str) -> InvalidRequestError:
    """The error of a request whose caller-chosen id belongs to a request still in flight (HTTP 400)."""
    return InvalidRequestError(f"request id {request_id!r} is already in flight", param="request_id")


class RequestIds:
    """The ids of an engine's requests in flight, each with the stream its outputs go to.

    An id is in flight from `claim` until the engine is done with its request: every final delta put, the stream
    failed, or the request aborted (an abort is queued ahead of any later request's add, so the id is free again
    at once).
    """

    def __init__(self):
        self._streams: dict[str, object] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def claim(self, request_id: str, stream) -> None:
        """Mark `request_id` in flight, its outputs going to `stream`.

        Raises:
            InvalidRequestError: (param request_id) a request under this id is still in flight.
        """
        if request_id in self._streams:
            raise duplicate_request_id(request_id)
        self._streams[request_id] = stream

    def release(self, request_id: str, stream) -> None:
        """Free `request_id` if `stream`'s request holds it (one that ended late must not free a later one's)."""
        if stream is not None and self._streams.get(request_id) is stream:
            del self._streams[request_id]

    def drop(self, request_id: str) -> None:
        """Free `request_id`, whoever holds it (an abort by id); no-op when nobody does."""
        self._streams.pop(request_id, None)

    def clear(self) -> None:
        self._streams.clear()
