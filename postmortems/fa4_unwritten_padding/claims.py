"""The claims of fa4-unwritten-padding, on the H200 records and the CPU replica."""

from __future__ import annotations

import inspect
import math
import re

from varlen_workbench.kernels.replicas import torch_varlen
from varlen_workbench.postmortems.fa4_unwritten_padding.cases import (
    CHECKS,
    FA4_SOURCE,
    FUZZ_CHECKS,
    NAN_PADDING,
    ROW,
    TAIL,
    TAIL_NAN,
    UPSTREAM_ALLOCATIONS,
)
from varlen_workbench.postmortems.fa4_unwritten_padding.figures import recorded_checks
from varlen_workbench.postmortems.fa4_unwritten_padding.study import Fa4PaddingResults
from varlen_workbench.workbench.audit.regrade import padding_only
from varlen_workbench.workbench.audit.summary import record_fails
from varlen_workbench.workbench.postmortem import REPLICA, UPSTREAM_GPU, Claims, source_at

claims = Claims()

FA4 = "FlashAttention-4 varlen"
_COUNT = re.compile(r"(out|dq|dk|dv): (\d+) non-finite values in \d+ (REAL|GAP|TAIL) rows")


def _regions(evidence: str) -> dict[str, set[str]]:
    """{region: the tensors the evidence string names non-finite there}."""
    found: dict[str, set[str]] = {}
    for tensor, _, region in _COUNT.findall(evidence):
        found.setdefault(region, set()).add(tensor)
    return found


@claims(
    "On the H200 (flash-attn-4 4.0.0b36, bf16), FA4 fails tail-rows, gap-rows, no-real-query and sliding-window, and "
    "the fuzzer's tail-rows and gap-rows, only through padding rows: out, dq, dk and dv are non-finite on TAIL and GAP "
    "rows, never on REAL rows. Its two other FAILs, padding-leak and the fuzzer's real-accuracy, reach REAL rows only "
    "with NaN planted in the padding (0 x NaN, another mechanism); every other check passes",
    evidence=UPSTREAM_GPU,
    headline=True,
)
def _audit(r: Fa4PaddingResults):
    checks = recorded_checks(r)
    parts, ok = [], True
    for name, regions in CHECKS.items():
        found = _regions(checks[name]["evidence"])
        ok &= checks[name]["verdict"] == "FAIL" and set(found) == set(regions) and padding_only(checks[name]["evidence"])
        ok &= all(found[region] == {"out", "dq", "dk", "dv"} for region in regions)
        parts.append(f"{name}: {checks[name]['verdict']} ({', '.join(sorted(found))})")
    fails = {check: (evidence, judgement) for check, evidence, judgement in record_fails(r.audit, ROW)}
    ok &= set(fails) == {*CHECKS, *FUZZ_CHECKS, *NAN_PADDING}
    ok &= all(padding_only(fails[c][0]) for c in FUZZ_CHECKS if c in fails)
    nan = [c for c in NAN_PADDING if c in fails and (j := fails[c][1]) is not None and j.nan_padding and "REAL" in fails[c][0]]
    passing = [c["name"] for c in r.audit["checks"] if c["verdict"] == "pass"]
    other = [c["name"] for c in r.audit["checks"] if c["verdict"] not in ("pass", "FAIL") and c["name"] != "input-validation"]
    ok &= nan == list(NAN_PADDING) and not other and "H200" in r.audit["provenance"]["device"]
    return ok, (
        f"{'; '.join(parts)}; fuzzer: {', '.join(c for c in FUZZ_CHECKS if c in fails)}; REAL rows with NaN padding: "
        f"{', '.join(nan)}; FAILs in the record {len(fails)}; passed {len(passing)} ({r.audit['provenance']['date']})"
    )


