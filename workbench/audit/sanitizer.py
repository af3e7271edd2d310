"""compute-sanitizer as an instrument of the audit matrix: its text output parsed into one record per row.

scripts/gpu_audit_matrix.py runs each row's forward + backward (scripts/audit_sanitize.py)
under `compute-sanitizer --tool initcheck`, `memcheck`, and `racecheck` where the row's
kernels accumulate with atomics, and `parse` reads each log:

    ========= COMPUTE-SANITIZER
    ========= Uninitialized __global__ memory read of size 16 bytes
    =========     at void at::native::vectorized_gather_kernel<...>(...)+0x400
    =========     by thread (0,0,0) in block (8,0,0)
    ...
    ========= ERROR SUMMARY: 44832 errors

into a `ToolRun`: the error count of the summary (racecheck's "RACECHECK SUMMARY: n hazards
displayed (e errors, w warnings)" gives e), the kind of each printed report, and the first
reported frame (the device function and offset, or the host API call), plus whether the
watched program completed its forward + backward: a program that failed to import its package,
or was refused, reports "0 errors" about nothing. `data/gpu/sanitizer-<row>.json` holds a row's
runs; `load_sanitizer()` reads them through `varlen_workbench.workbench.records`, and `status()` says in one line
what a run shows.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import load_records

TOOLS = ("initcheck", "memcheck", "racecheck")
# scripts/audit_sanitize.py's last line when the program ran through, and its line for each part
# of the layout or program it gave up to run at all (a refused layout, a backward that raises).
COMPLETED = re.compile(r" (forward\+backward|forward only) in [\d.]+ s$", re.MULTILINE)
REDUCED = re.compile(r"^\S+: reduced: (.+)$", re.MULTILINE)
PREFIX = "========="
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
# Report headers: a line right after the prefix, not indented (detail lines are).
_NOT_REPORTS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "Target application returned an error")
# "Program hit CUDA_ERROR_... on CUDA API call to cuGetProcAddress_v2": a driver call's return code,
# which the summary counts too; a library probing for optional driver symbols makes many. Runs
# pass --report-api-errors no, so that the count is device memory errors alone.
API_RETURN_CODE = "Program hit CUDA_ERROR_"
# scripts/audit_sanitize.py's line (exit 3) for a row that cannot express the watched layout: no run is missing.
NOT_APPLICABLE = "not applicable"


@dataclass
class ToolRun:
    """What one compute-sanitizer tool reported on one program."""

    tool: str
    errors: int | None  # the summary's count (None: no summary in the log)
    kinds: dict[str, int] = field(default_factory=dict)  # printed reports by kind (the print limit caps them)
    first: str = ""  # the first report: its kind and first frame
    completed: bool = False  # the watched program ran its forward + backward through
    aborted: bool = False  # compute-sanitizer saw the program exit with an error
    program: list[str] = field(default_factory=list)  # the program's last lines
    why: str = ""  # why the tool did not run at all (not installed, timed out)
    reduced: list[str] = field(default_factory=list)  # what the program gave up to run (scripts/audit_sanitize.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def executable() -> str | None:
    """compute-sanitizer's path: on PATH, or where CUDA toolkits and the standalone package put it."""
    candidates = ("/usr/local/cuda/bin/compute-sanitizer", "/opt/nvidia/compute-sanitizer/compute-sanitizer")
    return shutil.which("compute-sanitizer") or next((p for p in candidates if Path(p).exists()), None)


def _kind(header: str) -> str:
    """'Invalid __global__ read of size 4 bytes' -> 'Invalid __global__ read'; 'Host API memory
    access error at host access to 0x...' -> 'Host API memory access error'."""
    return re.sub(r" of size [\d,]+ bytes?$", "", header).split(" at ")[0]


def parse(text: str, tool: str, program: str = "") -> ToolRun:
    """A `ToolRun` from compute-sanitizer's text output (`--log-file`) and the program's output."""
    lines = [line[len(PREFIX) :] for line in text.splitlines() if line.startswith(PREFIX)]
    errors = None
    kinds: dict[str, int] = {}
    first_header, first_frame = "", ""
    for i, line in enumerate(lines):
        body = line.strip()
        summary = _SUMMARY.search(body) or _RACE_SUMMARY.search(body)
        if summary and errors is None:
            errors = int(summary.group(1))
            continue
        if not body or line.startswith("  ") or any(body.startswith(n) for n in _NOT_REPORTS):
            continue
        kind = _kind(body)
        kinds[kind] = kinds.get(kind, 0) + 1
        if not first_header:
            first_header = body
            detail = [d.strip() for d in _report_lines(lines, i)]
            first_frame = next((d for d in detail if d.startswith("at ")), "") or next(
                (d.removeprefix("Host Frame:").strip() for d in detail if d.startswith("Host Frame:") and d[11:].strip()),
                detail[0] if detail else "",
            )
    tail = [line for line in program.strip().splitlines() if line.strip()]
    return ToolRun(
        tool,
        errors,
        kinds,
        f"{first_header}: {first_frame}" if first_frame else first_header,
        completed=COMPLETED.search(program) is not None,
        aborted="Target application returned an error" in text,
        program=tail[-4:],
        reduced=REDUCED.findall(program),
    )


