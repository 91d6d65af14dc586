"""A bare `hypercorn api:app` whose app cannot start (a bad `VOLTSERVE_` variable, an unknown model, a model file
the loader refuses): one `bad configuration:` line, no traceback, and status 2 from the process the app runs in
(`api.app.exit_after_failed_start`). It used to log hypercorn's LifespanFailureError traceback and exit 0.

hypercorn 0.18 runs the app in a worker process by default and its parent then exits 0 whatever the worker's
status (`hypercorn.run.run` joins the failed worker, then overwrites its status with that of an empty list:
pgjones/hypercorn#269); `-w 0` runs the app in hypercorn's own process, whose status is then the app's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from api.app import exit_after_failed_start
from tests.api.conftest import ROOT

UNKNOWN = ("api.app: bad configuration: unknown model '/no/such/model': pass a local .gguf file, a local Hugging "
           "Face directory (with config.json) or one of the built-in aliases: smollm2-135m-instruct")


def _hypercorn(env: dict, *args: str, port: int) -> subprocess.CompletedProcess:
    """`python -m hypercorn ARGS api:app` on 127.0.0.1:`port` with `env` over a clean VOLTSERVE_ environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("VOLTSERVE_")}
    return subprocess.run([sys.executable, "-m", "hypercorn", *args, "api:app", "--bind", f"127.0.0.1:{port}"],
                          cwd=ROOT, env={**base, "VOLTSERVE_DEVICE": "cpu", **env}, capture_output=True, text=True,
                          timeout=120)


def _error_lines(stderr: str) -> list[str]:
    return [line.partition(" ERROR ")[2] for line in stderr.splitlines() if " ERROR " in line]


@pytest.mark.parametrize("env, message", [
    ({"VOLTSERVE_MODEL": "/no/such/model"}, UNKNOWN),
    ({"VOLTSERVE_MAX_MODEL_LEN": "abc"},
     "api.app: bad configuration: VOLTSERVE_MAX_MODEL_LEN='abc' is not a valid int"),
    ({"VOLTSERVE_LOG_LEVEL": "Verbose"},  # was the lifespan's ValueError traceback (twice) and status 1
     "api.app: bad configuration: log level 'verbose': expected one of debug, info, warning, error "
     "(VOLTSERVE_LOG_LEVEL)"),
], ids=["unknown-model", "bad-variable", "bad-log-level"])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_failed_start_is_one_line_and_status_2(env, message, loop):
    """`hypercorn -w 0 api:app`: status 2, the one line, no traceback (neither hypercorn's nor asyncio's "Task
    exception was never retrieved" for the lifespan task the exit unwinds)."""
    done = _hypercorn(env, "-w", "0", "-k", loop, port=18120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert _error_lines(done.stderr) == [message]
    assert "Traceback" not in done.stderr


def test_a_config_json_without_keys_fails_the_worker_with_one_line(tmp_path):
    """Under hypercorn's default worker process: the same single line (its parent's status is hypercorn's, see
    above), and the worker ends with the app's status 2, so nothing is served."""
    (tmp_path / "config.json").write_text("{}")
    done = _hypercorn({"VOLTSERVE_MODEL": str(tmp_path)}, port=18121)
    assert _error_lines(done.stderr) == [
        f"api.app: bad configuration: {tmp_path / 'config.json'} lacks required key(s): 'architectures', "
        "'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads'"]
    assert "Traceback" not in done.stderr


def test_an_unexpected_start_error_exits_1_with_its_traceback(caplog):
    """Not a bad setting or model file (a bug, a lost device): status 1 and the error with its traceback."""
    error = RuntimeError("no engine today")
    with caplog.at_level(logging.ERROR, logger="api.app"), pytest.raises(SystemExit) as exited:
        exit_after_failed_start(error)
    assert exited.value.code == 1
    assert [(r.getMessage(), r.exc_info[1]) for r in caplog.records] == [
        ("exiting with status 1: the server did not start: no engine today", error)]
