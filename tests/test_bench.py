"""The benchmark's accounting (the timing itself needs CUDA and runs on the GPU machine)."""

from __future__ import annotations

import types

import pytest
import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.workbench.bench.kernel_record import GUARDED_FA4, Row, Timing
from varlen_workbench.workbench.bench.kernel_report import format_table
from varlen_workbench.workbench.bench.kernels import MIN_ITERS, recorded_iters, recorded_minima, run_benchmark
from varlen_workbench.workbench.bench.workloads import Workload, long_tailed_lengths, workloads
from varlen_workbench.workbench.layout import Case


def test_flops_count_real_work_per_document():
    w = Workload("x", Case((3, 5), heads=2, head_dim=16))
    assert w.flops(False) == 4 * 2 * 16 * (9 + 25)
    assert w.flops(True) == 3.5 * w.flops(False)
    assert Workload("c", Case((3, 5), heads=2, head_dim=16, causal=True)).flops(False) == w.flops(False) / 2


def test_long_tailed_lengths_sum_to_total_and_are_mostly_short():
    lengths = long_tailed_lengths(16384, seed=0)
    assert sum(lengths) == 16384 and min(lengths) > 0
    short = sum(n <= 64 for n in lengths)
    assert short > len(lengths) / 2 and max(lengths) > 1000


def test_issue_configurations_are_present():
    """Issue 17's workloads: 8x2048 at d64/d128 causal and not, GQA 32/8, 4x16384, long tails
    of 16k and 32k, short documents of <=256 and <=512, a sliding window of 4096 over 32k."""
    named = {w.name: w for w in workloads()}
    assert sum(n.startswith("8x2048 d") for n in named) == 4
    padded = next(w for w in named.values() if "padded" in w.name)
    assert padded.case.tail_q and padded.case.align
    gqa = next(w for n, w in named.items() if "GQA" in n)
    assert (gqa.case.heads, gqa.case.kv_heads, gqa.case.causal) == (32, 8, True)
    assert named["4x16384 d128 causal"].case.seqlens_q == (16384,) * 4
    shorts = [w for n, w in named.items() if n.startswith("16k short")]
    assert sorted(max(w.case.seqlens_q) <= bound for w, bound in zip(shorts, (256, 512))) == [True, True]
    sliding = next(w for n, w in named.items() if "sliding" in n)
    assert sliding.window == (4096, 0) and sum(sliding.case.seqlens_q) == 32768
    assert max(sliding.case.seqlens_q) > 4096, "the window must bind on some document"
    long32 = next(w for n, w in named.items() if n.startswith("32k long-tail (") and "causal" in n)
    assert long32.case == sliding.case and long32.window == (-1, -1)


def test_sliding_window_flops_count_the_visible_pairs():
    from varlen_workbench.workbench.bench.workloads import visible_pairs

    assert visible_pairs(5, 5, (-1, 0)) == 15
    assert visible_pairs(5, 5, (1, 0)) == 9  # 1 + 2 + 2 + 2 + 2
    assert visible_pairs(3, 5, (0, 0)) == 3  # bottom-right: rows see keys 2, 3, 4
    assert visible_pairs(5, 3, (0, 0)) == 3  # the first two rows see nothing
    w = Workload("w", Case((6,), heads=1, head_dim=4, causal=True), window=(2, -1))
    assert w.flops(False) == 4 * 4 * (1 + 2 + 3 + 3 + 3 + 3)


def test_table_reports_ratios_and_contract_cost():
    rows = [
        Row("16k long-tail d128", "ours", Timing(1.0, 2.0, 10.0), 100.0, 90.0, 500.0, {"torch varlen_attn": 1.5}),
        Row("16k long-tail padded", "ours", Timing(1.0, 2.02, 10.0), 100.0, 90.0, 500.0),
        Row("16k long-tail d128", "SDPA dense (flash)", Timing(error="RuntimeError: no kernel")),
    ]
    table = format_table(rows)
    assert "torch varlen_attn 1.50x" in table
    assert "+1.0% forward+backward" in table
    assert "failed: RuntimeError: no kernel" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_benchmark_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        run_benchmark(quick=True)


def _record(tmp_path, rows):
    from varlen_workbench.workbench.bench.kernel_record import to_record
    from varlen_workbench.workbench.records import write_record

    payload = to_record(rows, tiles=[{"kernel": "forward", "tile": "128x64 w8 s3"}])
    return write_record(tmp_path / "bench-test.json", payload, command="python -m varlen_workbench.workbench.bench.kernels")


