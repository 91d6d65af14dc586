"""`voltserve serve` refuses an empty value for a string flag (or MODEL) as a usage error, exit status 2. The app
reads an empty `VOLTSERVE_*` variable as unset, so `--uds ''` used to serve on TCP, `--api-key ''` without a key."""

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


def test_the_string_flags_are_the_paths_names_and_choices():
    assert {"--uds", "--engine-socket", "--model", "--chat-template", "--speculative-model", "--api-key",
            "--host"} <= set(STRING_FLAGS)


@pytest.mark.parametrize("flag", [*STRING_FLAGS, "MODEL"])
def test_an_empty_value_is_a_usage_error(capsys, flag):
    argv = ["serve", ""] if flag == "MODEL" else ["serve", flag, ""]
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"voltserve serve: error: argument {flag}: must not be empty (leave it out for the default)")


def test_serve_with_an_empty_uds_exits_2_without_listening():
    """The whole command: status 2 and the usage error, not a server on 127.0.0.1:PORT."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VOLTSERVE_")},
           "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "voltserve.cli", "serve", "--uds", "", "--port", "0", "--device",
                           "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == ("voltserve serve: error: argument --uds: must not be empty (leave it out "
                                            "for the default)")
    assert proc.stdout == "" and "Running on" not in proc.stderr
