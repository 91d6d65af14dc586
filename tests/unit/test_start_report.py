"""`voltserve.start_report`: of several API processes whose start fails, the first to fail logs the cause."""

from __future__ import annotations

import pytest

from voltserve import start_report


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not decided yet (each call of `decide` is another process)."""
    def decide() -> tuple[bool, bool]:
        monkeypatch.setattr(start_report, "_decided", {})
        before = start_report.start_reported_elsewhere()
        return before, start_report.claim_start_report()

    return decide


def test_the_first_api_process_to_fail_reports_the_others_stay_quiet(monkeypatch, tmp_path, fresh):
    path = tmp_path / "start-failure-reported"
    monkeypatch.setenv(start_report.START_REPORT_ENV, str(path))
    assert fresh() == (False, True) and path.exists()
    assert fresh() == (False, False) and start_report.start_reported_elsewhere()
    assert start_report.claim_start_report() is False  # decided once per process


def test_a_lone_process_always_reports(monkeypatch, tmp_path, fresh):
    monkeypatch.delenv(start_report.START_REPORT_ENV, raising=False)
    assert fresh() == (False, True) and fresh() == (False, True)
    monkeypatch.setenv(start_report.START_REPORT_ENV, str(tmp_path / "gone" / "note"))  # the supervisor's folder
    assert fresh() == (False, True) and not start_report.start_reported_elsewhere()