def test_records_round_trip_to_the_same_table(tmp_path):
    from varlen_workbench.workbench.bench.kernel_report import records_table
    from varlen_workbench.workbench.records import load_records

    rows = [
        Row("16k long-tail d128", "ours", Timing(1.0, 2.0, 10.0), 100.0, 90.0, 500.0, {"torch varlen_attn": 1.5}),
        Row("16k long-tail d128", "SDPA dense (flash)", Timing(error="RuntimeError: no kernel")),
    ]
    _record(tmp_path, rows)
    (record,) = load_records("bench-*.json", tmp_path)
    assert record["file"] == "bench-test.json" and record["tiles"][0]["tile"] == "128x64 w8 s3"
    assert records_table(record) == format_table(rows)


def test_load_records_names_the_command_when_there_are_none(tmp_path):
    from varlen_workbench.workbench.bench.kernel_record import RECORD_COMMAND
    from varlen_workbench.workbench.records import load_records

    with pytest.raises(FileNotFoundError, match="--record data/gpu/bench-"):
        load_records("bench-*.json", tmp_path, how=RECORD_COMMAND)


def test_plot_has_one_bar_per_successful_run(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from varlen_workbench.workbench.bench.kernel_report import plot_records

    rows = [
        Row("a", "ours", Timing(1.0, 2.0, 10.0), 100.0, 90.0, 500.0),
        Row("a", "peer", Timing(1.0, 3.0, 10.0), 100.0, 60.0, 500.0),
        Row("b", "ours", Timing(1.0, 2.0, 10.0), 100.0, 80.0, 500.0),
        Row("b", "peer", Timing(error="no")),
    ]
    ax = plot_records(_record(tmp_path, rows))
    assert sorted(round(p.get_height()) for p in ax.patches) == [60, 80, 90]

    many = [Row("a", f"impl {i}", Timing(1.0, 2.0, 10.0), 100.0, 90.0, 500.0) for i in range(11)]
    ax = plot_records(_record(tmp_path, many))
    assert len({p.get_facecolor() for p in ax.patches}) == 11, "more implementations than the default cycle's ten colours"


def test_shape_and_impl_filters_are_checked_before_timing():
    with pytest.raises(ValueError, match=r"shapes \['nothing'\] match no workload; the workloads are \['8x2048 d64'"):
        run_benchmark(shapes=["nothing"])
    with pytest.raises(ValueError, match=r"impls \['mine'\] are not benchmarked; choose from \['ours'"):
        run_benchmark(impls=["mine"])


def test_compile_candidates_runs_forward_and_backward_pinned(monkeypatch):
    """The precompile job: candidate `index` of every kernel pinned, on a small batch."""
    from varlen_workbench.kernels.varlen import launch
    from varlen_workbench.kernels.varlen.tuner import TileTuner
    from varlen_workbench.workbench.bench.kernels import _compile_candidates

    seen = []
    real = TileTuner.launch

    def spy(self, key, candidates, launch_fn, work):
        seen.append((key[0], self.pins.get(key[0])))
        return real(self, key, candidates, launch_fn, work)

    monkeypatch.setattr(TileTuner, "launch", spy)
    _compile_candidates(Case((5,), heads=2, head_dim=16, causal=True), index=3, device=str(default_device()))
    expected = {k: launch.candidate_tiles(k, 16, torch.float32, default_device()) for k in ("forward", "dkdv", "dq")}
    assert [k for k, _ in seen] == ["forward", "dq", "dkdv"]  # dQ first: it writes delta
    assert all(tile == expected[k][min(3, len(expected[k]) - 1)] for k, tile in seen)


def test_targets_judge_the_worst_configuration():
    from varlen_workbench.workbench.bench.kernel_report import targets
    from varlen_workbench.workbench.bench.verdict import format_targets

    rows = [
        Row(
            "8x2048 d128",
            "ours",
            Timing(1.0, 2.0, 300.0),
            ratios={
                "torch varlen_attn": 1.5,
                "torch varlen_attn (fwd)": 1.4,
                "SDPA dense (cuDNN)": 0.7,
                "SDPA dense (cuDNN) (fwd)": 0.5,
                "SDPA dense (flash)": 1.1,
                "SDPA dense (flash) (fwd)": 1.0,
            },
        ),
        Row("8x2048 d128", "torch varlen_attn", Timing(1.4, 3.0, 400.0)),
        Row(
            "16k long-tail d128",
            "ours",
            Timing(1.0, 2.0, 500.0),
            ratios={"torch varlen_attn": 1.2, "torch varlen_attn (fwd)": 1.0},
        ),
        Row("16k long-tail d128", "torch varlen_attn", Timing(1.0, 2.4, 400.0)),
        Row("16k long-tail padded", "ours", Timing(1.0, 2.02, 500.0)),
    ]
    rows += [
        Row("8x2048 d128", "ours validate=True", Timing(1.03, 2.2, 300.0)),
        Row("8x2048 d128", "ours CUDA graph", Timing(0.9, 1.8, 300.0)),
        Row("16k long-tail d128", "ours validate=True", Timing(2.0, 4.0, 300.0)),  # not at 8x2048: not judged
        Row("8x2048 d128", "FlashAttention-4 varlen", Timing(0.5, 1.0, 300.0)),
        Row("8x2048 d128", GUARDED_FA4, Timing(0.51, 1.04, 300.0)),
        Row("16k long-tail d128", GUARDED_FA4, Timing(0.7, 1.5, 300.0)),  # FA4 alone did not run: not judged
    ]
    found = {t.name: t for t in targets(rows)}
    varlen = found["forward+backward >= 1.3x torch varlen_attn, every workload it runs"]
    assert (varlen.measured, varlen.worst_case, varlen.met) == (1.2, "16k long-tail d128", False)
    cudnn = found["forward+backward >= 0.8x SDPA dense (cuDNN), d128 equal lengths"]
    assert cudnn.measured == 0.7 and found["forward >= 0.8x SDPA dense (cuDNN), d128 equal lengths"].measured == 0.5
    validate_fwd = found["validate=True costs <= 5% over validate=False, forward, same metadata (8x2048)"]
    assert validate_fwd.met and validate_fwd.measured == pytest.approx(0.03)
    validate_fb = found["validate=True costs <= 5% over validate=False, forward+backward, same metadata (8x2048)"]
    assert not validate_fb.met and validate_fb.measured == pytest.approx(0.1)
    graph = next(t for n, t in found.items() if n.startswith("whole step captured"))
    assert graph.measured == pytest.approx(0.9) and graph.met
    padded = next(t for n, t in found.items() if n.startswith("padded layout"))
    assert padded.met and abs(padded.measured - 0.01) < 1e-12
    guarded = next(t for n, t in found.items() if n.startswith("forward+backward of FA4 behind our wrapper"))
    assert (guarded.worst_case, guarded.met) == ("8x2048 d128", True) and guarded.measured == pytest.approx(1 / 1.04)
    peak = next(t for n, t in found.items() if n.startswith("peak memory"))
    assert peak.measured == 1.25 and peak.worst_case == "16k long-tail d128"
    assert not any(n.startswith("forward+backward >= 1.0x FlexAttention") for n in found), "FlexAttention did not run"
    assert "NO" in format_targets(list(found.values()))


def test_kernel_times_attribute_a_class_to_its_first_workload():
    from varlen_workbench.kernels.varlen.tuner import SHAPE_CLASS_FIELDS, shape_class
    from varlen_workbench.workbench.bench.kernel_record import to_record
    from varlen_workbench.workbench.bench.kernel_report import kernel_times

    named = {w.name: w for w in workloads()}
    first, second = "16k long-tail (297 docs) d128 causal", next(n for n in named if n.startswith("16k short"))
    c = named[first].case
    tiles = []
    for kernel, ms in (("forward", 0.25), ("dkdv", 0.4), ("dq", 0.3)):
        key = shape_class(kernel, c.torch_dtype, c.heads, c.head_dim, c.total_rows("q"), c.batch, c.causal, 1)
        entry = dict(zip(SHAPE_CLASS_FIELDS, key))
        del entry["sliding"], entry["head_dim_v"]  # a record from before windows and v's head dim: its classes had none
        tiles.append({**entry, "tile": "t", "timings_ms": {"t": ms, "u": 9.0}})
    rows = [Row(first, "ours", Timing(0.5, 2.0, 1.0)), Row(second, "ours", Timing(0.5, 2.0, 1.0))]
    times = kernel_times(to_record(rows, tiles))
    assert list(times) == [first]  # the short-docs batch falls in the same class, timed on the first
    assert times[first] == pytest.approx(
        {"forward kernel": 0.25, "forward op": 0.5, "all kernels": 0.95, "forward+backward op": 2.0}
    )


def test_host_times_compare_our_host_time_with_the_gpu_time_and_varlen_attn():
    from varlen_workbench.workbench.bench.kernel_report import format_host_times, host_times

    rows = [
        Row("short", "ours", Timing(0.3, 1.5, 10.0, host_ms=1.5)),
        Row("short", "torch varlen_attn", Timing(0.2, 1.1, 10.0, host_ms=0.8)),
        Row("padded", "ours", Timing(0.3, 1.4, 10.0, host_ms=1.1)),  # no varlen_attn peer
        Row("old", "ours", Timing(0.3, 1.4, 10.0)),  # a record from before host times
    ]
    found = host_times(rows)
    assert set(found) == {"short", "padded"}
    assert found["short"] == {"host ms": 1.5, "f+b ms": 1.5, "varlen_attn host ms": 0.8}
    assert found["padded"]["varlen_attn host ms"] != found["padded"]["varlen_attn host ms"]  # nan
    table = format_host_times(found)
    assert "100%" in table.splitlines()[1] and "79%" in table.splitlines()[2]


def test_profile_record_lists_every_kernel_and_a_missing_one_says_how_to_get_it(tmp_path):
    from varlen_workbench.workbench.bench.kernel_report import format_profile, load_profile

    profile = load_profile()
    assert profile["provenance"]["command"].startswith("ncu ")
    lines = format_profile(profile).splitlines()
    assert len(lines) == 1 + len(profile["kernels"])
    assert any(line.startswith("attention_forward_kernel") for line in lines)
    with pytest.raises(FileNotFoundError, match="no ncu-h200.json under"):
        load_profile(tmp_path / "ncu-h200.json")


def test_ratio_plot_has_one_bar_per_peer_and_workload_and_names_on_the_y_axis(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from varlen_workbench.workbench.bench.kernel_report import plot_ratios, ratios_by_workload

    ratios = {"torch varlen_attn": 1.4, "torch varlen_attn (fwd)": 1.5, "FlexAttention (compiled)": 0.9}
    rows = [
        Row("a long workload name", "ours", Timing(1.0, 2.0, 10.0), ratios={**ratios, "FlexAttention (compiled) (fwd)": 1.1}),
        Row("b", "ours", Timing(1.0, 2.0, 10.0), ratios={"SDPA dense (cuDNN)": 0.7, "SDPA dense (cuDNN) (fwd)": 0.6}),
    ]
    record = _record(tmp_path, rows)
    assert ratios_by_workload(record)["a long workload name"]["torch varlen_attn"] == (1.4, 1.5)
    both, forward = plot_ratios(record)
    assert sorted(round(p.get_width(), 2) for p in both.patches) == [0.7, 0.9, 1.4]
    assert sorted(round(p.get_width(), 2) for p in forward.patches) == [0.6, 1.1, 1.5]
    assert [t.get_text() for t in both.get_yticklabels()] == ["a long workload name", "b"]


def test_merge_records_joins_disjoint_runs_and_refuses_overlaps(tmp_path):
    from varlen_workbench.workbench.bench.kernel_record import to_record
    from varlen_workbench.workbench.bench.kernel_report import merge_records
    from varlen_workbench.workbench.records import write_record

    a = write_record(
        tmp_path / "a.json", to_record([Row("a", "ours", Timing(1.0, 2.0, 10.0))], tiles=[{"kernel": "forward"}]), command="cmd a"
    )
    b = write_record(tmp_path / "b.json", to_record([Row("b", "ours", Timing(1.0, 3.0, 10.0))]), command="cmd b")
    merged = merge_records([a, b])
    assert [r["workload"] for r in merged["rows"]] == ["a", "b"] and merged["tiles"] == [{"kernel": "forward"}]
    assert merged["provenance"]["command"] == "cmd a | cmd b"
    assert merged["provenance"]["device"] == a["provenance"]["device"]
    with pytest.raises(ValueError, match=r"records overlap on workloads \['a'\]"):
        merge_records([a, a])


def test_workload_commits_name_the_commit_of_each_merged_run():
    from varlen_workbench.workbench.bench.kernel_report import workload_commits

    def run(commit, *workloads):
        return {
            "provenance": {"commit": commit},
            "rows": [{"workload": w, "impl": impl} for w in workloads for impl in ("ours", "peer")],
        }

    records = [run("9c35629ecf4cd680023a5b62c89541c2a603c72c", "mix"), run("16a3a23", "8x2048 d64", "8x2048 d128")]
    assert workload_commits(records) == {"mix": "9c35629", "8x2048 d64": "16a3a23", "8x2048 d128": "16a3a23"}


def test_host_cost_log_reads_each_variant_and_needs_provenance(tmp_path):
    from varlen_workbench.workbench.bench.kernel_report import host_cost_log

    table = [
        "device cuda, torch x; per forward+backward, kernels stubbed:",
        "variant                                   host us  function calls  launches",
        "triton, validate=False                      658.8             391       6.0",
        "fa4, same metadata, TAIL rows               377.4             200       0.0",
    ]
    log = tmp_path / "host.log"
    log.write_text("\n".join(["# H200, commit abc, date: command", *table]) + "\n")
    read = host_cost_log(log)
    assert read.provenance == "H200, commit abc, date: command" and read.text == "\n".join(table)
    assert read.variants == {"triton, validate=False": (658.8, 391, 6.0), "fa4, same metadata, TAIL rows": (377.4, 200, 0.0)}
    log.write_text("\n".join(table))
    with pytest.raises(ValueError, match="provenance"):
        host_cost_log(log)
    log.write_text("\n".join(["# H200", *table, "triton, validate=False  fast"]))
    with pytest.raises(ValueError, match="is not a variant"):
        host_cost_log(log)
    assert "fa4, same metadata" in host_cost_log().variants  # the committed H200 log


def test_one_timer_reports_min_and_median_over_at_least_20_calls():
    from varlen_workbench.workbench.timing import MIN_ITERS, time_call

    calls = []
    timed = time_call(lambda: calls.append(sum(range(2000))), warmup=2, device="cpu")
    assert len(calls) == 2 + MIN_ITERS and timed.iters == MIN_ITERS == 20
    assert 0 < timed.min_ms <= timed.median_ms
    with pytest.raises(ValueError, match="iters=5; time at least 20 calls"):
        time_call(lambda: None, iters=5, device="cpu")


def test_host_time_is_the_least_run_mean_per_call(monkeypatch):
    """`host_us`: warm-up calls untimed, then the least of the runs' mean microseconds per call."""
    from varlen_workbench.workbench import timing

    clock = iter([0.0, 0.9, 1.0, 1.3, 2.0, 2.6])  # three runs of 2 calls: 0.9 s, 0.3 s, 0.6 s
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))  # timing's clock only
    calls = []
    assert timing.host_us(lambda: calls.append(1), calls=2, repeats=3, warmup=4) == pytest.approx(0.15e6)
    assert len(calls) == 4 + 2 * 3
    clock = iter([0.0, 0.9, 1.0, 1.3])
    events = []
    timing.host_us(lambda: events.append("call"), calls=1, repeats=2, warmup=1, drain=lambda: events.append("drain"))
    assert events == ["call", "drain", "call", "drain", "call"]  # drained before each timed run, never inside one