@claims(
    "In a real transformers training step on the H200 (a 4-layer Llama, a packed batch with 256 TAIL rows), FA4 "
    "gives a finite loss within 0.01% of the float32 reference but tens of millions of non-finite gradient entries "
    "with memory as is, and a NaN loss with NaN-poisoned memory; bf16 per-document SDPA gives none",
    evidence=UPSTREAM_GPU,
)
def _training_step(r: Fa4PaddingResults):
    runs = {(x["backend"], x["memory"]): x for x in r.real_client["runs"]}
    as_is, poisoned = runs[FA4, "as is"], runs[FA4, "poisoned"]
    bar = [x for (backend, _), x in runs.items() if backend.startswith("per-document SDPA")]
    reference = r.real_client["reference_loss"]
    ok = math.isfinite(as_is["loss"]) and abs(as_is["loss"] - reference) < 1e-4 * reference and as_is["nonfinite"] > 10**7
    ok &= math.isnan(poisoned["loss"]) and bool(bar) and all(x["nonfinite"] == 0 for x in bar)
    return ok, (
        f"memory as is: loss {as_is['loss']:.6f} (reference {reference:.6f}), {as_is['nonfinite']:,} non-finite "
        f"gradient entries; poisoned: loss {poisoned['loss']}, {poisoned['nonfinite']:,}; bf16 SDPA: "
        f"{', '.join(str(x['nonfinite']) for x in bar)} ({r.real_client['provenance']['date']})"
    )


@claims(
    "With memory as is, the layers' gradient norms show it where the loss does not: NaN for some layers and, for the "
    "others, thousands of times the reference's norm",
    evidence=UPSTREAM_GPU,
)
def _norms(r: Fa4PaddingResults):
    run = next(x for x in r.real_client["runs"] if x["backend"] == FA4 and x["memory"] == "as is")
    ratios = [n / ref for n, ref in zip(run["layer_norms"], r.real_client["reference_norms"], strict=True)]
    finite = [x for x in ratios if math.isfinite(x)]
    ok = any(math.isnan(x) for x in ratios) and bool(finite) and min(finite) > 1000
    return ok, "per layer, |grad| / reference: " + ", ".join("NaN" if math.isnan(x) else f"{x:,.0f}x" for x in ratios)


@claims(
    "Upstream source (the 4.0.0b36 wheel that ran on the H200, and the repository at tag fa4-v4.0.0.beta27): "
    "out comes from torch.empty and dq, dk, dv from torch.empty_like, "
    "zeroed only when q or k has no row at all; the replica studied here allocates the four the same way",
    evidence=source_at(FA4_SOURCE),
)
def _source(r: Fa4PaddingResults):
    code = inspect.getsource(torch_varlen)
    same = "out = _uninitialised_like(q)" in code and "dq, dk, dv = _uninitialised_like(q), _uninitialised_like(k)" in code
    same &= "torch.empty_like(t)" in inspect.getsource(torch_varlen._uninitialised_like)
    return same, "upstream: " + "; ".join(UPSTREAM_ALLOCATIONS.values()) + f"; replica the same: {same}"


@claims(
    "The mechanism on the CPU: the replica (out, dq, dk, dv from torch.empty, only rows inside a sequence written), "
    "called as FA4 is, under NaN-poisoned memory leaves every TAIL row of out, dq, dk and dv non-finite and REAL rows "
    "right",
    evidence=REPLICA,
)
def _replica(r: Fa4PaddingResults):
    p = r.replica[TAIL]
    tail = {t: p.nonfinite[t]["TAIL"] for t in ("out", "dq", "dk", "dv")}
    rows = {"out": TAIL.tail_q, "dq": TAIL.tail_q, "dk": TAIL.tail_k, "dv": TAIL.tail_k}
    full = all(tail[t] == rows[t] * TAIL.heads * TAIL.head_dim for t in tail)
    ok = full and p.nonfinite_in("REAL") == 0 and p.real_within_bound
    return (
        ok,
        f"{TAIL.label()}: non-finite TAIL values {tail} (every value of those rows: {full}); REAL within the bound: {p.real_within_bound}",
    )


@claims(
    "The workaround (padding rows of q, k, v zeroed with torch.where before the call, of out after it) makes every "
    "padding row of out, dq, dk and dv exactly 0 under poisoned memory, with garbage or NaN in the padding, and keeps "
    "REAL rows within the bound",
    evidence=REPLICA,
)
def _workaround(r: Fa4PaddingResults):
    probes = [r.workaround[c] for c in (TAIL, TAIL_NAN)]
    ok = all(p.padding_exactly_zero and p.real_within_bound and p.nonfinite_in("REAL") == 0 for p in probes)
    return ok, "; ".join(
        f"{p.case.fill.value} padding: padding exactly 0 {p.padding_exactly_zero}, REAL within bound {p.real_within_bound}"
        for p in probes
    )
