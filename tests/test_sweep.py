"""Sweeps: grid order, Case axes, failures as records, process parallelism."""

import os

import pytest
from sweep_points import crash, divide

from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.reference import reference_attention
from varlen_workbench.workbench.sweeps import sweep


def test_a_failing_point_is_a_record_not_a_crash():
    result = sweep(divide, numerator=[1, 2], denominator=[0, 4], progress=False)
    assert [(r["numerator"], r["denominator"]) for r in result] == [(1, 0), (1, 4), (2, 0), (2, 4)]
    failed = result.failures
    assert [(r["numerator"], r["error_type"]) for r in failed] == [(1, "ZeroDivisionError"), (2, "ZeroDivisionError")]
    assert "division by zero" in failed[0]["error"]
    assert result.where(numerator=2, denominator=4)[0]["quotient"] == 0.5
    assert "ZeroDivisionError" in result.table()


def test_case_axes_build_cases_and_probe_records_become_rows():
    base = Case(seqlens_q=(5,), heads=1, head_dim=16)
    seen = []

    def point(case, impl):
        seen.append(case)
        return probe(reference_attention, pack(case, device="cpu"), name=impl, reference=False)

    result = sweep(point, base=base, tail_q=[0, 3], seqlens_q=[(5,), (2, 4)], impl=["oracle"], progress=False)
    assert seen[1] == base.with_(seqlens_q=(2, 4))
    assert seen[2].tail_q == 3
    record = result.records[0]
    assert record["impl"] == "oracle" and record["result_impl"] == "oracle"  # collision kept, prefixed
    assert record["nonfinite_tail"] == 0 and record["ok"]


@pytest.mark.slow  # three spawned workers, each importing torch: seconds of CPU for the fast loop
def test_workers_run_in_other_processes_and_survive_a_dying_worker():
    result = sweep(divide, numerator=[3], denominator=[1, 0, 3], workers=2, progress=False)
    assert [r["ok"] for r in result] == [True, False, True]
    assert all(r["pid"] != os.getpid() for r in result if r["ok"])
    assert result.records[2]["quotient"] == 1.0
    died = sweep(crash, code=[0, 3], workers=1, progress=False)
    assert died.records[1]["error_type"] == "BrokenProcessPool"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="at least one axis"):
        sweep(divide)
    with pytest.raises(TypeError, match="axis 'denominator' must be a list"):
        sweep(divide, numerator=[1], denominator=3)
    with pytest.raises(ValueError, match="lambda"):
        sweep(lambda x: x, x=[1], workers=1, progress=False)
    with pytest.raises(ValueError, match="workers"):
        sweep(divide, numerator=[1], denominator=[1], workers=-1)
