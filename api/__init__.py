"""voltserve's HTTP API: `hypercorn api:app` serves the app built from `VOLTSERVE_*` environment variables.

Importing this package is cheap: the engine and the model load when serving starts.
"""

from api.app import create_app

app = create_app(configure_logs=True)  # logging (VOLTSERVE_LOG_LEVEL) is set up when serving starts

__all__ = ["app", "create_app"]
