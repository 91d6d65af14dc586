"""The `voltserve` console script (pyproject's entry point, `voltserve.console`) takes SIGTERM over before its
imports: a `systemctl stop` in a start's first ~0.2 s killed the process (status 143, no log line) while it
imported `voltserve.cli` (numpy, asyncio, the config's modules); now it is a clean stop, status 0, one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
import weakref

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("voltserve.cli", "numpy", "asyncio", "torch")
# pip's console-script template: what `bin/voltserve` runs for the entry point
SCRIPT = ("import re\nimport sys\nfrom {module} import {func}\nif __name__ == '__main__':\n"
          "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit({func}())\n")
# SIGTERM to this process as the first of HEAVY starts to import: the same moment on a fast or a slow machine
KILL_ON_IMPORT = f"""import os, signal, sys
class KillOnImport:
    def find_spec(self, name, path=None, target=None):
        if name in {HEAVY!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGTERM)
        return None
sys.meta_path.insert(0, KillOnImport())
"""


def _entry_point() -> tuple[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        module, func = tomllib.load(f)["project"]["scripts"]["voltserve"].split(":")
    return module, func


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VOLTSERVE_")},
           "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_sigterm_as_the_console_script_starts_its_imports_is_a_clean_stop():
    module, func = _entry_point()
    done = _run(KILL_ON_IMPORT + SCRIPT.format(module=module, func=func), "serve", "--device", "cpu")
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert [ln.split(" ", 2)[2] for ln in done.stderr.splitlines()] == [
        "WARNING voltserve.cli: SIGTERM before the server started: exiting with status 0"]
    assert done.stdout == ""


def test_the_entry_point_imports_nothing_of_weight_before_its_handler():
    """The handler is the first thing the entry point does: importing its module (and the `voltserve` package)
    loads none of the modules whose import took the time (as `python -S` would not add them either)."""
    module, func = _entry_point()
    code = (f"import sys, signal\nfrom {module} import {func}\n"
            f"print(sorted(m for m in sys.modules if m.startswith({HEAVY!r}) or m == 'voltserve.request'))\n"
            f"print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n")
    done = _run(code)
    assert done.stdout.splitlines() == ["[]", "True"], done.stderr




def sigterm_in_a_weakref_callback(*args, then=None, **kwargs):
    """SIGTERM to this process while a weakref callback runs, as importlib's module-lock callbacks do throughout
    the start's imports (then returns `then(*args, **kwargs)`): Python drops an exception the handler raises there
    (printing "Exception ignored in"), so an early handler that raised lost the stop and the server started
    (seen in 1 of ~40 `--api-processes 2` starts stopped 0.3-1.2 s in). Here at a chosen moment."""
    class Lock:
        pass

    def callback(ref):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs here, inside the callback
            pass

    lock = Lock()
    ref = weakref.ref(lock, callback)  # noqa: F841 (the callback needs the reference alive)
    del lock
    return then(*args, **kwargs) if then is not None else None


class FakeApiProcess:
    """subprocess.Popen of an API process that runs until it gets a signal (printed), or "quits unasked" (status
    1 for the supervisor) after 20 polls without one."""

    count = 0

    def __init__(self, *args, **kwargs):
        self.polls, self.returncode, self.pid = 0, None, 10**7 + FakeApiProcess.count
        FakeApiProcess.count += 1

    def poll(self):
        self.polls += 1
        if self.returncode is None and self.polls > 20:
            self.returncode = 0
        return self.returncode

    def send_signal(self, sig):
        print(f"API process {self.pid - 10**7}: {signal.Signals(sig).name}")
        self.returncode = 0


# `voltserve serve` whose SIGTERM comes inside a weakref callback at {where} (hypercorn and the API processes faked)
SCRIPT_SIGTERM_IN_A_CALLBACK = """import functools, sys
import hypercorn.asyncio
from tests.unit.test_console_entry import FakeApiProcess, sigterm_in_a_weakref_callback
from voltserve import api_processes, cli, preflight

async def serve(app, hconfig, shutdown_trigger=None):
    print("served")

hypercorn.asyncio.serve = serve
if sys.argv[-1] != "1":  # (subprocess is one module: `import api` runs ldconfig)
    api_processes.subprocess.Popen = FakeApiProcess
api_processes.POLL_S, api_processes.ENGINE_STOP_WAIT_S = 0.01, 0.0
{where} = functools.partial(sigterm_in_a_weakref_callback, then={where})
sys.exit(cli.main(["serve", "--device", "cpu", "--port", "0", "--log-level", "warning"] + sys.argv[1:]))
"""
STOPPED = "WARNING voltserve.cli: SIGTERM before the server started: exiting with status 0"


def test_a_sigterm_during_the_checks_stops_the_start_even_where_python_drops_exceptions():
    done = _run(SCRIPT_SIGTERM_IN_A_CALLBACK.format(where="preflight.check_model"), "--api-processes", "1")
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout == ""  # not served
    assert [ln.split(" ", 2)[2] for ln in done.stderr.splitlines()] == [STOPPED]  # no traceback


@pytest.mark.parametrize("where", ["preflight.check_model", "api_processes.private_folder"])
def test_the_api_process_supervisor_passes_on_a_sigterm_noted_before_its_handlers(where):
    """`--api-processes 2`: a SIGTERM before the supervisor's handlers (during the checks, or as it makes its
    private folder) is passed on to every API process, as one a moment later is; status 0."""
    done = _run(SCRIPT_SIGTERM_IN_A_CALLBACK.format(where=where), "--api-processes", "2")
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.splitlines() == ["API process 0: SIGTERM", "API process 1: SIGTERM"]
    assert done.stderr == ""
