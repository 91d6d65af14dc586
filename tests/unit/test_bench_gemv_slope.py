"""tools/bench_gemv_slope.py's fit (the GPU part runs on a device only): time = bytes / rate + fixed."""

import pytest

from tools.bench_gemv_slope import fit_line, slope_row


def test_fit_line_recovers_rate_and_fixed_cost():
    """Points on 2 TB/s plus 3 us: the fit returns both, exactly without noise and within it with +-0.1 us."""
    rate, fixed = 2e12, 3e-6
    points = [(b, b / rate + fixed + e) for b, e in ((10e6, 1e-7), (20e6, -1e-7), (40e6, 1e-7), (80e6, -1e-7))]
    slope, intercept = fit_line(points)
    assert slope == pytest.approx(1 / rate, rel=1e-2)
    assert intercept == pytest.approx(fixed, abs=1e-7)
    exact = [(b, b / rate + fixed) for b, _ in points]
    row = slope_row("grid=full x=auto", exact, copy_bytes_s=2.5e12)
    assert row == {"variant": "grid=full x=auto", "streaming_fraction_of_copy": 0.8, "fixed_us": 3.0, "points": 4}


def test_fit_line_needs_two_sizes():
    with pytest.raises(ValueError, match="two or more distinct"):
        fit_line([(1e6, 1e-6), (1e6, 2e-6)])
    with pytest.raises(ValueError):
        fit_line([(1e6, 1e-6)])
