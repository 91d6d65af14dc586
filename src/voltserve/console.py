"""Entry point of the `voltserve` console script (pyproject's `[project.scripts]`): it takes SIGTERM over before
the command line's imports, which take ~0.15-0.3 s on a 2-core CPU (numpy, asyncio, the config's modules).

A SIGTERM that comes while they run is noted here, and `voltserve.cli.main` acts on it once it has read the
command line and set up logging: a clean stop, status 0 and one warning line, as for one that comes a moment later.
Without this a `systemctl stop` in those first moments killed the process (status 143, no log line). What is left
is the interpreter's own start (~30 ms), before any code of ours runs. This module and the `voltserve` package's
`__init__` import nothing else, so that the handler goes in first.
"""

from __future__ import annotations

import signal

_received: list[int] = []  # the SIGTERMs noted before `voltserve.cli.main` installed its own handler


def _note(signum: int, frame: object) -> None:
    _received.append(signum)


def sigterm_received() -> bool:
    """Whether a SIGTERM came between `main`'s start and `voltserve.cli.main`'s own handler."""
    return bool(_received)


def main(argv: list[str] | None = None) -> int:
    """The `voltserve` command: note SIGTERM, then import and run `voltserve.cli.main`; returns its exit status."""
    signal.signal(signal.SIGTERM, _note)
    from voltserve.cli import main as cli_main

    return cli_main(argv)
