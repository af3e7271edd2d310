"""The Hopper-switch record read back (`varlen_workbench.workbench.bench.hopper_report`): on a synthetic record whose
every figure is known, and on the committed H200 record against the ratios the benchmark stored."""

from __future__ import annotations

import pytest

from varlen_workbench.workbench.bench.hopper_report import (
    CURRENT,
    FA4,
    FUSED,
    TWO_KERNELS,
    backward_gaps,
    format_backward_gaps,
    fused_kernel_times,
    fused_trials,
    hopper_rows,
    load_fused_trial,
    load_hopper,
    refusals,
    speedups,
    switch_table,
    tile_warps,
    value_range,
)

REFUSED = "ValueError: ForwardConfig(warp_specialize=True) with tile 64x64 w4 s3: refused at 4 warps"


def _row(workload, variant, forward=None, both=None, tile="128x64 w8 s3", error=None):
    return {
        "workload": workload,
        "variant": variant,
        "config": variant,
        "tile": tile,
        "check": None if error else "ok",
        "error": error,
        "forward_ms": forward,
        "forward_min_ms": None if forward is None else forward * 0.9,
        "forward_backward_ms": both,
        "forward_backward_min_ms": None if both is None else both * 0.9,
        "ratios": {},
    }


def synthetic() -> dict:
    """Two workloads: a faster and a slower switch, one refused where the tile has 4 warps."""
    return {
        "provenance": {"device": "test", "command": "python -m benchmarks.hopper_forward"},
        "rows": [
            _row("a", CURRENT, 1.0, 4.0),
            _row("a", "fast", 0.5, 3.5),
            _row("a", "slow", 2.0, 5.0),
            _row("a", FA4, 0.5, 2.0, tile=None),
            _row("b", CURRENT, 2.0, 10.0, tile="64x64 w4 s3"),
            _row("b", "fast", 1.6, 9.6, tile="64x64 w4 s3"),
            _row("b", "slow", None, None, tile="64x64 w4 s3", error=REFUSED),
        ],
    }


def test_speedups_are_the_other_median_over_the_variants():
    rows = hopper_rows(synthetic())
    assert speedups(rows, "fast") == {"a": 2.0, "b": 1.25}
    assert speedups(rows, "fast", "forward_backward") == {"a": 4.0 / 3.5, "b": 10.0 / 9.6}
    assert speedups(rows, "slow") == {"a": 0.5}, "a refused variant has no speed-up"
    assert speedups(rows, "fast", "backward") == {"a": 1.0, "b": 1.0}, "the backward: f+b minus forward"
    assert speedups(rows, CURRENT, over=FA4) == {"a": 0.5}, "FA4 ran on one workload"
    assert value_range(speedups(rows, "fast")) == (1.25, 2.0)


def test_refusals_name_the_workload_and_error_and_the_tile_its_warps():
    rows = hopper_rows(synthetic())
    assert refusals(rows) == {"slow": {"b": REFUSED}}
    assert tile_warps("64x64 w4 s3") == 4 and tile_warps("128x64 w8 s3") == 8
    with pytest.raises(ValueError, match="names no warps"):
        tile_warps("128x64")


def test_backward_gap_splits_the_step_at_the_forward():
    gaps = backward_gaps(hopper_rows(synthetic()))
    assert list(gaps) == ["a"], "only where FA4 ran"
    g = gaps["a"]
    # FA4: forward 0.5, backward 1.5; ours: shipped backward 3.0, fastest forward 0.5 ("fast", step 3.5).
    assert (g.forward, g.backward, g.step, g.free_forward, g.backward_share) == (1.0, 0.5, 2.0 / 3.5, 2.0 / 3.0, 0.75)
    assert "0.67x" in format_backward_gaps(gaps)