def test_bench_refuses_fewer_than_20_timed_calls(capsys):
    from varlen_workbench.workbench.bench.kernels import main

    with pytest.raises(SystemExit):
        main(["--iters", "5"])
    assert "--iters 5: time at least 20 calls" in capsys.readouterr().err


def test_timings_table_is_one_row_per_measurement_and_folds_on_the_site():
    from varlen_workbench.workbench.bench.kernel_report import TIMINGS_HEADER, timings_table

    rows = [Row(f"w{i}", "ours", Timing(1.0, 2.0, 10.0, 0.5), 100.0, 90.0, 500.0) for i in range(20)]
    rows.append(Row("w20", "SDPA dense (flash)", Timing(error="RuntimeError: no kernel")))
    shown = timings_table(rows)
    assert shown.header == TIMINGS_HEADER and len(shown.rows) == 21
    assert shown.rows[0][2:] == ("1.000", "2.000", "100.0", "90.0", "500", "10", "0.500")
    assert shown.rows[-1][2] == "failed: RuntimeError: no kernel"
    assert "5 more rows" in shown._repr_html_()  # 16 shown, the rest behind the toggle


def test_timings_table_shows_the_fastest_call_beside_the_median():
    from varlen_workbench.workbench.bench.kernel_report import timings_table

    timed = Timing(1.0, 2.0, 10.0, 0.5, forward_min_ms=0.9, forward_backward_min_ms=1.8)
    shown = timings_table([Row("w", "ours", timed, 100.0, 90.0, 500.0)])
    assert shown.rows[0][2:4] == ("1.000 (0.900)", "2.000 (1.800)")


