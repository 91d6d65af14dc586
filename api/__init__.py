"""voltserve's HTTP API: `hypercorn api:app` serves the app built from `VOLTSERVE_*` environment variables.

Importing this package is cheap: the engine and the model load when serving starts. A bad `VOLTSERVE_` variable
at import, or an engine that fails to start, ends the process with one error line and status 2 (1 for an
unexpected error), as `voltserve serve` does.
"""

from api.app import create_app, exit_after_failed_start
from voltserve.errors import ConfigError
from voltserve.log_setup import configure_logging

try:  # logging (VOLTSERVE_LOG_LEVEL) is set up when serving starts; a failed start ends the process
    app = create_app(configure_logs=True, exit_on_start_failure=True)
except ConfigError as exc:  # a bad VOLTSERVE_ variable: one line and status 2, not hypercorn's traceback
    try:
        configure_logging()
    except ValueError:  # a bad VOLTSERVE_LOG_LEVEL, the error itself: its line in the usual format all the same
        configure_logging("info")
    exit_after_failed_start(exc)

__all__ = ["app", "create_app"]
