"""The audit matrix: every path's recorded audit as one grid (rows: implementations, columns: checks).

`load_matrix()` reads data/gpu/audit-<row>.json for each row of `varlen_workbench.workbench.audit.adapters.MATRIX`
(written by scripts/gpu_audit_matrix.py) through `varlen_workbench.workbench.records`, with the row's
compute-sanitizer runs (`varlen_workbench.workbench.audit.sanitizer`); `grid()` gives the verdict of every cell,
`fails()` every FAIL with its evidence, `wrappers()` how each adapter builds its call. What each
FAIL means is `varlen_workbench.workbench.audit.judgements` (data), and the table, text grid and picture are
`varlen_workbench.workbench.audit.render`.

The notebook notebooks/audit-matrix.ipynb is a thin page over these functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from varlen_workbench.workbench.audit.adapters import ADAPTERS, MATRIX
from varlen_workbench.workbench.audit.checks import CHECKS
from varlen_workbench.workbench.audit.fuzz import SHRINK_SECONDS
from varlen_workbench.workbench.audit.isolate import TIMED_OUT
from varlen_workbench.workbench.audit.sanitizer import load_sanitizer, row_summary
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import load_records

# The package whose version names each row (torch's own paths: torch).
ROW_PACKAGE = {
    "ours": None,
    "dmattn-triton": "flash-dmattn",
    "dmattn-triton-nobias": "flash-dmattn",
    "dmattn-flex": "flash-dmattn",
    "fsa-dense-varlen": "flash-sparse-attn",
    "fsa-sparse-varlen": "flash-sparse-attn",
    "fa4": "flash-attn-4",
    "ours-fa4": "flash-attn-4",
    "cudnn-ragged": "nvidia-cudnn-frontend",
    "te": "transformer-engine",
    "te-fp8": "transformer-engine",
}
# The matrix's rows are single-process paths, on which the context-parallel check is n/a by
# construction: it is no column here (its record is data/gpu/context-parallel-*.json).
CORRECTNESS = [name for name, check in CHECKS.items() if name != "input-validation" and not check.distributed]
COLUMNS = [*CORRECTNESS, "fuzzer", "input-validation", "sanitizer"]  # every column a matrix can have
RECORD_COMMAND = "python scripts/gpu_audit_matrix.py"
# A row's fuzzer is done at FUZZ_LAYOUTS layouts, or after FUZZ_SECONDS of fuzzing (the search,
# then SHRINK_SECONDS of shrinking) where one layout takes over SLOW_LAYOUT seconds (flash-dmattn's
# Triton rows compile per shape): 8 minutes, so that a fuzz-only run fits a 10-minute device call.
FUZZ_LAYOUTS, FUZZ_SECONDS, SLOW_LAYOUT = 1000, 480, 0.5
FUZZ_SEARCH = FUZZ_SECONDS - SHRINK_SECONDS


def columns(records: list[dict[str, Any]]) -> list[str]:
    """The matrix's columns: the checks some recorded run ran (a check added after the records
    were made, such as sliding-window, gets its column with the first recording that runs it),
    then the fuzzer, input validation, and compute-sanitizer where some row has runs of it."""
    recorded = {check["name"] for record in records if ran(record) for check in record["checks"]}
    tools = ["sanitizer"] if any(record.get("sanitizer") for record in records) else []
    return [c for c in CORRECTNESS if c in recorded] + ["fuzzer", "input-validation", *tools]


def load_matrix(directory: Path = GPU_DATA) -> list[dict[str, Any]]:
    """The recorded audit of every MATRIX row that has one, in MATRIX order, each with `row`,
    `file`, `adapter` and `sanitizer` ({tool: run} of its compute-sanitizer runs, {} if none)."""
    sanitized = load_sanitizer(directory)
    records = []
    for row, target, adapter in MATRIX:
        for record in load_records(f"audit-{row}.json", directory):
            records.append(
                {
                    **record,
                    "row": row,
                    "target": record.get("target", target),
                    "adapter": adapter or record.get("adapter"),  # None in MATRIX: inferred from the signature
                    "sanitizer": sanitized.get(row, {}),
                }
            )
    if not records:
        raise FileNotFoundError(f"no audit-<row>.json under {directory}; record them on a GPU with `{RECORD_COMMAND}`")
    return records


def ran(record: dict[str, Any]) -> bool:
    return record.get("ran", True) is not False and "checks" in record


def fuzz_budget(record: dict[str, Any]) -> str | None:
    """Which budget the row's fuzzer met: f'{FUZZ_LAYOUTS} layouts', or FUZZ_SECONDS of fuzzing
    where a layout took over SLOW_LAYOUT s: a search that ran FUZZ_SEARCH s (its
    `search_seconds`; a record of a search cut before then, `partial`, falls short); None when
    neither (or it did not run)."""
    fuzzed = record.get("fuzz") if ran(record) else None
    if not fuzzed:
        return None
    if fuzzed["tried"] >= FUZZ_LAYOUTS:
        return f"{FUZZ_LAYOUTS} layouts"
    per_layout = layout_seconds(fuzzed)
    if fuzzed.get("search_seconds", 0) >= FUZZ_SEARCH and per_layout > SLOW_LAYOUT:
        return f"{FUZZ_SECONDS} s of fuzzing ({FUZZ_SEARCH} s search, then shrinking; {per_layout:.1f} s a layout)"
    return None


def layout_seconds(fuzzed: dict[str, Any]) -> float:
    """Seconds one layout took in one of the search's processes: its time x its workers / layouts
    tried (a record from before `search_seconds` and `workers`: the fuzzer's whole time, one)."""
    return fuzzed.get("search_seconds", fuzzed["seconds"]) * fuzzed.get("workers", 1) / max(fuzzed["tried"], 1)


def left_out(record: dict[str, Any], column: str) -> bool:
    """A "not run" cell that another run could fill (one that ran past its time limit is an answer,
    and a check that joined the audit after the run is no gap of it: `--recheck` records one)."""
    verdict, evidence = cell(record, column)
    return verdict == "not run" and TIMED_OUT not in evidence and not _after_the_run(record, column)


def _after_the_run(record: dict[str, Any], column: str) -> bool:
    """Whether check `column` joined the audit after the run that wrote `record` (and is not in it)."""
    added = CHECKS[column].added if column in CHECKS else ""
    recorded = str(record.get("provenance", {}).get("date", ""))[:10]
    return bool(added and recorded) and recorded < added and all(c["name"] != column for c in record.get("checks", []))


def complete(record: dict[str, Any]) -> bool:
    """Whether a row's record is whole: it ran, no cell is left "not run" (but for a check past its
    time limit), and the fuzzer met its budget or had nothing to fuzz (scripts/gpu_audit_matrix.py
    records it again only when forced)."""
    if not ran(record) or any(left_out(record, c) for c in [*CORRECTNESS, "fuzzer"]):
        return False
    return cell(record, "fuzzer")[0] == "n/a" or fuzz_budget(record) is not None


def implementation(record: dict[str, Any]) -> str:
    """'flash-dmattn 1.2.2: flash_dmattn.flash_dmattn_triton:triton_dmattn_func (adapter dmattn)'."""
    package = ROW_PACKAGE.get(record["row"], "torch")
    versions = record.get("versions", {})
    if package is None:
        named = f"ours @ {record['provenance'].get('commit', '?')}"
        if record.get("backend"):  # records from before the registry (2026-12) ran the Triton kernel
            named += f", backend {record['backend']}"
    else:
        named = f"{package} {versions.get(package, record['provenance'].get(package, '?'))}"
    return f"{record['row']} ({named})"


def cell(record: dict[str, Any], column: str) -> tuple[str, str]:
    """(verdict, evidence) of one cell."""
    if column == "sanitizer":  # its own runs, whether the audit ran or not
        verdict, evidence, _ = row_summary(record.get("sanitizer") or {})
        return verdict, evidence
    if not ran(record):
        return "not run", "; ".join(record.get("output", [])[-2:]) or "not recorded"
    if column == "fuzzer":
        fuzzed = record.get("fuzz")
        if not fuzzed:
            # A checks-only run (--budget 0) of a path that can run leaves the fuzzer to another run.
            if record.get("budget") == 0 and any(c["verdict"] != "n/a" for c in record["checks"]):
                return "not run", "fuzzing not asked (--budget 0)"
            lost = next((c["evidence"] for c in record["checks"] if c["evidence"].startswith("not run:")), None)
            if lost or any("misaligned address" in c["evidence"] or "illegal memory" in c["evidence"] for c in record["checks"]):
                return "not run", lost or "a CUDA fault lost the context before the fuzzer"
            return "n/a", "the fuzzer did not run (nothing applicable)"
        found = sorted({f["check"] for f in fuzzed["failures"]})
        summary = f"{fuzzed['tried']} layouts, {fuzzed['failing_layouts']} failing" + (f": {', '.join(found)}" if found else "")
        return ("FAIL" if found else "pass"), summary
    for check in record["checks"]:
        if check["name"] == column or (column == "input-validation" and check["name"] == "bad-input"):
            if check["evidence"].startswith("not run:"):  # after a sticky CUDA fault
                return "not run", check["evidence"]
            return check["verdict"], check["evidence"]
    return "not run", "this check was not in the recorded run"


def grid(records: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """{row: {column: verdict}}."""
    shown = columns(records)
    return {r["row"]: {c: cell(r, c)[0] for c in shown} for r in records}


def fails(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Every FAIL: (row, check or 'fuzz:<check>', evidence), fuzzer failures one by one."""
    out = []
    for record in records:
        if not ran(record):
            continue
        for check in record["checks"]:
            if check["verdict"] == "FAIL":
                out.append((record["row"], check["name"], check["evidence"]))
        for failure in (record.get("fuzz") or {}).get("failures", []):
            out.append((record["row"], f"fuzz:{failure['check']}", failure["evidence"]))
    return out


def wrappers(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(row, adapter, what the adapter decides: its docstring) for each row."""
    out = []
    for record in records:
        adapter = ADAPTERS.get(record["adapter"])
        doc = " ".join((adapter.wrap.__doc__ or adapter.doc or "").split()) if adapter else "adapter not registered"
        out.append((record["row"], record["adapter"], doc))
    return out
