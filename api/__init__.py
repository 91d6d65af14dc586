"""voltserve's HTTP API: `hypercorn api:app` serves the app built from `VOLTSERVE_*` environment variables.

Importing this package is cheap: the engine and the model load when serving starts.
"""

from api.app import create_app
from voltserve.log_setup import configure_logging

configure_logging()  # VOLTSERVE_LOG_LEVEL (default info), unless the host configured logging
app = create_app()

__all__ = ["app", "create_app"]
