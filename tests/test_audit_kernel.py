"""`varlen-workbench audit` on our own Triton kernel, pinned (`varlen_attention_triton`: "auto" on the
CPU is the torch backend): every check holds (the default audit, fuzzer apart)."""

from __future__ import annotations

import pytest

from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.workbench.audit import CHECKS, audit
from varlen_workbench.workbench.malformed import CATALOGUE


@pytest.mark.slow
def test_our_kernel_passes_every_check():
    report = audit(varlen_attention_triton, budget=0)
    assert report.backend == "triton" and "(adapter ours-triton, backend triton," in report.render()
    assert [r.name for r in report.results] == [n for n, c in CHECKS.items() if not c.distributed]
    assert report.passed, report.table()
    assert (
        report.result("input-validation").evidence == f"{len(CATALOGUE)}/{len(CATALOGUE)} clear errors"
        and report.validation == "validates"
    )  # ours declares dtypes and head dims
    assert report.result("sliding-window").verdict.value == "pass"  # ours takes window_size: not n/a
    print(f"\n{report.table()}\n({report.seconds:.0f} s)")