def test_table_has_a_line_per_row_and_marks_the_refused():
    table = switch_table(hopper_rows(synthetic()))
    assert len(table.rows) == 7
    fast_a = table.rows[1]
    assert fast_a[:5] == ("a", "fast", "128x64 w8 s3", "0.500 (0.450)", "3.500 (3.150)")
    assert fast_a[5:] == ("2.00x", "1.14x", "1.00x", "0.57x", "ok")
    assert table.rows[6][3:] == ("-",) * 6 + ("not run (error below)",)


def test_bad_records_say_what_is_missing(tmp_path):
    record = synthetic()
    del record["rows"][0]["forward_ms"]
    with pytest.raises(ValueError, match=r"row 0 of the record lacks \['forward_ms'\]"):
        hopper_rows(record)
    record = synthetic()
    record["rows"] = [r for r in record["rows"] if not (r["workload"] == "b" and r["variant"] == CURRENT)]
    with pytest.raises(ValueError, match=r"\['b'\] have no 'current' row"):
        hopper_rows(record)
    with pytest.raises(ValueError, match="timed on no workload"):
        value_range({})
    with pytest.raises(FileNotFoundError, match="benchmarks.hopper_forward"):
        load_hopper(tmp_path / "hopper-forward-h200.json")


def test_committed_record_agrees_with_the_ratios_the_benchmark_stored():
    record = load_hopper()
    rows = hopper_rows(record)
    stored = {(r["workload"], r["variant"]): r["ratios"] for r in record["rows"]}
    checked = 0
    for variant in dict.fromkeys(r.variant for r in rows if r.variant != FA4):
        for what in ("forward", "forward_backward"):
            for workload, value in speedups(rows, variant, what).items():
                assert value == pytest.approx(stored[(workload, variant)][f"current / {what}"], abs=6e-4)
                checked += 1
            for workload, value in speedups(rows, variant, what, over=FA4).items():
                assert 1 / value == pytest.approx(stored[(workload, variant)][f"{what} / FA4"], abs=6e-4)
    assert checked >= 2 * 4 * 3, "every timed variant on every workload"
    assert set(backward_gaps(rows)) == {r.workload for r in rows}, "FA4 ran on every workload"


def _mode_row(workload, impl, backward, forward=0.5):
    return {
        "workload": workload,
        "impl": impl,
        "error": None,
        "forward_ms": forward,
        "forward_min_ms": forward,
        "forward_backward_ms": forward + backward,
        "forward_backward_min_ms": forward + backward * 0.95,
        "backward_ms": backward,
        "backward_min_ms": backward * 0.95,
    }


def _tile(kernel, ms):
    return {
        "kernel": kernel,
        "head_dim": 128,
        "causal": True,
        "group": 1,
        "rows_per_seq_log2": 11,
        "timings_ms": {"a": ms, "b": ms * 2},
    }


def test_fused_trial_reads_each_workloads_backward_both_ways():
    record = {
        "checks": {"w1": "ok", "w2": "ok"},
        "rows": [
            _mode_row("w1", TWO_KERNELS, 2.0),
            _mode_row("w1", FUSED, 2.5),
            _mode_row("w1", FA4, 1.0),
            _mode_row("w2", TWO_KERNELS, 1.0),
            _mode_row("w2", FUSED, 0.8),
        ],
        "tiles": [_tile("dkdv", 1.0), _tile("dq", 0.5), _tile("dkdv_fused", 1.8), _tile("forward", 0.3)],
    }
    trials = {t.workload: t for t in fused_trials(record)}
    assert trials["w1"].speedup == pytest.approx(0.8) and trials["w1"].fa4 == (1.0, 0.95)
    assert trials["w2"].speedup == pytest.approx(1.25) and trials["w2"].fa4 is None
    assert fused_kernel_times(record) == [("d128 causal, ~2^11 rows/seq", 1.0, 1.5, 1.8)]
    del record["rows"][1]
    with pytest.raises(ValueError, match="w1: the record lacks a timed"):
        fused_trials(record)


def test_committed_fused_trial_is_slower_than_the_shipped_backward():
    trials = fused_trials(load_fused_trial())
    assert trials and all(t.check == "ok" and t.speedup < 1 for t in trials)
