"""voltserve.log_setup: the root handler `hypercorn api:app` and `voltserve serve` install (VOLTSERVE_LOG_LEVEL)."""

import logging
import os
import subprocess
import sys

import pytest

from voltserve import cli
from voltserve.log_setup import configure_logging


@pytest.fixture
def bare_root(monkeypatch):
    """The root logger as a bare `hypercorn api:app` process has it: no handlers, level WARNING. Cleared when the
    test body asks (pytest adds its capture handler to the root just before the body runs)."""
    root = logging.getLogger()

    def clear():
        monkeypatch.setattr(root, "handlers", [])
        monkeypatch.setattr(root, "level", logging.WARNING)
        return root

    yield clear
    for h in root.handlers:
        if not type(h).__name__.startswith("LogCapture"):
            h.close()


def test_default_is_info(bare_root, monkeypatch):
    monkeypatch.delenv("VOLTSERVE_LOG_LEVEL", raising=False)
    root = bare_root()
    configure_logging()
    assert root.level == logging.INFO and len(root.handlers) == 1


def test_environment_sets_the_level(bare_root, monkeypatch):
    monkeypatch.setenv("VOLTSERVE_LOG_LEVEL", "DEBUG")
    root = bare_root()
    configure_logging()
    assert root.level == logging.DEBUG


def test_explicit_level_wins_over_environment(bare_root, monkeypatch):
    monkeypatch.setenv("VOLTSERVE_LOG_LEVEL", "debug")
    root = bare_root()
    configure_logging("error")
    assert root.level == logging.ERROR


def test_host_configured_logging_is_left_alone(bare_root):
    handler = logging.NullHandler()
    root = bare_root()
    root.handlers.append(handler)
    configure_logging("debug")
    assert root.handlers == [handler] and root.level == logging.WARNING


def test_unknown_level_is_a_clear_error(bare_root, monkeypatch):
    monkeypatch.setenv("VOLTSERVE_LOG_LEVEL", "verbose")
    root = bare_root()
    with pytest.raises(ValueError, match="'verbose': expected one of debug, info, warning, error"):
        configure_logging()
    assert root.handlers == []


def test_cli_rejects_a_bad_environment_level(bare_root, monkeypatch, capsys):
    monkeypatch.setenv("VOLTSERVE_LOG_LEVEL", "verbose")
    bare_root()
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve"])
    assert exc.value.code == 2
    assert "VOLTSERVE_LOG_LEVEL" in capsys.readouterr().err


def test_importing_api_leaves_logging_alone():
    """Only serving configures logging: an embedding host that imports `api` keeps its own setup."""
    code = ("import logging, api; r = logging.getLogger(); "
            "assert r.handlers == [] and r.level == logging.WARNING, (r.handlers, r.level)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "VOLTSERVE_LOG_LEVEL": "debug"})
    assert out.returncode == 0, out.stderr


async def test_app_configures_logging_when_serving_starts(bare_root, monkeypatch):
    """`hypercorn api:app` (create_app(configure_logs=True)) sets up logging before the engine starts."""
    from api.app import create_app
    from tests.api.fake_engine import ScriptedEngine
    from voltserve.config import EngineConfig

    monkeypatch.setenv("VOLTSERVE_LOG_LEVEL", "debug")
    engine = ScriptedEngine()
    engine.config = EngineConfig(model="test-model").validate()
    app = create_app(engine, configure_logs=True)
    root = bare_root()
    async with app.test_app():
        assert root.level == logging.DEBUG and len(root.handlers) == 1


def test_a_record_a_logger_writes_to_stderr_itself_is_not_written_again():
    """hypercorn's `hypercorn.error` has a stderr handler of its own and propagates: the root handler skips its
    records (they came out twice under a bare `hypercorn api:app`); a file handler there does not hide them."""
    code = ("import logging, sys; from voltserve.log_setup import configure_logging; configure_logging('info'); "
            "own = logging.getLogger('hypercorn.error'); h = logging.StreamHandler(sys.stderr); "
            "h.setFormatter(logging.Formatter('[own] %(message)s')); own.addHandler(h); own.info('Running on x'); "
            "logging.getLogger('api.app').info('serving'); own.removeHandler(h); "
            "own.addHandler(logging.FileHandler(sys.argv[1])); own.warning('to the file and stderr')")
    out = subprocess.run([sys.executable, "-c", code, os.devnull], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    own_line, *root_lines = out.stderr.splitlines()
    assert own_line == "[own] Running on x"
    assert [line.split(" ", 2)[2] for line in root_lines] == [  # less the root format's date and time
        "INFO api.app: serving", "WARNING hypercorn.error: to the file and stderr"]


def test_a_bad_environment_level_is_not_read_where_logging_is_configured(bare_root, monkeypatch):
    """`VOLTSERVE_LOG_LEVEL=bogus voltserve serve --log-level info`: the flag wins (the CLI set up logging before
    the app's start read the variable, which failed the start with a traceback and status 1)."""
    monkeypatch.setenv("VOLTSERVE_LOG_LEVEL", "bogus")
    root = bare_root()
    root.handlers.append(logging.NullHandler())
    configure_logging()
    assert len(root.handlers) == 1 and root.level == logging.WARNING


def test_a_bad_environment_level_fails_building_the_bare_hypercorn_app(bare_root, monkeypatch):
    """`hypercorn api:app` (create_app(configure_logs=True)) refuses a bad VOLTSERVE_LOG_LEVEL when built, as any bad
    VOLTSERVE_ variable (api/__init__.py then logs one line and exits 2), not when serving starts."""
    from api.app import create_app
    from voltserve.config import EngineConfig
    from voltserve.errors import ConfigError

    monkeypatch.setenv("VOLTSERVE_LOG_LEVEL", "verbose")
    bare_root()
    with pytest.raises(ConfigError) as refused:
        create_app(config=EngineConfig(model="test-model").validate(), configure_logs=True)
    assert str(refused.value) == ("log level 'verbose': expected one of debug, info, warning, error "
                                  "(VOLTSERVE_LOG_LEVEL)")
