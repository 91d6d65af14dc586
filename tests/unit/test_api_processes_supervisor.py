"""`voltserve.api_processes.run_api_processes` with its children replaced by doubles: which signals each child
gets and the supervisor's exit status (the real processes: tests/e2e/test_api_processes.py)."""

from __future__ import annotations

import itertools
import os
import signal

import pytest

from voltserve import api_processes
from voltserve.config import EngineConfig


class _Child:
    """A child that exits with `code_on_term` when it gets SIGTERM, or with `exits_with` on its own; one never
    signalled gives up after a few hundred polls with status 7 (a test fails instead of hanging)."""

    pids = itertools.count(1_000_000)

    def __init__(self, code_on_term: int = 0, exits_with: int | None = None):
        self.pid = next(self.pids)
        self.signals: list[int] = []
        self.returncode = exits_with
        self._code_on_term = code_on_term
        self._polls = 0

    def poll(self):
        self._polls += 1
        if self.returncode is None and self._polls > 300:
            self.returncode = 7
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGTERM and self.returncode is None:
            self.returncode = self._code_on_term

    def kill(self) -> None:
        self.returncode = -signal.SIGKILL

    def wait(self):
        return self.returncode


def _run(monkeypatch, make_child) -> tuple[int, list[_Child]]:
    """run_api_processes with 3 children made by `make_child(i)`; returns (status, children)."""
    children: list[_Child] = []

    def popen(*args, **kwargs):
        child = make_child(len(children))
        children.append(child)
        return child

    monkeypatch.setattr(api_processes.subprocess, "Popen", popen)
    monkeypatch.setattr(api_processes, "POLL_S", 0.01)
    return api_processes.run_api_processes(EngineConfig(api_processes=3, port=0).validate()), children


def test_a_signal_while_children_start_reaches_the_later_ones(monkeypatch):
    """SIGTERM arrives during the first child's start: every child gets exactly one, and the stop is clean."""

    def make(i: int) -> _Child:
        if i == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this child is in the list
        return _Child()

    status, children = _run(monkeypatch, make)
    assert status == 0 and [c.signals for c in children] == [[signal.SIGTERM]] * 3


def test_a_child_that_exits_on_its_own_stops_the_others_with_its_status(monkeypatch):
    """E.g. the engine died: that child exits 1, the supervisor stops the rest and exits 1 (systemd restarts)."""
    status, children = _run(monkeypatch, lambda i: _Child(exits_with=1 if i == 1 else None))
    assert status == 1 and [c.signals for c in children] == [[signal.SIGTERM], [], [signal.SIGTERM]]


def test_a_child_failing_during_a_requested_stop_gives_status_1(monkeypatch):
    def make(i: int) -> _Child:
        if i == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return _Child(code_on_term=3 if i == 1 else 0)

    assert _run(monkeypatch, make)[0] == 1


@pytest.mark.parametrize("code", [0, -signal.SIGTERM])
def test_children_stopped_by_sigterm_are_a_clean_stop(monkeypatch, code):
    """-SIGTERM: a child that had not set up its handlers yet (it was still importing)."""
    def make(i: int) -> _Child:
        if i == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return _Child(code_on_term=code)

    assert _run(monkeypatch, make)[0] == 0


def test_port_0_is_the_port_the_os_chose_in_the_log_and_the_childrens_config(monkeypatch, caplog):
    """`--api-processes N --port 0`: the supervisor's line and each child's config (its own "serving ... on" line)
    name the port the OS chose, not 0 (README: `--port 0` logs the port the OS chose)."""
    import logging

    envs = []

    def popen(*args, env, **kwargs):
        envs.append(env)
        return _Child(exits_with=0)

    monkeypatch.setattr(api_processes.subprocess, "Popen", popen)
    caplog.set_level(logging.INFO, logger=api_processes.logger.name)
    api_processes.run_api_processes(EngineConfig(api_processes=2, port=0).validate())  # the children exit at once
    ports = {env["VOLTSERVE_PORT"] for env in envs}
    (port,) = ports
    assert int(port) > 0
    assert any(f"on http://127.0.0.1:{port}, one engine" in r.getMessage() for r in caplog.records)


def test_a_sigterm_during_the_supervisors_cleanup_does_not_cut_it(monkeypatch):
    """`voltserve serve` (cli.main) sets SIGTERM to raise until the server's handlers replace it; the supervisor put
    that one back before its cleanup, so a SIGTERM there (systemctl stop as a child fails) skipped the removal of
    its socket file and private folder, and main turned the child's status 1 into 0 ("before the server
    started"). The supervisor's own handler stays until the cleanup is done."""
    from voltserve import console

    dirs = api_processes.owned_dirs
    made, real_make, real_remove = [], dirs.make, dirs.remove
    monkeypatch.setattr(dirs, "make", lambda prefix: made.append(real_make(prefix)) or made[-1])

    def remove(folder):
        os.kill(os.getpid(), signal.SIGTERM)
        real_remove(folder)

    monkeypatch.setattr(dirs, "remove", remove)
    previous = signal.signal(signal.SIGTERM, console.note_signal)
    try:
        status, _ = _run(monkeypatch, lambda i: _Child(exits_with=1 if i == 1 else None))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert status == 1 and not os.path.exists(made[0])
    console.take_signal()  # (noted after the supervisor's handler went: nobody's to act on)

