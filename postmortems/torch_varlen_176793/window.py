"""The fuzzer's REAL-row failure of varlen_attn, read from the audit matrix's record and explained here.

Not this page's TAIL mechanism: the audit matrix's varlen_attn record (data/gpu/audit-torch-varlen.json)
holds a fuzzer failure of real-accuracy whose shrunk layout has no padding at all. Its judgement
(data/audit/judgements.toml, mechanism fa2-window-bound-clamp) is FlashAttention-2's reset of a
window bound >= max_seqlen_k to -1 (unbounded), exact only when no sequence has more queries than
keys. Everything below is read from the record and the judgement, then checked on the CPU: the reset
alone, applied to the fp64 oracle on the recorded layout, moves the rows the window leaves keyless
off their answer 0, and our kernel (which never resets a bound) holds the bound there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from varlen_workbench.workbench.audit import adapt
from varlen_workbench.workbench.audit.fuzz import probe_layout
from varlen_workbench.workbench.audit.judgements import Judgement, judgements
from varlen_workbench.workbench.audit.records import fuzz_failure, load_audit_records
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.reference import reference_attention, visible_keys

AUDIT = "audit-torch-varlen.json"  # the audit matrix's run of varlen_attn
ROW, CHECK = "torch-varlen", "real-accuracy"  # its matrix row, and the fuzzer's check that failed on REAL rows


@dataclass(frozen=True)
class WindowFinding:
    """The recorded failure, its judgement, and what the CPU shows of its mechanism."""

    evidence: str  # the record's, as the H200 run wrote it
    case: Case  # the fuzzer's shrunk layout, from the record
    provenance: dict[str, Any]  # the record's (device, torch, date)
    judgement: Judgement | None  # data/audit/judgements.toml's for (ROW, 'fuzz:' + CHECK)
    padding_rows: int  # GAP and TAIL rows of q and k in the layout
    max_seqlen_q: int
    max_seqlen_k: int
    keyless_rows: int  # REAL query rows that see no key under the contract, with the window as given
    reset_applies: bool  # the window's right bound >= max_seqlen_k and some sequence has more queries than keys
    reset_error: float  # fp64 oracle: max |out(right bound reset to -1) - out(window as given)| on those rows
    ours: str  # our Triton kernel on the layout (CPU, interpreted): "within bound" or its findings

    @property
    def recorded_out_error(self) -> float | None:
        """The out error the H200 record states ('out: error 2.73 > bound ...'), None if it states none."""
        found = re.search(r"\bout: error ([0-9.eE+-]+) > bound", self.evidence)
        return float(found[1]) if found else None


def _keyless_rows(case: Case) -> int:
    lengths_k = case.seqlens_k or case.seqlens_q
    return sum(
        int((~visible_keys(q, k, case.window).any(1)).sum()) if k else q for q, k in zip(case.seqlens_q, lengths_k, strict=True)
    )


@cache
def window_finding() -> WindowFinding | None:
    """The fuzzer's real-accuracy failure of varlen_attn in the audit matrix's record (None without one)."""
    records = {record["file"]: record for record in load_audit_records()}
    record = records.get(AUDIT)
    if record is None or not record.get("fuzz"):
        return None
    try:
        failure = fuzz_failure(record, CHECK)
    except KeyError:
        return None
    case = Case(**failure["case"])
    batch = pack(case, "cpu")
    left, right = case.window
    lengths_k = case.seqlens_k or case.seqlens_q
    reset_applies = right >= batch.max_seqlen_k and any(q > k for q, k in zip(case.seqlens_q, lengths_k, strict=True))
    args = (batch.q, batch.k, batch.v, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k)
    with torch.no_grad():
        given = reference_attention(*args, causal=case.causal, window_size=case.window)
        reset = reference_attention(*args, causal=case.causal, window_size=(left, -1))
    _, findings = probe_layout(adapt("varlen_workbench.kernels.varlen:varlen_attention_triton", adapter="ours-triton"), case)
    return WindowFinding(
        evidence=failure["evidence"],
        case=case,
        provenance={k: record["provenance"][k] for k in ("device", "torch", "date")},
        judgement=judgements().get((ROW, f"fuzz:{CHECK}")),
        padding_rows=case.total_rows("q") - sum(case.seqlens_q) + case.total_rows("k") - sum(lengths_k),
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_k=batch.max_seqlen_k,
        keyless_rows=_keyless_rows(case),
        reset_applies=reset_applies,
        reset_error=float((reset - given).abs().max()),
        ours="; ".join(f"{f.check}: {f.evidence}" for f in findings) or "within bound",
    )


def window_finding_markdown(found: WindowFinding | None) -> str:
    """The finding as the page shows it: the record's words, the layout, the judgement and its links."""
    if found is None:
        return "The audit matrix's record of varlen_attn holds no fuzzer failure of real-accuracy."
    j = found.judgement
    lines = [
        f"* **Recorded** ({found.provenance['device']}, torch {found.provenance['torch']}, {found.provenance['date']}, "
        f"`data/gpu/{AUDIT}`): fuzzer, {CHECK}: {found.evidence}.",
        f"* **Layout** (shrunk by the fuzzer): {found.case.label()}; {found.padding_rows} padding rows, so it is not "
        "this page's TAIL mechanism.",
        f"* **Read here, on the CPU:** max_seqlen_q {found.max_seqlen_q}, max_seqlen_k {found.max_seqlen_k}; under the "
        f"contract (bottom-right aligned window {found.case.window}) {found.keyless_rows} REAL query rows see no key and "
        f"must be 0. Resetting the window's right bound to -1, as FlashAttention-2 does when it is >= max_seqlen_k, "
        f"moves the fp64 oracle's output by up to {found.reset_error:.3g} on this layout. Our kernel: {found.ours}.",
    ]
    if j is None:
        lines.append("* **Judgement:** none yet (data/audit/judgements.toml).")
    else:
        lines.append(f"* **Judgement** ({j.kind}, `{j.mechanism}`): {j.text}.")
        lines += [f"* **Upstream:** [{url.split('github.com/')[-1]}]({url}): {says}" for url, says in j.links]
    return "\n".join(lines)


__all__ = ["AUDIT", "WindowFinding", "window_finding", "window_finding_markdown"]
