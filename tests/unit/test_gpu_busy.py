"""GpuBusyMeter's window arithmetic (busy share, per-step means) with fake CUDA events and a fake clock."""

from types import SimpleNamespace

from voltserve import gpu_busy


class _FakeEvent:
    def __init__(self, ms: float = 0.0):
        self.ms = ms
        self.recorded = 0

    def record(self):
        self.recorded += 1

    def elapsed_time(self, stop):
        return stop.ms - self.ms


def _timer(gpu_ms: float):
    return SimpleNamespace(start=_FakeEvent(0.0), stop=_FakeEvent(gpu_ms), stopped=False)


def test_window_gives_busy_share_and_step_means(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(gpu_busy.time, "perf_counter", lambda: clock[0])
    lines = []
    meter = gpu_busy.GpuBusyMeter(1.0, log=lambda fmt, *a: lines.append(fmt % a))
    # three steps of 250, 250, 300 ms of GPU work in 1 s of wall: a decode step of 64 rows, a mixed one of
    # 63 decode rows + a 128-token prompt, another decode of 64 rows
    for gpu_ms, rows, tokens, now in ((250, 64, 64, 100.3), (250, 64, 191, 100.6), (300, 64, 64, 101.0)):
        clock[0] = now
        t = _timer(gpu_ms)
        meter.end(t)
        meter.end(t)  # a second end does not re-record
        assert t.stop.recorded == 1
        meter.account(t, rows, tokens)
    assert meter.last == {"busy_fraction": 0.8, "wall_s": 1.0, "steps": 3, "gpu_ms_per_step": 800 / 3,
                          "rows_per_step": 64.0, "tokens_per_step": 319 / 3, "prompt_steps": 1,
                          "prompt_gpu_ms_per_step": 250.0, "decode_gpu_ms_per_step": 275.0}
    assert lines == ["GPU busy 80.0% of 1.0 s: 3 steps, 266.667 ms of GPU work each (2 decode-only 275.000 ms, "
                     "1 with prompt tokens 250.000 ms), 333.333 ms of wall each, 64.0 sequences and 106.3 tokens "
                     "a step"]
    # the counters restart with the next window
    clock[0] = 101.5
    meter.account(_timer(100), 8, 8)
    assert len(lines) == 1
    clock[0] = 102.0
    meter.account(_timer(100), 8, 8)
    assert meter.last["steps"] == 2 and meter.last["rows_per_step"] == 8.0 and meter.last["busy_fraction"] == 0.2
    assert meter.last["prompt_steps"] == 0 and meter.last["prompt_gpu_ms_per_step"] is None
    assert lines[-1].endswith("(2 decode-only 100.000 ms, 0 with prompt tokens -), 500.000 ms of wall each, "
                              "8.0 sequences and 8.0 tokens a step")
