"""The Quart application factory: routes, error handlers, API-key check, engine start/stop.

`hypercorn api:app` serves `create_app()` with the config from `VOLTSERVE_*` environment variables; the engine
(and so the model) loads in `before_serving`, never at import.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from typing import Any, NoReturn

from quart import Quart, has_request_context, request
from werkzeug.exceptions import HTTPException

from api.auth import check_api_key
from api.errors import error_response, speaks_anthropic, unknown_url_response
from api.metrics import ServerMetrics, engine_stats
from api.routing import App
from api.state import EXTENSION_KEY, ServerState, random_id, unix_time_s
from voltserve.config import EngineConfig
from voltserve.errors import INPUT_ERRORS, ConfigError, VoltError
from voltserve.log_setup import configure_logging, level_to_set
from voltserve.start_report import claim_start_report, start_reported_elsewhere

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 * 1024 * 1024
HYPERCORN_LOG = "hypercorn.error"  # hypercorn's own log, under `voltserve serve` and a bare hypercorn alike


def _hide_running_on(record: logging.LogRecord) -> bool:
    """A filter on HYPERCORN_LOG that drops hypercorn's "Running on ..." line. After a start that a stop cancelled
    (`ServerState.start_engine` returned False) hypercorn still opens its listeners, logs that line and only then
    looks at its shutdown trigger: the line, logged after the stop, told operators the server served."""
    return not record.getMessage().startswith("Running on ")


def _blueprints():
    from api.anthropic.messages import bp as messages
    from api.health import bp as health
    from api.openai.chat import bp as chat
    from api.openai.completions import bp as completions
    from api.metrics import bp as metrics
    from api.openai.models import bp as models
    from api.openai.responses import bp as responses
    from api.tokenize import bp as tokenize

    return [health, metrics, chat, completions, models, messages, responses, tokenize]


async def watch_engine(engine: Any, on_death: Callable[[], None], interval_s: float = 1.0,
                       stop: asyncio.Event | None = None) -> None:
    """Call `on_death` once when a started engine stops being healthy without being asked to stop (case E1:
    a dead engine must not leave a process that answers 503 forever). Returns at once when `stop` is set (the
    app's shutdown_event: Quart waits up to 5 s for its background tasks before the after-serving hooks)."""
    stop = stop or asyncio.Event()
    while engine.is_healthy:
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return  # the server is shutting down
        except TimeoutError:
            pass
    if not getattr(engine, "_stopped", False):
        logger.critical("the engine is dead; shutting the server down so its supervisor can restart it")
        on_death()


def make_engine(config: EngineConfig) -> Any:
    """The engine the server runs: a ProcessEngine (engine in a child process) when `config.engine_process`,
    else an in-process AsyncEngine (imports torch here: only when serving starts)."""
    if config.engine_process:
        from actors.engine_process import ProcessEngine

        return ProcessEngine(config)
    from actors.engine import AsyncEngine

    return AsyncEngine(config, spare_cores=1)  # on the CPU, a core left to the HTTP server


def hypercorn_shutdown_event() -> Any:
    """The event hypercorn's main process sets on SIGINT / SIGTERM (its workers' shutdown trigger) when this
    process is one of its workers (`hypercorn api:app`, `-w 1` and up: hypercorn passes it to the worker function
    as `shutdown_event`); None otherwise (`voltserve serve`, `hypercorn -w 0`, an embedding host)."""
    import multiprocessing

    kwargs = getattr(multiprocessing.current_process(), "_kwargs", None)  # the worker's Process arguments
    event = kwargs.get("shutdown_event") if isinstance(kwargs, dict) else None
    return event if callable(getattr(event, "is_set", None)) else None


async def watch_hypercorn_shutdown(state: ServerState, interval_s: float = 0.1) -> None:
    """Cancel the engine's start (`ServerState.cancel_start`) once hypercorn's main process asks its workers to
    shut down: hypercorn looks at its shutdown trigger only once the app has started, after the model's load.
    Returns at once outside a hypercorn worker."""
    event = hypercorn_shutdown_event()
    if event is None:
        return
    while not event.is_set():
        await asyncio.sleep(interval_s)
    state.cancel_start("hypercorn's shutdown (SIGINT / SIGTERM)")


class SignalDrain:
    """The signal handling of `voltserve serve`: `trigger` is hypercorn's shutdown trigger. It waits for one of
    `signals`, then drains the requests in flight (`ServerState.drain`: up to `timeout_s` s; a second signal ends
    them at once) before hypercorn closes the connections, so open streams end with an error event (and `[DONE]`
    on OpenAI's chunk streams) instead of a cut connection. The handlers are installed at construction, before
    hypercorn starts the app: a signal while the model loads cancels the engine's start (`ServerState.cancel_start`:
    the engine process and its rank processes end at once) and the server then shuts down without serving, exit
    status 0 as after a drain. They are removed after the drain (a further signal gets the default action, e.g. to
    end an engine stop that hangs). Call it on the running loop."""

    def __init__(self, state: ServerState, timeout_s: float,
                 signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
        self._state, self._timeout_s, self._signals = state, timeout_s, signals
        self._loop = asyncio.get_running_loop()
        self.stop, self.hurry = asyncio.Event(), asyncio.Event()
        for sig in signals:
            self._loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self.stop.is_set():
            self.hurry.set()
            return
        self.stop.set()
        self._state.cancel_start(signal.Signals(sig).name)

    async def trigger(self) -> None:
        await self.stop.wait()
        try:
            await self._state.drain(self._timeout_s, self.hurry)
        finally:
            for sig in self._signals:
                self._loop.remove_signal_handler(sig)


class ServerApp(App):
    """The app's class: a bad setting or model file that fails the app's startup is logged in one line (the
    operator's to fix: a traceback would only hide it), any other startup error with its traceback, as Quart
    does."""

    def log_exception(self, exception_info) -> None:
        """Quart's hook for an exception no handler took: one error line for an `INPUT_ERRORS` one outside a
        request (the startup's), else Quart's message and traceback."""
        exc = exception_info[1]
        if not has_request_context() and start_reported_elsewhere():  # another API process logged the cause
            return
        if isinstance(exc, INPUT_ERRORS) and not has_request_context():
            logger.error("bad configuration: %s", exc)
            return
        super().log_exception(exception_info)


EXIT_ON_START_FAILURE = "VOLTSERVE_EXIT_ON_START_FAILURE"  # app.config key: see create_app's exit_on_start_failure


def exit_after_failed_start(exc: BaseException) -> NoReturn:
    """End the process of a bare `hypercorn api:app` whose app could not start, as `voltserve serve` does: one
    `bad configuration: ...` line and status 2 for a bad setting or model file (`INPUT_ERRORS`), else the error
    with its traceback and status 1. A SystemExit, not the lifespan failure hypercorn would turn into its own
    traceback: it unwinds hypercorn's worker (its `finally` blocks, atexit) and becomes the process's status.

    Raises:
        SystemExit: always, with code 2 or 1.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop: at import
        task = None
    if task is not None:  # the SystemExit stops the loop: mark it read, or asyncio logs it once the task is freed
        task.add_done_callback(asyncio.Task.exception)
    if isinstance(exc, INPUT_ERRORS):
        logger.error("bad configuration: %s", exc)
        raise SystemExit(2) from None
    logger.error("exiting with status 1: the server did not start: %s", exc, exc_info=exc)
    raise SystemExit(1) from None


def _terminate_self() -> None:
    # the server's SIGTERM handler (hypercorn's, or voltserve serve's SignalDrain) shuts down; after_serving runs
    os.kill(os.getpid(), signal.SIGTERM)


def create_app(engine: Any = None, config: EngineConfig | None = None, *,
               new_id: Callable[[str], str] = random_id, clock: Callable[[], int] = unix_time_s,
               configure_logs: bool = False, exit_on_start_failure: bool = False) -> Quart:
    """Build the app.

    Args:
        engine: an `actors.engine.AsyncEngine` or a double with its interface; None = build one from `config`
            when serving starts. Either way the app starts it before serving and stops it after.
        config: engine settings; None = `engine.config` if given, else `EngineConfig.from_env()`.
        new_id: prefix -> response id (tests inject a fixed one for byte-exact comparisons).
        clock: -> unix seconds for `created`.
        configure_logs: when serving starts, first set up logging (`voltserve.log_setup.configure_logging`:
            VOLTSERVE_LOG_LEVEL, unless the host configured it); `hypercorn api:app` does, an embedding host not.
        exit_on_start_failure: when the engine's start fails, end the process (`exit_after_failed_start`: one
            line, status 2 or 1) instead of failing the ASGI lifespan startup; `hypercorn api:app` does
            (`app.config[EXIT_ON_START_FAILURE]`; `voltserve serve` turns it off and reports the failure itself).

    Raises:
        ConfigError: an environment variable does not parse (with configure_logs, VOLTSERVE_LOG_LEVEL too).
    """
    if config is None:
        config = engine.config if engine is not None else EngineConfig.from_env()
    if configure_logs:  # checked now, as every VOLTSERVE_ variable: at serving's start it failed with a traceback
        try:
            level_to_set()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    app = ServerApp("voltserve")  # a path with repeated slashes is routed as its single-slash form
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["RESPONSE_TIMEOUT"] = None  # streams may outlive Quart's 60 s default
    app.config[EXIT_ON_START_FAILURE] = exit_on_start_failure
    state = ServerState(engine=engine, config=config, new_id=new_id, clock=clock)
    state.metrics = ServerMetrics(config.served_model_name, lambda: engine_stats(state.engine))
    app.extensions[EXTENSION_KEY] = state
    for bp in _blueprints():
        app.register_blueprint(bp)

    @app.before_serving
    async def start_engine() -> None:
        if configure_logs:  # first: the engine process copies the root level when it starts
            configure_logging()
        if state.engine is None:
            state.engine = make_engine(config)
        logger.info("starting engine: %s", config)
        watcher = asyncio.ensure_future(watch_hypercorn_shutdown(state))
        try:
            if not await state.start_engine():  # stopped while it started: the server's shutdown follows
                logging.getLogger(HYPERCORN_LOG).addFilter(_hide_running_on)  # removed after serving
                return
        except Exception as exc:
            if isinstance(exc, INPUT_ERRORS):
                state.start_error = exc  # voltserve serve exits 2 on it (ServerApp.log_exception logs its line)
            claim_start_report()  # of several API processes failing on one engine's start, one logs the cause
            if app.config[EXIT_ON_START_FAILURE]:  # else hypercorn logs its LifespanFailureError's traceback
                exit_after_failed_start(exc)
            raise
        finally:
            watcher.cancel()
        logger.info("serving %r (max_model_len=%d)", config.served_model_name, state.engine.max_model_len)
        if config.exit_on_engine_death:
            app.add_background_task(watch_engine, state.engine, _terminate_self, stop=app.shutdown_event)

    @app.after_serving
    async def stop_engine() -> None:
        logging.getLogger(HYPERCORN_LOG).removeFilter(_hide_running_on)
        if state.engine is not None:
            await state.engine.stop()

    @app.before_request
    async def authenticate() -> None:
        check_api_key(config.api_key, request.path, request.headers)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException):
        anthropic = speaks_anthropic(request.path, request.headers)
        if exc.code == 404:
            return unknown_url_response(request.method, request.path, anthropic=anthropic)
        return error_response(exc, anthropic=anthropic)

    @app.errorhandler(VoltError)
    async def volt_error(exc: VoltError):
        return error_response(exc, anthropic=speaks_anthropic(request.path, request.headers))

    @app.errorhandler(Exception)
    async def unexpected_error(exc: Exception):
        state.count_internal_error()  # raised before a stream driver could count it (or where none runs)
        return error_response(exc, anthropic=speaks_anthropic(request.path, request.headers))

    return app
