"""`varlen-workbench audit --notebook`: the written notebook executes, builds into the site and passes nbval."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest

from varlen_workbench.workbench.audit import adapt, audit
from varlen_workbench.workbench.audit.fuzz import run_layout
from varlen_workbench.workbench.audit.notebook import audit_claims, reproductions
from varlen_workbench.workbench.site.build import build

ROOT = Path(__file__).resolve().parents[1]
TAIL_BUG = '''import torch
from varlen_workbench.workbench.reference import reference_attention


def attention(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, causal=False, scale=None):
    """torch varlen_attn's mechanism: rows past the layout's end come from torch.empty."""
    out = reference_attention(q, k, v, cu_q, cu_k, max_q, max_k, cu_seqlens_q_padded=cu_seqlens_q_padded,
                              cu_seqlens_k_padded=cu_seqlens_k_padded, causal=causal, scale=scale).to(q.dtype)
    end = int((cu_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded)[-1])
    return torch.cat([out[:end], torch.empty_like(out[end:])])
'''
CHECKS = ["tail-rows", "gap-rows", "input-validation"]


def _output(nb) -> str:
    return "".join(
        o.get("text", "") + o.get("data", {}).get("text/plain", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )


@pytest.mark.slow
def test_audit_notebook_executes_builds_and_passes_nbval(project, tmp_path):
    module = f"auditee_{uuid.uuid4().hex[:8]}"
    (project.root / f"{module}.py").write_text(TAIL_BUG)
    report = audit(f"{module}:attention", "contract", budget=6, checks=CHECKS, seed=3)
    assert report.failed == ["tail-rows", "fuzz:tail-rows"]
    path = report.write_notebook(project.notebooks_dir / "audit-tail.ipynb", root=project.root)

    nb = nbformat.read(path, as_version=4)
    printed = _output(nb)
    for line in (
        r"HOLDS\s+upstream CPU\s+check tail-rows: FAIL",
        r"HOLDS\s+upstream CPU\s+check gap-rows: pass",
        r"HOLDS\s+upstream CPU\s+case 'fuzz tail-rows' still fails tail-rows",
    ):
        assert re.search(line, printed), printed
    assert sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", [])) == 2  # one plot per case
    assert nb.cells[-1].source.startswith("# NBVAL_CHECK_OUTPUT")

    pages = build(project, out=tmp_path / "site", execute_notebooks=False, log=lambda _: None)
    assert [p.file for p in pages] == ["audit-tail.html"] and (tmp_path / "site" / "audit-tail.html").exists()

    nbval = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--nbval-lax",
            "--nbval-current-env",
            "--nbval-sanitize-with",
            str(ROOT / "tests" / "nbval-sanitize.cfg"),
            str(path),
        ],
        cwd=project.root,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(project.root), str(ROOT)])},
        capture_output=True,
        text=True,
    )
    assert nbval.returncode == 0, nbval.stdout[-3000:]


def test_claims_stop_holding_when_the_implementation_is_fixed():
    from varlen_workbench.workbench.reference import reference_attention

    broken = audit("test_audit:tail_unwritten", "contract", budget=0, checks=["tail-rows"])
    repros = reproductions(broken)
    claims = audit_claims(broken.verdicts(), {label: finding for label, finding, _, _ in repros})
    fixed = audit(reference_attention, "contract", budget=0, checks=["tail-rows"])
    impl = adapt(reference_attention)
    found = {label: run_layout(impl, case) for label, _, case, _ in repros}
    verdicts = claims.check({"report": fixed, "reproductions": found})
    assert [(v.claim, v.holds, v.evidence) for v in verdicts] == [
        ("check tail-rows: FAIL", False, "now pass"),
        ("case 'tail-rows' still fails tail-rows", False, "no longer fails"),
    ]


def test_every_check_declares_what_its_failing_case_replays():
    """`finding` is required where a check is declared: the notebook replays a failing case by it."""
    from varlen_workbench.workbench.audit.checks import ANY_FINDING, CHECKS, LAYOUT_FINDINGS, check

    assert {name: c.finding in (*LAYOUT_FINDINGS, ANY_FINDING, None) for name, c in CHECKS.items()} == dict.fromkeys(CHECKS, True)
    with pytest.raises(TypeError, match="finding"):
        check("undeclared", "a check that says nothing of its failing case")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"check 'misdeclared': finding = 'gap'; pass one of"):
        check("misdeclared", "a check naming no finding of layout_findings", finding="gap")
    assert "undeclared" not in CHECKS and "misdeclared" not in CHECKS
