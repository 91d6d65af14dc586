"""voltserve.event_loop: uvloop when installed (the default "auto"), asyncio's loop on request or as fallback."""

from __future__ import annotations

import asyncio
import sys

import pytest

from voltserve import cli, event_loop
from voltserve.config import EngineConfig
from voltserve.errors import ConfigError


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_and_uvloop_run_on_uvloop():
    pytest.importorskip("uvloop")
    assert event_loop.resolve("auto") == event_loop.resolve("uvloop") == "uvloop"
    assert event_loop.run(_loop_module(), "auto").split(".")[0] == "uvloop"
    assert event_loop.run(_loop_module(), "uvloop").split(".")[0] == "uvloop"


def test_asyncio_runs_on_the_standard_loop():
    assert event_loop.loop_factory("asyncio") is None
    assert event_loop.run(_loop_module(), "asyncio").split(".")[0] == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_is_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert event_loop.resolve("auto") == "asyncio"
    assert event_loop.run(_loop_module(), "auto").split(".")[0] == "asyncio"
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        event_loop.loop_factory("uvloop")


def test_config_and_cli_check_the_kind(monkeypatch):
    assert EngineConfig().validate().event_loop == "auto"
    with pytest.raises(ConfigError, match="event_loop must be one of auto, uvloop, asyncio, not 'trio'"):
        EngineConfig(event_loop="trio").validate()
    monkeypatch.delenv("VOLTSERVE_EVENT_LOOP", raising=False)
    cli._export_env(cli.build_parser().parse_args(["serve", "--event-loop", "asyncio"]))
    assert EngineConfig.from_env().event_loop == "asyncio"
    assert cli.main(["serve", "--event-loop", "trio"]) == 2
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert cli.main(["serve", "--event-loop", "uvloop"]) == 2  # asked for, not installed: before any load
