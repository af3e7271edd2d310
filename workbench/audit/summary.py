"""The audit matrix in three lines, computed from the records and their judgements
(data/audit/judgements.toml): what is broken where, where NaN in the padding reaches real rows,
and what to use. The audit-matrix page opens with it; nothing in it is typed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from varlen_workbench.workbench.audit.judgements import Judgement, judgements
from varlen_workbench.workbench.audit.matrix import CORRECTNESS, cell, fails, fuzz_budget, grid, left_out, ran
from varlen_workbench.workbench.audit.sanitizer import NOT_APPLICABLE, status
from varlen_workbench.workbench.provenance import GPU_DATA

# How a FAIL counts: an upstream bug whatever the padding holds ("broken", also where no judgement
# says otherwise), one that needs non-finite values planted in the padding, behaviour upstream
# documents as intended, or a consequence of our adapter.
KINDS = ("broken", "nan-padding", "documented", "wrapper")
SHOWN = 3  # failing checks named per row; the grid below has every one


def failures(records: list[dict[str, Any]]) -> dict[str, dict[str, list[str]]]:
    """{row: {kind: [failing checks, 'fuzz:<check>' for the fuzzer's]}} for every row that ran."""
    judged = judgements()
    found: dict[str, dict[str, list[str]]] = {record["row"]: {} for record in records if ran(record)}
    for row, check, _ in fails(records):
        j = judged.get((row, check))
        kind = "broken" if j is None or j.kind == "upstream" and not j.nan_padding else "nan-padding" if j.nan_padding else j.kind
        found[row].setdefault(kind, []).append(check)
    return found


def _pages(row: str, checks: list[str]) -> list[str]:
    judged = judgements()
    return sorted({j.postmortem for c in checks if (j := judged.get((row, c))) and j.postmortem})


def _rows(found: dict[str, dict[str, list[str]]], kind: str, pages: bool = False) -> str:
    """'`row` (check, check; [page](page.html)); ...' for each row with FAILs of `kind`."""
    parts = []
    for row, kinds in found.items():
        if kind in kinds:
            checks = [c.replace("fuzz:", "fuzzer: ") for c in kinds[kind]]
            shown = ", ".join(checks[:SHOWN]) + (f" and {len(checks) - SHOWN} more" if len(checks) > SHOWN else "")
            linked = [f"[{p}]({p}.html)" for p in _pages(row, kinds[kind])] if pages else []
            parts.append(f"`{row}` ({'; '.join([shown, *linked])})")
    return "; ".join(parts)


def summary(records: list[dict[str, Any]]) -> str:
    """Markdown: three bullets (broken, NaN in the padding, use), then the rows that did not run."""
    found = failures(records)
    passed = {row for row, cells in grid(records).items() if "pass" in cells.values()}
    as_is = [row for row in found if row in passed and not found[row]]
    zeroed = [row for row in found if row in passed and set(found[row]) == {"nan-padding"}]
    broken = _rows(found, "broken", pages=True) or "nothing"
    documented, ours = _rows(found, "documented"), _rows(found, "wrapper")
    lines = [
        f"* **Broken** (whatever the padding holds): {broken}."
        + (f" Documented upstream as intended: {documented}." if documented else "")
        + (f" From our adapter's choice, not upstream's code: {ours}." if ours else ""),
        "* **NaN planted in the padding reaches outputs** (0 x NaN; zero-filled padding avoids it): "
        + (_rows(found, "nan-padding") or "nowhere")
        + ".",
        "* **Use:** "
        + "; ".join(
            [f"{', '.join(f'`{r}`' for r in as_is)} as is"] * bool(as_is)
            + [f"{', '.join(f'`{r}`' for r in zeroed)} with zero-filled padding"] * bool(zeroed)
        )
        + ".",
    ]
    not_run = [f"`{record['row']}` did not run" for record in records if not ran(record)]
    unchecked = [f"`{row}` could not be checked (every cell n/a)" for row in found if row not in passed and not found[row]]
    if not_run or unchecked:
        lines.append(f"\nNot in these lines: {'; '.join(not_run + unchecked)}; their cells below say why.")
    return "\n".join(lines)


# Checks whose FAIL is loud (an exception, or the input-validation grade), not a silent wrong value; any
# other check whose evidence says the call raised (`raised`) is loud too.
LOUD = ("bad-input", "fuzz:raises-on-valid-layout")


def audits_summary(subjects: dict[str, dict[str, Any]]) -> str:
    """Markdown: the same three lines for standalone audits ({label: record with its matrix `row`},
    judged as the matrix's cells are): a FAIL whose every failing value lies in TAIL rows counts as
    the TAIL mechanism (`varlen_workbench.workbench.audit.regrade.tail_only`), whatever check found it."""
    from varlen_workbench.workbench.audit.regrade import tail_only

    broken: list[str] = []
    clean: list[str] = []
    use: list[str] = []
    for label, record in subjects.items():
        found = failures([record])[record["row"]]
        evidence = {check: text for _, check, text in fails([record])}
        fuzz = record.get("fuzz") or {}
        if not found:
            clean.append(f"{label}: every check passes; the fuzzer tried {fuzz.get('tried', 0):,} layouts, none failing")
            use.insert(0, f"{label} as is")
            continue
        bad = found.get("broken", [])
        tail = [c for c in bad if tail_only(evidence[c])]
        loud = [c for c in bad if c in LOUD or raised(evidence[c])]
        other = [c for c in bad if c not in tail and c not in loud]
        said = []
        if tail:
            pages = "".join(f" ([{p}]({p}.html))" for p in _pages(record["row"], bad))
            said.append(
                f"TAIL rows (past `cu_seqlens[-1]`) of its output and gradients unwritten: every failing value of "
                f"{_named(tail)} lies there{pages}"
            )
        if other:
            pages = "".join(f" ([{p}]({p}.html))" for p in _pages(record["row"], other))
            said.append(f"silently wrong in {_named(other)}{pages}")
        if loud:
            said.append(
                "loud failures (an exception, or no clear error for malformed input): "
                + ", ".join(f"{_named([c])} ({_first_line(evidence[c])})" if raised(evidence[c]) else _named([c]) for c in loud)
            )
        if found.get("documented"):
            said.append(f"documented upstream as intended: {_named(found['documented'])}")
        broken.append(f"{label}: " + "; ".join(said))
        if tail and not other:
            use.append(f"{label} with its TAIL rows zeroed")
    lines = [f"* **Broken:** {'. '.join(broken) or 'nothing'}."]
    if clean:
        lines.append(f"* **Not broken:** {'. '.join(clean)}.")
    lines.append(f"* **Use:** {'; '.join(use) or 'none of these'}.")
    return "\n".join(lines)


def record_fails(record: dict[str, Any], row: str) -> list[tuple[str, str, Judgement | None]]:
    """(check, evidence, its judgement or None) for every FAIL of one audit record, judged as the
    matrix's row `row`: its checks, then the fuzzer's ('fuzz:<check>')."""
    judged = judgements()
    return [(check, evidence, judged.get((row, check))) for _, check, evidence in fails([{**record, "row": row}])]


def fails_markdown(record: dict[str, Any], row: str, page: str) -> str:
    """Markdown for a post-mortem page: how many checks of `record` fail, then one bullet per
    mechanism with every FAIL it explains (this page's first; a FAIL nobody judged says so), then
    the checks that pass and any other verdict. Every FAIL of the record is named, once."""
    from varlen_workbench.workbench.audit.regrade import padding_only

    found = record_fails(record, row)
    groups: dict[str, list[tuple[str, str, Judgement | None]]] = {}
    for check, evidence, judgement in found:
        groups.setdefault(judgement.mechanism if judgement else "", []).append((check, evidence, judgement))
    ours = [name for name, items in groups.items() if items[0][2] and items[0][2].postmortem == page]
    checks = [c for c in record["checks"] if c["verdict"] in ("pass", "FAIL")]
    failing = [c["name"] for c in checks if c["verdict"] == "FAIL"]
    fuzz = record.get("fuzz") or {}
    fuzzed = [c for c, _, _ in found if c.startswith("fuzz:")]
    lines = [
        f"{len(failing)} of {len(checks)} checks fail"
        + (f", and the fuzzer ({fuzz.get('tried', 0):,} layouts) fails {len(fuzzed)} checks" if fuzz else "")
        + f": {len(found)} FAILs in all, each below with the mechanism it is judged to be."
    ]
    for name in ours + [name for name in groups if name not in ours]:
        items = groups[name]
        named = _named([c for c, _, _ in items])
        judgement = items[0][2]
        if judgement is None:
            lines.append(f"* **{named}**: not judged yet.")
            continue
        where = (
            "only through padding rows (every failing value lies in GAP or TAIL rows)"
            if all(padding_only(e) for _, e, _ in items)
            else "on REAL rows"
        )
        when = "; only with NaN planted in the padding (zero-filled padding avoids it)" if judgement.nan_padding else ""
        whose = "This page's mechanism." if name in ours else f"Not this page's mechanism: {judgement.text}."
        lines.append(f"* **{named}**: {where}{when}. {whose}")
    passing = [c["name"] for c in checks if c["verdict"] == "pass"]
    lines.append(f"* **Pass:** {', '.join(passing) or 'none'}.")
    other = [f"{c['name']} ({c['verdict']})" for c in record["checks"] if c["verdict"] not in ("pass", "FAIL")]
    if other:
        lines.append(f"* **Other verdicts:** {', '.join(other)}.")
    return "\n".join(lines)


def raised(evidence: str) -> bool:
    """Whether a FAIL's evidence is an exception the call raised ('raised AcceleratorError: ...'), not a value."""
    return evidence.startswith("raised ")


def _first_line(evidence: str) -> str:
    return evidence.split("\n", 1)[0].strip()


def _named(checks: list[str]) -> str:
    return ", ".join(c.replace("fuzz:", "fuzzer: ") for c in checks)


KILLED = re.compile(r"^killed after (\d+) s$")  # scripts/gpu_audit_matrix.py's last log line for a run past its deadline
# A row's runs by phase, in the order scripts/gpu_audit_matrix.py takes them (a slow row moves from one
# run of everything to a checks run, then a fuzz run), each with its log's suffix and what it runs.
PHASES = (("", "checks and fuzzer"), ("-checks", "checks"), ("-fuzz", "fuzzer"))


def _phase(record: dict[str, Any]) -> int:
    """The phase of the run that wrote the record: a fuzz run merges its fuzzer into the checks' record."""
    return 2 if "fuzz_provenance" in record else 1 if record.get("budget") == 0 else 0


def _killed(record: dict[str, Any], directory: Path) -> str | None:
    """Why the row's latest run left no record: its log, of the record's phase or a later one (each
    run rewrites its phase's logs, a checks run's parts one each, `-checks-<i>`), ends in
    'killed after N s' (a killed run that recorded what it finished says so on a last line)."""
    for suffix, what in PHASES[_phase(record) if ran(record) else 0 :]:
        logs = [directory / "logs" / f"audit-{record['row']}{suffix}.log"]
        logs += sorted((directory / "logs").glob(f"audit-{record['row']}{suffix}-[0-9]*.log")) if suffix else []
        for log in logs:
            lines = log.read_text(errors="replace").split("\n") if log.exists() else []
            last = next((line.strip() for line in reversed(lines) if line.strip()), "")
            if match := KILLED.match(last):
                return (
                    f"the latest run's {what} killed at the call's deadline after {match[1]} s (the record is an earlier run's)"
                )
    return None


def fuzz_line(record: dict[str, Any]) -> str:
    """How far a row's fuzzer went, for the audit matrix: the layouts it tried, whether it stopped
    before the number it was given (and why), and which target that meets (`fuzz_budget`)."""
    fuzzed = record.get("fuzz") if ran(record) else None
    if not fuzzed:
        return f"{record['row']:<22} {cell(record, 'fuzzer')[1]}"
    how = f"stopped early: {fuzzed['stopped_early']}" if fuzzed["stopped_early"] else "every layout it was given"
    target = fuzz_budget(record)
    return f"{record['row']:<22} {fuzzed['tried']:>5} layouts ({how}; " + (
        f"meets the target of {target})" if target else "short of both targets)"
    )


def incomplete(records: list[dict[str, Any]], directory: Path = GPU_DATA) -> dict[str, list[str]]:
    """{row: [why, ...]} for each row whose record is not whole (`varlen_workbench.workbench.audit.matrix.complete`)
    or whose compute-sanitizer runs do not all count: a latest run killed at its deadline, the
    cells left "not run" grouped by their reason (context lost at a check, fuzzing not asked), a
    fuzzer short of its budget, and each sanitizer tool that did not run through (or has no record).
    A tool that cannot express the watched layout is n/a, not missing."""
    found: dict[str, list[str]] = {}
    for record in records:
        row, why = record["row"], []
        if killed := _killed(record, directory):
            why.append(killed)
        if not ran(record):
            why.append(f"did not run: {cell(record, 'fuzzer')[1]}")
        else:
            left: dict[str, list[str]] = {}
            for column in [*CORRECTNESS, "fuzzer", "input-validation"]:
                if left_out(record, column):
                    left.setdefault(cell(record, column)[1].removeprefix("not run: "), []).append(column)
            why += [f"{', '.join(columns)}: {reason}" for reason, columns in left.items()]
            if record.get("fuzz") and not fuzz_budget(record):
                cut = record["fuzz"].get("partial")
                why.append(
                    f"fuzzer: {record['fuzz']['tried']} layouts, short of both budgets" + (f" (cut: {cut})" if cut else "")
                )
        runs = record.get("sanitizer") or {}
        if not runs:
            why.append("compute-sanitizer: no record")
        for tool, run in runs.items():
            counted, line = status(run)
            if counted is None and NOT_APPLICABLE not in (run.get("why") or ""):
                why.append(f"compute-sanitizer {tool}: {line}")
        if why:
            found[row] = why
    return found
