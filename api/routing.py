"""URL matching for the app: a path with repeated slashes (`/v1//chat/completions`, what a base URL with a trailing
slash gives) is served as its single-slash form.

Werkzeug matches such a path against the single-slash form too, but answers it with a 308 redirect whose body is
an HTML page: an API client gets HTML, and must send a POST body again. Here the request goes straight to the
route the redirect names; unknown paths and wrong methods keep their JSON 404 / 405 (`api.errors`). A route
registered with `merge_slashes=False` (the model-id route: `/v1/models//root/m.gguf` names the model
`/root/m.gguf`) is matched with its slashes as they are, as werkzeug does.
"""

from __future__ import annotations

import re

from quart import Quart
from quart.routing import QuartMap
from werkzeug.routing import MapAdapter, RequestRedirect

_SLASH_RUNS = re.compile("/{2,}")


def merged_path(path: str) -> str:
    """`path` with each run of slashes made one: the path a request is routed as (`/v1//models` -> `/v1/models`)."""
    return _SLASH_RUNS.sub("/", path)


class SlashMergingAdapter(MapAdapter):
    """A MapAdapter that matches a path with repeated slashes as its single-slash form instead of raising the
    RequestRedirect to it (which Quart answers with an HTML 308, bypassing the app's error handlers)."""

    def match(self, path_info=None, method=None, return_rule=False, query_args=None, websocket=None):
        """As `MapAdapter.match`, without the redirect from a path with repeated slashes to its single-slash form:
        that form's rule is matched at once (any other redirect is raised as before)."""
        try:
            return super().match(path_info, method, return_rule, query_args, websocket)
        except RequestRedirect:
            path = self.path_info if path_info is None else path_info
            merged = merged_path(path)
            if merged == path:
                raise
            return super().match(merged, method, return_rule, query_args, websocket)


class SlashMergingMap(QuartMap):
    """The app's URL map: binds `SlashMergingAdapter`s."""

    def bind_to_request(self, *args, **kwargs) -> MapAdapter:
        """`QuartMap.bind_to_request` (the adapter of one request), as a `SlashMergingAdapter`."""
        adapter = super().bind_to_request(*args, **kwargs)
        return SlashMergingAdapter(adapter.map, adapter.server_name, adapter.script_name, adapter.subdomain,
                                   adapter.url_scheme, adapter.path_info, adapter.default_method, adapter.query_args)


class App(Quart):
    """The voltserve Quart app class: Quart with `SlashMergingMap` routing."""

    url_map_class = SlashMergingMap
