"""tools/profile_step.py's timeline arithmetic on a hand-made trace (the GPU part runs on the device only)."""

import json

import pytest

from tools.profile_step import kernel_events, layer_period, layer_table, split_steps


def _step(t0: float, pdl_overlap: float = 0.0) -> list[tuple[str, float, float]]:
    """One step: embedding, 2 layers of (gemv_a 10 us, attn 3 us), tail argmax; 1 us gaps, except that
    attn starts `pdl_overlap` us before gemv_a ends."""
    out, t = [("embedding_f16", t0, 2.0)], t0 + 2.0
    for _ in range(2):
        out.append(("gemv_a", t + 1.0, 10.0))
        t += 11.0
        start = t - pdl_overlap
        out.append(("attn_decode", start, t + 3.0 - start))
        t += 3.0
    out.append(("argmax_logprob", t + 1.0, 2.0))
    return out


def test_layer_table_shares_add_up_to_the_step():
    steps = split_steps(_step(0.0) + _step(100.0) + _step(200.0), "embedding")
    assert [len(s) for s in steps] == [6, 6, 6]
    table = layer_table(steps, num_layers=2, gemv_bytes=[40_000_000], copy_gbs=4000.0)
    assert table["kernels_per_layer"] == 2 and table["steps"] == 2  # the last step may be cut: dropped
    assert table["tail_kernels"] == ["argmax_logprob"]
    gemv, attn = table["layer"]
    assert gemv["kernel"] == "gemv_a" and gemv["share_us"] == 11.0 and gemv["gap_us"] == 1.0
    assert gemv["ideal_us"] == pytest.approx(10.0) and gemv["fraction"] == pytest.approx(10.0 / 11.0)
    assert attn["share_us"] == 3.0 and attn["ideal_us"] is None
    assert table["head_us"] + 2 * table["layer_us"] + table["tail_us"] == pytest.approx(table["step_span_us"])


def test_early_start_is_a_negative_gap_and_shares_stay_end_to_end():
    steps = split_steps(_step(0.0, pdl_overlap=4.0) * 1 + _step(100.0, pdl_overlap=4.0) + _step(200.0), "embedding")
    attn = layer_table(steps, 2, [1], 4000.0)["layer"][1]
    assert attn["gap_us"] == -4.0 and attn["dur_us"] == 7.0 and attn["share_us"] == 3.0


def test_kernel_events_reads_only_kernels_sorted(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"cat": "kernel", "name": "b", "ts": 5, "dur": 1},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 9},
        {"cat": "kernel", "name": "a", "ts": 2, "dur": 2},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1, "dur": 1}]}))
    assert kernel_events(str(trace)) == [("a", 2.0, 2.0), ("b", 5.0, 1.0)]


def test_layer_period_with_a_tail_longer_than_the_layers():
    """2 layers of (gemv, attn) and a 3-kernel tail: the period is 2, not (n - 1) // layers = 3; a layer that
    repeats a name in itself (two launches of one GEMV) keeps its whole period."""
    names = ["gemv", "attn", "gemv", "attn", "rms_norm", "gemv", "argmax"]
    assert layer_period(names, 2) == 2
    assert layer_period(["gemv", "gemv", "attn"] * 2 + ["argmax"], 2) == 3
    with pytest.raises(ValueError):
        layer_period(["a", "b", "c"], 2)


def test_prefill_step_is_skipped_and_two_launches_a_weight_get_no_ideal():
    prefill = [("embedding_f16", 0.0, 5.0)] + [("gemm", 5.0 + i, 1.0) for i in range(7)]
    decode = [s for t0 in (100.0, 200.0, 300.0) for s in _step(t0)]
    table = layer_table(split_steps(prefill + decode, "embedding"), 2, [40_000_000], 4000.0)
    assert table["steps"] == 2 and table["kernels_per_layer"] == 2  # the 8-kernel prefill step is not counted
    double = [("embedding_f16", 0.0, 1.0)] + [(n, 1.0 + i, 1.0) for i, n in enumerate(["gemv", "gemv", "attn"] * 2)]
    double += [("argmax", 9.0, 1.0)]
    steps = split_steps(double + [(n, t + 20.0, d) for n, t, d in double] * 1 + [("embedding_f16", 99.0, 1.0)],
                        "embedding")
    rows = layer_table(steps, 2, [40_000_000], 4000.0)["layer"]
    assert [r["kernel"] for r in rows] == ["gemv", "gemv", "attn"] and all(r["ideal_us"] is None for r in rows)


def test_mixed_vs_decode_splits_steps_by_kind_and_adds_up_shares():
    from tools.profile_mixed_step import mixed_vs_decode

    decode = [("embedding_q8_0", 0.0, 2.0), ("gemm_tc", 3.0, 10.0), ("attn_decode", 12.0, 5.0)]
    mixed = [("embedding_q8_0", 100.0, 2.0), ("gemm_tc", 103.0, 14.0), ("rope_kv_write", 118.0, 2.0),
             ("attn_decode", 120.0, 5.0), ("attn_prefill", 124.0, 6.0), ("gemm_tc", 131.0, 4.0)]
    table = mixed_vs_decode([decode, mixed, decode])
    assert table["decode"]["steps"] == 2 and table["mixed"]["steps"] == 1
    assert table["decode"]["span_us"] == 17.0 and table["mixed"]["span_us"] == 35.0
    assert table["decode"]["kernels"] == {"embedding_q8_0": {"us_per_step": 2.0, "launches": 1},
                                          "gemm_tc": {"us_per_step": 11.0, "launches": 1},
                                          "attn_decode": {"us_per_step": 4.0, "launches": 1}}
    m = table["mixed"]["kernels"]
    # gemm_tc: 117 - 102 = 15, then 135 - 130 = 5; shares add up to the span
    assert m["gemm_tc"] == {"us_per_step": 20.0, "launches": 2} and m["attn_prefill"]["us_per_step"] == 5.0
    assert sum(v["us_per_step"] for v in m.values()) == 35.0
    assert set(mixed_vs_decode([decode])) == {"decode"}