def test_fastest_calls_judge_the_ratios_on_each_fastest_call():
    """Times become the fastest calls (the median where none was kept) and the peers' ratios are
    recomputed from them: a median the machine inflated no longer decides a verdict."""
    from varlen_workbench.workbench.bench.kernel_report import fastest_calls

    rows = [
        Row("w", "ours", Timing(1.0, 4.0, forward_min_ms=0.5, forward_backward_min_ms=2.0), ratios={"peer": 0.75}),
        Row("w", "peer", Timing(1.5, 3.0, forward_min_ms=1.0, forward_backward_min_ms=2.5)),
        Row("w", "old peer", Timing(2.0, 6.0)),  # a record without minima
    ]
    ours, peer, old = fastest_calls(rows)
    assert (ours.timing.forward_ms, ours.timing.forward_backward_ms, peer.timing.forward_backward_ms) == (0.5, 2.0, 2.5)
    assert ours.ratios == {"peer": 1.25, "peer (fwd)": 2.0, "old peer": 3.0, "old peer (fwd)": 4.0}
    assert rows[0].ratios == {"peer": 0.75} and rows[0].timing.forward_ms == 1.0  # the medians' rows untouched


def test_format_targets_shows_the_verdict_on_the_fastest_calls_beside_the_medians():
    from varlen_workbench.workbench.bench.verdict import Target, format_targets

    median = [Target("speed >= 1x peer", 0.8, 1.0, True, "w")]
    fastest = [Target("speed >= 1x peer", 1.1, 1.0, True, "v")]
    line = format_targets(median, fastest).splitlines()[1]
    assert line.split()[-5:] == ["0.800", "NO", "1.100", "yes", "w"]
    assert format_targets(median).splitlines()[1].split()[-3:] == ["0.800", "NO", "w"]


