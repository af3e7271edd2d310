"""The tables of fa4-unwritten-padding."""

from __future__ import annotations

from varlen_workbench.postmortems.fa4_unwritten_padding.cases import META, ROW
from varlen_workbench.postmortems.fa4_unwritten_padding.study import Fa4PaddingResults
from varlen_workbench.workbench.audit.summary import fails_markdown
from varlen_workbench.workbench.postmortem import table


def recorded_checks(results: Fa4PaddingResults) -> dict[str, dict]:
    """The audit record's checks by name."""
    return {c["name"]: c for c in results.audit["checks"]}


def audit_summary(results: Fa4PaddingResults) -> str:
    """Markdown: every FAIL of the H200 audit record, grouped by the mechanism it is judged to be
    (data/audit/judgements.toml, the audit matrix's row `fa4`), then the checks that pass."""
    return fails_markdown(results.audit, ROW, META.id)


def audit_table(results: Fa4PaddingResults):
    """The H200 audit of FA4: every check of the record, FAILs first, then the fuzzer's failures."""
    checks = sorted(results.audit["checks"], key=lambda c: c["verdict"] != "FAIL")
    fuzzed = [(f"fuzzer: {f['check']}", "FAIL", f["evidence"]) for f in (results.audit.get("fuzz") or {}).get("failures", [])]
    return table(("check", "verdict", "evidence (H200)"), [(c["name"], c["verdict"], c["evidence"]) for c in checks] + fuzzed)


def layer_norm_table(results: Fa4PaddingResults):
    """The real training step: loss, non-finite gradient entries and gradient norm per layer, per backend and memory."""
    record = results.real_client
    rows = [("float32 per-document SDPA (the reference)", "-", record["reference_loss"], 0, *record["reference_norms"])]
    rows += [(r["backend"], r["memory"], r["loss"], r["nonfinite"], *r["layer_norms"]) for r in record["runs"]]
    layers = len(record["reference_norms"])
    return table(("backend", "memory", "loss", "non-finite grads", *(f"|grad| layer {i}" for i in range(layers))), rows)


def probe_table(results: Fa4PaddingResults):
    """The CPU replica, memory NaN-poisoned: bare, and with the workaround."""
    probes = [*results.replica.items(), *results.workaround.items()]
    return table(
        (
            "implementation",
            "case",
            "padding holds",
            "non-finite REAL",
            "non-finite TAIL",
            "padding exactly 0",
            "REAL within bound",
        ),
        [
            (
                p.impl,
                case.label(),
                case.fill.value,
                p.nonfinite_in("REAL"),
                p.nonfinite_in("TAIL"),
                p.padding_exactly_zero,
                p.real_within_bound,
            )
            for case, p in probes
        ],
    )
