"""`backend="auto"`'s rule (kernels/varlen/backends.py) against the committed benchmark record: on
every workload where both backends ran, the one the rule picks is within 3% of the faster one,
judged on the medians, or on the fastest calls where the workload's own spread (a backend's
median over its fastest call) exceeds 3%."""

from __future__ import annotations

import pytest

from varlen_workbench.kernels.varlen.backends import fa4_is_faster_for
from varlen_workbench.workbench.bench import GUARDED_FA4, RECORD_COMMAND
from varlen_workbench.workbench.records import load_records
from varlen_workbench.workbench.workloads import workloads

TOLERANCE = 0.03


def _pairs() -> dict[str, tuple[dict, dict]]:
    """workload name -> (the Triton kernel's row, the guarded FA4 path's row), across the records."""
    rows: dict[str, dict[str, dict]] = {}
    for record in load_records("bench-h200*.json", how=RECORD_COMMAND):
        for row in record["rows"]:
            if row.get("forward_backward_ms") is not None:
                rows.setdefault(row["workload"], {})[row["impl"]] = row
    return {name: (impls["ours"], impls[GUARDED_FA4]) for name, impls in rows.items() if "ours" in impls and GUARDED_FA4 in impls}


def _picks_fa4(name: str) -> bool:
    (workload,) = [w for w in workloads() if w.name == name]
    case = workload.case
    real = case.real_lengths("q")
    gaps = any(p != r for side in "qk" for p, r in zip(case.padded_lengths(side), case.real_lengths(side)))
    return fa4_is_faster_for(case.heads // (case.kv_heads or case.heads), max(real), sum(real) / len(real), gaps)


PAIRS = _pairs()


def test_the_record_has_the_workloads_the_rule_was_read_from():
    assert len(PAIRS) >= 16, sorted(PAIRS)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_the_rule_picks_within_3_percent_of_the_faster_backend(name):
    triton, fa4 = PAIRS[name]
    spread = max(row["forward_backward_ms"] / row["forward_backward_min_ms"] - 1 for row in (triton, fa4))
    key = "forward_backward_min_ms" if spread > TOLERANCE else "forward_backward_ms"
    picked, other = (fa4, triton) if _picks_fa4(name) else (triton, fa4)
    assert picked[key] <= (1 + TOLERANCE) * other[key], (name, key, picked["impl"], picked[key], other[key])