def test_the_targets_verdict_is_worded_from_the_judgements_not_typed():
    """performance.ipynb says which targets hold through targets_summary: a re-recorded run re-words it."""
    from varlen_workbench.workbench.bench.verdict import Target, targets_summary

    median = [
        Target("memory <= 1x peer", 0.7, 1.0, False, "a"),
        Target("wrapper >= 0.95x fa4", 0.96, 0.95, True, "b"),
        Target("speed >= 1.3x peer", 0.7, 1.3, True, "c"),
    ]
    fastest = [
        Target("memory <= 1x peer", 0.7, 1.0, False, "a"),
        Target("wrapper >= 0.95x fa4", 0.948, 0.95, True, "short docs"),
        Target("speed >= 1.3x peer", 0.8, 1.3, True, "c"),
    ]
    text = targets_summary(median, fastest)
    assert text.startswith("**2 of 3 targets hold on the medians:**\n\n- memory <= 1x peer\n- wrapper >= 0.95x fa4")
    assert "- wrapper >= 0.95x fa4: 0.948, 0.2% short of its bound, on short docs" in text
    assert "**The 1 others fail" in text and "- speed >= 1.3x peer: 0.700 on c" in text
    assert "hold on the fastest calls too" in targets_summary(median[:1], fastest[:1])


