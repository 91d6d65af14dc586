"""tools/voltserve.service: the settings it sets exist, and the folders it names are ones the service can write."""

from __future__ import annotations

import dataclasses
import pathlib

from voltserve.config import EngineConfig

UNIT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "voltserve.service"
# VOLTSERVE_ variables read outside EngineConfig (loaders.sources, voltserve.log_setup)
OTHER_VARIABLES = {"VOLTSERVE_CACHE_DIR", "VOLTSERVE_SMOLLM2_WHEEL", "VOLTSERVE_LOG_LEVEL"}


def _directives() -> list[tuple[str, str]]:
    lines = [line.strip() for line in UNIT.read_text().splitlines()]
    return [tuple(line.split("=", 1)) for line in lines if line and not line.startswith(("#", "["))]


def test_every_variable_the_unit_sets_is_a_setting():
    known = {f"VOLTSERVE_{f.name.upper()}" for f in dataclasses.fields(EngineConfig)} | OTHER_VARIABLES
    names = [value.split("=", 1)[0] for key, value in _directives() if key == "Environment"]
    assert "VOLTSERVE_CACHE_DIR" in names
    assert [n for n in names if n not in known] == []


def test_the_cache_folder_is_systemds_cache_directory():
    # ProtectSystem=strict leaves /var read-only; User=voltserve cannot create /var/cache/voltserve, and a
    # ReadWritePaths= of a missing folder fails the start: CacheDirectory= creates it, owned by User=, writable
    directives = dict(_directives())
    env = dict(value.split("=", 1) for key, value in _directives() if key == "Environment")
    assert directives["ProtectSystem"] == "strict"
    assert directives["CacheDirectory"] == "voltserve"
    assert env["VOLTSERVE_CACHE_DIR"] == "/var/cache/" + directives["CacheDirectory"]
    assert "ReadWritePaths" not in directives
