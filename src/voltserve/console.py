"""Entry point of the `voltserve` console script (pyproject's `[project.scripts]`): it takes SIGTERM over before
the command line's imports, which take ~0.15-0.3 s on a 2-core CPU (numpy, asyncio, the config's modules).

A SIGTERM that comes while they run is noted here, and `voltserve.cli.main` acts on it once it has read the
command line and set up logging (and keeps noting SIGTERMs, checked between the start's steps, until the server's
own handlers take over): a clean stop, status 0 and one warning line, as for one that comes a moment later.
Without this a `systemctl stop` in those first moments killed the process (status 143, no log line). What is left
is the interpreter's own start (~30 ms), before any code of ours runs. This module and the `voltserve` package's
`__init__` import nothing else, so that the handler goes in first.
"""

from __future__ import annotations

import signal

_received: list[int] = []  # the SIGTERMs noted and not yet acted on (`take_sigterm`)


def note_sigterm(signum: int, frame: object) -> None:
    """The SIGTERM handler of a start until the server's own (`voltserve.cli.main`): it only notes the signal, and
    the start acts on it at its next check (`take_sigterm`). An exception raised from the handler instead comes
    out wherever the main thread is: Python drops it in a weakref callback or `__del__` (importlib's module locks
    have such callbacks), losing the stop, and it aborts the process inside a C++ extension's callback (torch's
    imports: pybind11 `terminate called`)."""
    _received.append(signum)


def take_sigterm() -> bool:
    """Whether a SIGTERM was noted since the last call (`note_sigterm`)."""
    noted = bool(_received)
    _received.clear()
    return noted


def main(argv: list[str] | None = None) -> int:
    """The `voltserve` command: note SIGTERM, then import and run `voltserve.cli.main`; returns its exit status."""
    signal.signal(signal.SIGTERM, note_sigterm)
    from voltserve.cli import main as cli_main

    return cli_main(argv)
