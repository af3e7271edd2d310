"""The benchmark's accounting (the timing itself needs CUDA and runs on the GPU machine)."""
from __future__ import annotations

import pytest
import torch

from workbench.bench import Row, Timing, Workload, format_table, long_tailed_lengths, run_benchmark, workloads
from workbench.layout import Case


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
    names = [w.name for w in workloads()]
    assert sum(n.startswith("8x2048") for n in names) == 4
    padded = next(w for w in workloads() if "padded" in w.name)
    assert padded.case.tail_q and padded.case.align


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
