"""tools/bench_spec.py on the CPU (the default model, a few tokens): its rows are what they claim."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bench_spec_rows(tmp_path, smollm2_gguf, temperature):
    """Plain and n-gram rows per prompt set; greedy runs check that the output is unchanged (`lossless`), sampled
    ones (speculative sampling, different every run) report their temperature instead. The draft gate is off: a
    gate that measured plain decoding faster would leave the n-gram rows without verifies."""
    out = tmp_path / "spec.json"
    subprocess.run([sys.executable, str(ROOT / "tools" / "bench_spec.py"), "--device", "cpu", "--concurrency", "2",
                    "--max-tokens", "8", "--repeats", "1", "--temperature", str(temperature), "--speculative-gate",
                    "off", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["results"]
    assert [(r["method"], r["prompts"]) for r in rows] == [("none", "copy"), ("none", "free"), ("ngram", "copy"),
                                                           ("ngram", "free")]
    for r in rows:
        assert r["concurrency"] == 2 and r["output_tokens_per_s"] > 0 and len(r["runs"]) == 1
        if r["method"] == "ngram":
            assert r["speedup"] > 0 and r["speculative_gate"] == "off"
            # sampled outputs vary: a run may verify nothing (then the row has no acceptance figures)
            if not temperature or "acceptance_length" in r:
                assert r["drafts_per_verify"] >= 1 and r["acceptance_length"] >= 1
            assert r.get("lossless") is (True if not temperature else None)
        assert r.get("temperature") == (temperature or None)
