"""Entry point of the `voltserve` command (pyproject's `[project.scripts]`, `python -m voltserve`): it takes
SIGINT and SIGTERM over before the command line's imports, which take ~0.15-0.3 s on a 2-core CPU (numpy, asyncio,
the config's modules).

A signal that comes while they run is noted here, and `voltserve.cli.main` acts on it once it has read the command
line and set up logging (and keeps noting them, checked between the start's steps, until the server's own handlers
take over): a SIGTERM is a clean stop, status 0 and one warning line, a SIGINT (Ctrl-C) status 130 and one warning
line, as for one that comes a moment later. Without this a `systemctl stop` in those first moments killed the
process (status 143, no log line) and a Ctrl-C printed a KeyboardInterrupt traceback (or, inside numpy's C
imports, an ImportError and status 1). What is left is the interpreter's own start (~30 ms), before any code of
ours runs. This module and the `voltserve` package's `__init__` import nothing else, so that the handlers go in
first.
"""

from __future__ import annotations

import signal

EARLY_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the signals noted and not yet acted on (`take_signal`), in the order they came


def note_signal(signum: int, frame: object) -> None:
    """The SIGINT and SIGTERM handler of a start until the server's own (`voltserve.cli.main`): it only notes the
    signal, and the start acts on it at its next check (`take_signal`). An exception raised from the handler
    (SIGINT's default KeyboardInterrupt too) instead comes out wherever the main thread is: Python drops it in a
    weakref callback or `__del__` (importlib's module locks have such callbacks), losing the stop, and it aborts the
    process inside a C++ extension's callback (torch's imports: pybind11 `terminate called`)."""
    _received.append(signum)


def note_early_signals() -> dict[int, object]:
    """Set `note_signal` as the handler of SIGINT and SIGTERM; returns their previous handlers. A SIGINT that the
    process's starter ignores (a shell's background job) stays ignored, as Python itself leaves it, until the
    server's own handlers take it."""
    return {sig: signal.signal(sig, note_signal) for sig in EARLY_SIGNALS
            if sig != signal.SIGINT or signal.getsignal(sig) is not signal.SIG_IGN}


def take_signal() -> int:
    """The signal to act on among those noted since the last call (`note_signal`), 0 when none: the first that
    came. Of a SIGINT and a SIGTERM both noted, that is the one that would have stopped the start had it been acted
    on at once, and its status (130 or 0) and line are the stop's. Forgets them all."""
    first = _received[0] if _received else 0
    _received.clear()
    return first


def main(argv: list[str] | None = None) -> int:
    """The `voltserve` command: note SIGINT and SIGTERM, then import and run `voltserve.cli.main`; returns its exit
    status."""
    note_early_signals()
    from voltserve.cli import main as cli_main

    return cli_main(argv)
