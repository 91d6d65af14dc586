"""tools/bench_verify.py on the CPU (tiny synthetic model): its rows are what they claim, greedy outputs equal."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_verify_rows(tmp_path):
    out = tmp_path / "verify.json"
    subprocess.run([sys.executable, str(ROOT / "tools" / "bench_verify.py"), "--device", "cpu", "--shape", "tiny",
                    "--tokens", "12", "--batch", "1,2", "--k", "2", "--draft-shape", "tiny", "--temperature", "0.8",
                    "--out", str(out)], check=True, cwd=ROOT,
                   capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["results"]
    plain = [r for r in rows if r["run"] == "plain"]
    verify = {(r["batch"], r["drafts"], r["draft_max_pause"]): r for r in rows if r["run"] == "verify"}
    assert [r["batch"] for r in plain] == [1, 2] and len(verify) == 6
    assert all(r["lossless"] and r["k"] == 2 for r in verify.values())
    for b in (1, 2):
        # 11 tokens after the prefill's: drafts that pass give 3 a verify (4 verifies a sequence: 3 + 3 + 3 + 2)
        assert verify[b, "pass", 0]["verify_steps"] == 4 * b and verify[b, "pass", 0]["accepted"] == 7 * b
        # all fail: a verify every token but the last (no room for a draft), or with backoff after 1, 2 + 1, 4 + 1
        assert verify[b, "fail", 0]["verify_steps"] == 10 * b and verify[b, "fail", 0]["accepted"] == 0
        assert verify[b, "fail", 64]["verify_steps"] == 3 * b and verify[b, "fail", 64]["accepted"] == 0
    # a random draft model's drafts, no backoff: 12 steps (the prefill's, then 11 that each verify <= 2 drafts:
    # none with room for a draft at the last), their time split between the drafter and the rest
    drafted = [r for r in rows if r["run"] == "draft_model"]
    assert [(r["batch"], r["k"], r["steps"]) for r in drafted] == [(1, 2, 12), (2, 2, 12)]
    for r in drafted:
        assert r["verify_steps"] == 10 * r["batch"] and r["draft_ms_per_step"] > 0 and r["verify_ms_per_step"] > 0
        assert r["lossless"]
        assert set(r["projected_speedup"]) == {"0.5", "0.7", "0.9"}
    # sampled verify steps of the last token repeated (point masses, on random weights mostly rejected): after the
    # prefill's token each step emits 1 + what it accepted, and every step verifies but the prefill's and a last
    # one with no room for a draft
    sampled = {r["batch"]: r for r in rows if r["run"] == "verify_sampled"}
    assert sorted(sampled) == [1, 2] and all(r["k"] == 2 and r["temperature"] == 0.8 for r in sampled.values())
    one = sampled[1]
    assert one["steps"] == 12 - one["accepted"] and one["verify_steps"] in (one["steps"] - 2, one["steps"] - 1)
    assert one["tokens_per_step"] == round(12 / one["steps"], 3)
    assert 6 <= sampled[2]["steps"] <= 12 and sampled[2]["verify_steps"] >= sampled[2]["steps"] - 2
    assert all(r["plain_ms_per_step"] > 0 and r["verify_ms_per_step"] > 0 for r in sampled.values())


def test_busy_seconds_counts_overlaps_once():
    """--gpu-busy's union of kernel intervals: overlapping (PDL) and nested intervals once, gaps not at all."""
    sys.path.insert(0, str(ROOT))
    from tools.bench_verify import busy_seconds

    assert busy_seconds([]) == 0.0
    assert busy_seconds([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (5.5, 6.0), (7.0, 8.0)]) == 3.0 + 3.0