def reads_just_before_allocations(text: str) -> ToolRun:
    """The memcheck log of a run that read out of bounds just before its allocations, in one kernel
    only (the audit matrix's earlier FlexAttention run, whose adapter's mask_mod indexed a boundary
    tensor at -1): its `ToolRun`, after checking that every printed report is such a read of that
    kernel. AssertionError naming what differs: the page states what this checks, and no count."""
    run = parse(text, "memcheck")
    reports = [line for line in text.splitlines() if line.startswith(PREFIX) and "Invalid __global__ read" in line]
    before = re.findall(r"is \d+ bytes before the nearest allocation at ", text)
    kernels = set(re.findall(r"^=+\s+at (\S+?)\+0x", text, re.MULTILINE))
    assert run.errors and set(run.kinds) == {"Invalid __global__ read"}, f"reports of other kinds: {run.kinds}"
    assert len(before) == len(reports), (
        f"{len(reports) - len(before)} of {len(reports)} printed reads are not just before an allocation"
    )
    assert len(kernels) == 1, f"reads in {len(kernels)} kernels: {sorted(kernels)}"
    return run


def _report_lines(lines: list[str], header: int) -> list[str]:
    """The indented lines of the report whose header is `lines[header]`."""
    out = []
    for line in lines[header + 1 :]:
        if not line.startswith("  "):
            break
        out.append(line)
    return out


def status(run: dict[str, Any]) -> tuple[int | None, str]:
    """(errors, one line) of a recorded `ToolRun`: the count counts only if the program completed,
    or if the tool's own reports aborted it (the errors are then real, and the program stopped).
    The line ends with what the program gave up to run, if anything."""
    if run.get("why"):
        printed = sum((run.get("kinds") or {}).values())
        if printed:  # killed past its time limit, after printing reports: a floor, not a count
            return None, f"not run through: {run['why']}, {printed} reports printed before it; first: {run.get('first')}"
        return None, f"not run: {run['why']}"
    errors, first = run.get("errors"), run.get("first") or ""
    if errors is None:
        return None, "no summary in the log"
    where = f"; first: {first}" if errors and first else ""
    where += "".join(f"; {line}" for line in run.get("reduced") or [])
    kinds = run.get("kinds") or {}
    if errors and kinds and all(kind.startswith(API_RETURN_CODE) for kind in kinds):
        return None, f"{errors} reports, the printed ones CUDA API return codes, not memory errors{where}"
    if not run.get("completed"):
        if errors:
            return errors, f"{errors} errors, then the program aborted{where}"
        last = (run.get("program") or ["?"])[-1].strip()
        return None, f"did not complete: {last[:140]}"
    return errors, f"{errors} errors{where}"


def row_summary(runs: dict[str, dict[str, Any]]) -> tuple[str, str, int | None]:
    """(verdict, evidence, total errors) of a row's runs for its matrix cell: 'clean' when every
    tool ran through with no error, 'errors' when one reported some, 'not run' when none counts."""
    counted = {tool: status(run) for tool, run in runs.items()}
    evidence = "; ".join(f"{tool}: {line}" for tool, (_, line) in counted.items())
    numbers = [n for n, _ in counted.values() if n is not None]
    total = sum(numbers) if numbers else None
    if total:
        return "errors", evidence, total
    if not numbers or len(numbers) < len(counted):  # "clean" only when every tool's run counts
        return "not run", evidence or "no compute-sanitizer record", total
    return "clean", evidence, total


def table(rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One line per (row, tool): what compute-sanitizer reported, or why the run does not count."""
    from varlen_workbench.workbench.tables import fixed_width

    return fixed_width(
        [("row", "tool", "result"), *((row, tool, status(run)[1]) for row, runs in rows.items() for tool, run in runs.items())]
    )


def load_sanitizer(directory: Path = GPU_DATA) -> dict[str, dict[str, dict[str, Any]]]:
    """{row: {tool: ToolRun as a dict}}: the per-row records (sanitizer-<row>.json), and for rows
    without one, the runs of the earlier single record (audit-sanitizer.json) re-parsed from
    their saved logs under logs/."""
    rows = {record["row"]: record["tools"] for record in load_records("sanitizer-*.json", directory)}
    for legacy in load_records("audit-sanitizer.json", directory):
        for row, by_tool in legacy["rows"].items():
            if row not in rows:
                rows[row] = {tool: _reparsed(Path(directory), row, tool, run) for tool, run in by_tool.items()}
    return rows


def _reparsed(directory: Path, row: str, tool: str, run: dict[str, Any]) -> dict[str, Any]:
    log = directory / "logs" / f"sanitizer-{row}-{tool}.log"
    if run.get("why") or not log.exists():
        return ToolRun(tool, None, why=run.get("why") or "no log").to_dict()
    return parse(log.read_text(errors="replace"), tool, "\n".join(run.get("program") or [])).to_dict()


__all__ = [
    "API_RETURN_CODE",
    "NOT_APPLICABLE",
    "TOOLS",
    "ToolRun",
    "executable",
    "load_sanitizer",
    "parse",
    "row_summary",
    "status",
    "table",
]
