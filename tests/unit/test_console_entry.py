"""The `voltserve` console script (pyproject's entry point, `voltserve.console`) takes SIGTERM over before its
imports: a `systemctl stop` in a start's first ~0.2 s killed the process (status 143, no log line) while it
imported `voltserve.cli` (numpy, asyncio, the config's modules); now it is a clean stop, status 0, one line."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
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