def test_recorded_iters_and_minima_read_the_record():
    record = {
        "provenance": {"command": "python -m varlen_workbench.workbench.bench.kernels --iters 40 --record x.json"},
        "rows": [{"forward_backward_min_ms": None}],
    }
    assert recorded_iters(record) == 40 and not recorded_minima(record)
    record = {
        "provenance": {"command": "python -m varlen_workbench.workbench.bench.kernels --record x.json"},
        "rows": [{"forward_backward_min_ms": 1.0}],
    }
    assert recorded_iters(record) == MIN_ITERS and recorded_minima(record)


def test_speed_table_pairs_ours_with_the_peer_median_and_fastest_across_merged_runs():
    """Two runs of disjoint workloads, as the committed records are: one line per workload both
    ran, times as "median (min)" and the speed-up on the medians and on the fastest calls."""
    from varlen_workbench.workbench.bench.kernel_record import set_peer_ratios, to_record
    from varlen_workbench.workbench.bench.kernel_report import speed_table

    def run(workload: str, ours: Timing, peer: Timing, device: str = "NVIDIA H200") -> dict:
        rows = {"ours": Row(workload, "ours", ours, 1.0, 1.0, 1.0), "peer": Row(workload, "peer", peer, 1.0, 1.0, 1.0)}
        set_peer_ratios(rows)
        return {**to_record(list(rows.values())), "provenance": {"device": device}}

    records = [
        run(
            "a",
            Timing(1.0, 2.0, forward_min_ms=1.0, forward_backward_min_ms=1.5),
            Timing(1.0, 3.0, forward_min_ms=1.0, forward_backward_min_ms=3.0),
        ),
        run("b", Timing(1.0, 4.0), Timing(1.0, 2.0)),  # a run that kept no fastest call
    ]
    shown = speed_table("peer", records)
    assert shown.rows == (
        ("a", "3.000 (3.000)", "2.000 (1.500)", "1.50x (2.00x)"),
        ("b", "2.000", "4.000", "0.50x (0.50x)"),
    )
    assert shown.header[1] == "peer f+b ms median (min)" and "NVIDIA H200" in str(shown.title)


