"""One report of a failed start under `voltserve serve --api-processes N`.

The N API processes start on one engine: when its start fails (a bad model file, say), each of them fails on the
same cause and would log the same `bad configuration: ...` line, N times. The supervisor
(`voltserve.api_processes`) names a file in its private folder in START_REPORT_ENV; the first API process whose
start fails creates it (O_EXCL, so exactly one wins) and logs why; the others exit with the same status quietly.
"""

from __future__ import annotations

import os

START_REPORT_ENV = "VOLTSERVE_START_REPORT_PATH"  # set by the supervisor for its API processes only

_decided: dict[str, bool] = {}  # "reports" -> this process's answer, once claim_start_report() has run


def claim_start_report() -> bool:
    """Called when this process's start has failed: whether it logs why. True for a lone process; for one of
    several API processes, True only for the first of them to fail. Decided once per process (later calls
    return the first answer).

    Returns:
        False where another API process has logged the failure already.
    """
    if "reports" not in _decided:
        path = os.environ.get(START_REPORT_ENV)
        reports = True
        if path:
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                reports = False
            except OSError:  # the supervisor's folder is gone (it was killed): report, rather than say nothing
                pass
        _decided["reports"] = reports
    return _decided["reports"]


def start_reported_elsewhere() -> bool:
    """Whether `claim_start_report()` has run in this process and found another's report (False before it)."""
    return _decided.get("reports") is False
