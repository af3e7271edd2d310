"""`varlen-workbench audit --notebook PATH`: a post-mortem notebook started from an audit.

The notebook is thin, like every notebook of the workbench: it re-runs the audit's checks,
reproduces each failing case (the failing checks' cases and the fuzzer's smallest layouts)
with a per-token norm plot, and ends with a claims cell (`varlen_workbench.workbench.postmortem.Claims`) whose
verdict table nbval compares exactly: "check X: FAIL", "case N still fails tail-rows". When the
implementation is fixed the claims stop holding and CI says so: update the notebook then.

Cells are written in the percent format of `varlen-workbench new`'s template and parsed by
`varlen_workbench.workbench.cli.scaffold.parse_cells`; the notebook is executed in place, as `varlen-workbench new` does.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import nbformat

from varlen_workbench.workbench.audit.checks import ANY_FINDING, CHECKS, Finding
from varlen_workbench.workbench.audit.fuzz import case_source
from varlen_workbench.workbench.cli.scaffold import parse_cells
from varlen_workbench.workbench.postmortem import OURS, UPSTREAM_CPU, UPSTREAM_GPU, Claims, Evidence


def reproductions(report) -> list[tuple[str, str | None, Any, str]]:
    """(label, finding to expect, case, where it came from) for each failing case of `report`;
    a finding of None means any finding."""
    out = []
    for result in report.results:
        finding = CHECKS[result.name].finding  # what a probe of its failing case shows (None: no probe replays it)
        if result.verdict.value == "FAIL" and finding is not None and result.cases:
            expected = None if finding == ANY_FINDING else finding
            out.append((result.name, expected, result.cases[0], f"The failing case of check `{result.name}`"))
    for failure in report.fuzz.failures if report.fuzz else []:
        out.append(
            (
                f"fuzz {failure.check}",
                failure.check,
                failure.case,
                f"The fuzzer's smallest layout failing `{failure.check}` ({failure.shrink_probes} shrink probes)",
            )
        )
    return out


def evidence_of(impl) -> Evidence:
    """The evidence level of an audit of `impl`: our kernel, or the audited code itself run on
    the GPU or on the CPU (through the Triton interpreter, or PyTorch's own CPU kernels)."""
    if impl.adapter.name == "ours":
        return OURS
    return UPSTREAM_GPU if impl.device.type == "cuda" else UPSTREAM_CPU


def audit_claims(expected: dict[str, str], expected_findings: dict[str, str | None], evidence: Evidence = UPSTREAM_CPU) -> Claims:
    """Claims that the audit still says what it said: every check's verdict, and every
    reproduction still failing. Results: {"report": AuditReport, "reproductions": {label: findings}}.
    `evidence`: what ran (see `evidence_of`)."""
    claims = Claims()
    for name, verdict in expected.items():

        def same_verdict(results, name=name, verdict=verdict):
            now = results["report"].verdicts().get(name)
            return now == verdict, "" if now == verdict else f"now {now}"

        claims(f"check {name}: {verdict}", evidence=evidence)(same_verdict)
    for label, finding in expected_findings.items():

        def still_fails(results, label=label, finding=finding):
            found: list[Finding] = results["reproductions"][label]
            hit = [f.check for f in found if finding is None or f.check == finding]
            return bool(hit), ", ".join(sorted(set(hit))) or "no longer fails"

        claims(f"case {label!r} still fails {finding or 'a check'}", evidence=evidence)(still_fails)
    return claims


def _markdown(text: str) -> str:
    return "# %% [markdown]\n" + text.strip("\n")


def _code(text: str, alt: str = "") -> str:
    """A code cell; `alt`: what its figure shows (the site's alt text: a figure without one is refused)."""
    return ("# %%" + (f" alt={alt}" if alt else "") + "\n") + text.strip("\n")


def notebook_source(report, *, today: str | None = None) -> str:
    """The notebook in percent format."""
    today = today or datetime.date.today().isoformat()
    failing = ", ".join(f"`{n}`" for n in report.failed)
    verdict = f"It fails {failing}." if failing else "Every applicable check holds."
    checks = [r.name for r in report.results]
    cells = [
        _markdown(f"""
# Audit of `{report.target}`

Written by `varlen-workbench audit --notebook` on {today}: the implementation behind adapter `{report.adapter}`,
on {report.device}, checked against the padding contract (docs/contract.md). {verdict}

The sections below re-run the audit and reproduce every failing case; the claims at the end are
re-checked whenever this notebook runs (nbval in CI), so it stays true or fails loudly.
"""),
        _code(f"""
from varlen_workbench.workbench.layout import Case, Fill
from varlen_workbench.workbench.plots import plot_token_norms
from varlen_workbench.workbench.audit import adapt, audit
from varlen_workbench.workbench.audit.fuzz import probe_layout
from varlen_workbench.workbench.audit.notebook import audit_claims, evidence_of

impl = adapt({report.target!r}, adapter={report.adapter!r}, device={report.device!r})
report = audit(impl, dtype={report.dtype!r}, budget=0, checks={checks!r})
print(report.table())
found = {{}}
"""),
    ]
    if any(r.rows for r in report.results):
        cells += [
            _markdown(
                "## Input validation\n\nEvery malformed call of `varlen_workbench.workbench.malformed`, and what the implementation did with "
                "it (graded apart from correctness: `varlen_workbench.workbench.audit.campaign` defines clear error, vague error and crash)."
            ),
            _code("print(report.campaign_table())"),
        ]
    repros = reproductions(report)
    if repros:
        cells.append(
            _markdown(
                "## Failing cases\n\nEach case is probed forward and backward under NaN-poisoned memory and compared with the "
                "fp64 oracle; the plot shows per-row norms of out, dq, dk, dv with GAP and TAIL rows shaded."
            )
        )
    for i, (label, _, case, origin) in enumerate(repros, 1):
        cells += [
            _markdown(f"### {i}. {label}\n\n{origin}: `{case.label()}`, padding filled with {case.fill.value}."),
            _code(
                f"""
case = {case_source(case)}
record, found[{label!r}] = probe_layout(impl, case)
print(*found[{label!r}], sep="\\n")
plot_token_norms(record) if record is not None else None
""",
                alt=f"Per-row norms of out, dq, dk and dv for the failing case {label}, GAP and TAIL rows shaded.",
            ),
        ]
    expected = report.verdicts()
    findings = {label: finding for label, finding, _, _ in repros}
    cells += [
        _markdown("## Claims\n\nWhat the audit found, checked again on the results above. CI compares the table exactly."),
        _code(f"""
# NBVAL_CHECK_OUTPUT
claims = audit_claims({expected!r}, {findings!r}, evidence_of(impl))
verdicts = claims.report({{"report": report, "reproductions": found}})
"""),
    ]
    return "\n".join(cells) + "\n"


def write_notebook(report, path: str | Path, *, execute: bool = True, root: str | Path | None = None) -> Path:
    """Writes the notebook of `report` to `path` (refusing to overwrite) and executes it in
    place, with `root` (default: the working directory) first on the kernel's import path."""
    from varlen_workbench.workbench.site.execute import execute_in_place

    path = Path(path)
    if path.suffix != ".ipynb":
        raise ValueError(f"notebook path {str(path)!r} must end in .ipynb.")
    if path.exists():
        raise ValueError(f"{path} already exists; pick another --notebook path.")
    nb = nbformat.v4.new_notebook()
    nb.cells = parse_cells(notebook_source(report))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # deterministic ids, as `varlen-workbench new` writes them
        cell.id = f"cell-{i}"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    if execute:
        execute_in_place(path, Path(root) if root is not None else Path.cwd())
    return path