def test_validate_cost_log_reads_the_last_table_and_needs_provenance(tmp_path):
    from varlen_workbench.workbench.bench.kernel_report import validate_cost_log

    table = [
        "cuda, torch x; ms per forward+backward, median (fastest) of 20 calls",
        "workload            validate=False        True, same metadata   True, new metadata",
        "8x2048 d128         2.000 (1.900) +0.0%   2.100 (1.900) +5.0%   2.200 (2.090) +10.0%",
    ]
    log = tmp_path / "validate.log"
    log.write_text("\n".join(["# H200, commit abc, date: command", *table, "", *table]) + "\n")
    read = validate_cost_log(log)
    assert read.provenance == "H200, commit abc, date: command" and read.text == "\n".join(table)
    costs = read.costs["8x2048 d128"]
    assert costs["True, same metadata"] == pytest.approx((0.05, 0.0)) and costs["True, new metadata"] == pytest.approx((0.1, 0.1))
    assert read.baseline == {"8x2048 d128": (2.0, 1.9)}
    log.write_text("\n".join(table))
    with pytest.raises(ValueError, match="provenance"):
        validate_cost_log(log)
    assert "8x2048 d128 causal" in validate_cost_log().costs  # the committed H200 log


def test_fa4_wrapper_log_reads_the_ratios_drops_warnings_and_needs_provenance(tmp_path):
    from varlen_workbench.workbench.bench.kernel_report import fa4_wrapper_log

    table = [
        "NVIDIA H200, torch x; ms per forward+backward",
        "workload                    FA4 bare  fa4 same md  fa4 new md   triton  bare/wrapped",
        "8x2048 d128                    1.905        1.889       2.210    3.127         1.009",
    ]
    warning = ["/site/dsl.py:2300: UserWarning: Argument aux_data ...", "  exe_args, func_types = ..."]
    log = tmp_path / "wrapper.log"
    log.write_text("\n".join(["# H200, commit abc, date: command", table[0], *warning, *table[1:]]) + "\n")
    read = fa4_wrapper_log(log)
    assert read.provenance == "H200, commit abc, date: command" and read.text == "\n".join(table)
    assert read.ratios == {"8x2048 d128": 1.009}
    log.write_text("\n".join(table))
    with pytest.raises(ValueError, match="provenance"):
        fa4_wrapper_log(log)
    assert "8x2048 d128 causal +TAIL" in fa4_wrapper_log().ratios  # the committed H200 log


def test_our_variants_run_on_the_batchs_metadata_built_once():
    """The timed calls of ours pass a VarlenMetadata built before them (a step's): the same
    outputs as the positional call, and no new metadata per call but where the variant says so."""
    from varlen_workbench.kernels.varlen import varlen_attention
    from varlen_workbench.workbench.bench.kernels import implementations
    from varlen_workbench.workbench.layout import Case, pack

    batch = pack(Case((37, 5), heads=2, head_dim=16, causal=True, tail_q=3, tail_k=3))
    run = implementations()["ours"](batch, (-1, -1))
    assert torch.equal(run(), batch.call(varlen_attention, backend="triton"))
    assert implementations()["ours validate=True"](batch, (-1, -1)) is None  # judged on 8x2048 only
