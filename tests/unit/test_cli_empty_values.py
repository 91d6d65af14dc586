"""`voltserve serve` refuses an empty value for a string flag (or MODEL) as a usage error, exit status 2. The app
reads an empty `VOLTSERVE_*` variable as unset, so `--uds ''` used to serve on TCP, `--api-key ''` without a key.
A string flag unset by default is unset on purpose with its `--no-` form (`--no-uds`), whatever its variable says."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from voltserve import cli
from voltserve.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
STRING_FLAGS = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig) if type(f.default) is str]
UNSET_BY_DEFAULT = [f.name for f in dataclasses.fields(EngineConfig) if f.default == ""]


def test_the_string_flags_are_the_paths_names_and_choices():
    assert {"--uds", "--engine-socket", "--model", "--chat-template", "--speculative-model", "--api-key",
            "--host"} <= set(STRING_FLAGS)


@pytest.mark.parametrize("flag", [*STRING_FLAGS, "MODEL"])
def test_an_empty_value_is_a_usage_error(capsys, flag):
    argv = ["serve", ""] if flag == "MODEL" else ["serve", flag, ""]
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    unset = f"; --no-{flag[2:]} unsets it" if flag[2:].replace("-", "_") in UNSET_BY_DEFAULT else ""
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"voltserve serve: error: argument {flag}: must not be empty (leave it out for the default{unset})")


def test_the_settings_unset_by_default_are_the_optional_paths_and_names():
    assert UNSET_BY_DEFAULT == ["served_model_name", "api_key", "uds", "engine_socket", "chat_template",
                                "speculative_model", "concurrency_drafts"]
    parse = cli.build_parser().parse_args
    assert parse(["serve", "--uds", "/tmp/a.sock", "--no-uds"]).uds == ""  # the last wins, as --pdl / --no-pdl
    assert parse(["serve", "--no-uds", "--uds", "/tmp/a.sock"]).uds == "/tmp/a.sock"


@pytest.mark.parametrize("name", UNSET_BY_DEFAULT)
def test_the_no_form_unsets_a_setting_its_variable_makes(monkeypatch, name):
    """flag > environment: `--no-uds` where VOLTSERVE_UDS is set (a service's Environment=) serves on TCP; there
    was no way to turn the variable's setting off from the command line (`--uds ''` is a usage error)."""
    monkeypatch.setenv(f"VOLTSERVE_{name.upper()}", "set-by-the-environment")
    flag = "--no-" + name.replace("_", "-")
    args = cli.build_parser().parse_args(["serve", flag])
    assert getattr(args, name) == ""
    cli._export_env(args)
    assert os.environ[f"VOLTSERVE_{name.upper()}"] == ""  # read as unset, by this process and its children


def test_no_uds_listens_on_the_port_where_voltserve_uds_is_set(monkeypatch, tmp_path):
    """The whole start up to the listening socket: VOLTSERVE_UDS set, `--no-uds --port P` listens on
    127.0.0.1:P (it was "uds ... and host / port ... both say where to listen", status 2)."""
    from voltserve.errors import ConfigError

    monkeypatch.setenv("VOLTSERVE_UDS", str(tmp_path / "api.sock"))
    monkeypatch.setattr(cli.preflight, "check_model", lambda config: None)
    seen = []

    def listen(config):
        seen.append((config.uds, config.host, config.port))
        raise ConfigError("stopped before the model loads")

    monkeypatch.setattr(cli.preflight, "listen", listen)
    assert cli.main(["serve", "--device", "cpu", "--no-uds", "--port", "18100"]) == 2
    assert seen == [("", "127.0.0.1", 18100)]


def test_serve_with_an_empty_uds_exits_2_without_listening():
    """The whole command: status 2 and the usage error, not a server on 127.0.0.1:PORT."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VOLTSERVE_")},
           "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "voltserve.cli", "serve", "--uds", "", "--port", "0", "--device",
                           "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == ("voltserve serve: error: argument --uds: must not be empty (leave it out "
                                            "for the default; --no-uds unsets it)")
    assert proc.stdout == "" and "Running on" not in proc.stderr
