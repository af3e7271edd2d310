"""The plan of GPU records: every committed record with its freshness, and the calls that remake
the stale ones (`varlen-workbench gpu-records`, `make gpu-records`).

A device call runs at most CALL_MINUTES: the stale records' commands are packed into calls in
order, after the wheels (where a stale record needs a carried upstream package) and the native
GPU tests (where any is stale), each call as full as it goes. A record's time is its own where
it says (`record_kinds.recorded_minutes`); records that share a command run it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from varlen_workbench.workbench.gpu_records.fingerprint import (
    FINGERPRINTS,
    committed_fingerprints,
    fingerprint_at,
    record_versions,
    recorded_commit,
)
from varlen_workbench.workbench.gpu_records.freshness import Freshness, freshness
from varlen_workbench.workbench.gpu_records.kinds import CARRIED, TESTS, WHEELS, kind_of, recorded_minutes
from varlen_workbench.workbench.provenance import REPO
from varlen_workbench.workbench.records import load_records, portable, write_json

CALL_MINUTES = 10.0  # the device's limit on one command


@dataclass(frozen=True)
class Entry:
    freshness: Freshness
    command: str  # what remakes it, or why nothing does
    remakable: bool
    minutes: float
    carried: bool  # needs wheels the GPU image lacks


def entries(records: list[dict[str, Any]]) -> list[Entry]:
    rows = []
    for record in records:
        kind = kind_of(record["file"])
        command = kind.command_for(record["file"])
        recorded = portable(str(record["provenance"].get("command", "")))
        rows.append(
            Entry(
                freshness(record),
                command or f"none ({kind.note}; it ran: {recorded or '?'})",
                command is not None,
                recorded_minutes(record, kind),
                bool(CARRIED & set(kind.upstream)),
            )
        )
    return rows


def plan(rows: list[Entry]) -> list[list[tuple[str, float]]]:
    """The calls that remake the stale records: each a list of (command, minutes) within CALL_MINUTES."""
    stale = [r for r in rows if r.freshness.stale is not False and r.remakable]
    steps: dict[str, float] = {}
    if any(r.carried for r in stale):
        steps[WHEELS[0]] = WHEELS[1]
    if stale:
        steps[TESTS[0]] = TESTS[1]
    for row in stale:
        steps[row.command] = max(steps.get(row.command, 0.0), row.minutes)
    calls: list[list[tuple[str, float]]] = []
    for command, minutes in steps.items():
        if calls and sum(m for _, m in calls[-1]) + minutes <= CALL_MINUTES:
            calls[-1].append((command, minutes))
        else:
            calls.append([(command, minutes)])
    return calls


def report(records: list[dict[str, Any]] | None = None) -> str:
    """The listing, then the plan, as `varlen-workbench gpu-records` prints them."""
    rows = entries(load_records("*.json") if records is None else records)
    lines = [f"{len(rows)} GPU records under data/gpu/, {sum(r.freshness.stale is not False for r in rows)} stale:", ""]
    for row in rows:
        f = row.freshness
        state = {False: "fresh", True: "STALE (the code it measured changed)", None: "STALE? (no fingerprint)"}[f.stale]
        lines.append(f"{f.file}  {state}\n    {f.gpu} · commit {f.commit} · {f.date} · ~{row.minutes:.1f} min\n    {row.command}")
    calls = plan(rows)
    lines += ["", f"Remaking the stale ones: {len(calls)} calls of at most {CALL_MINUTES:.0f} minutes"]
    for number, call in enumerate(calls, 1):
        lines.append(f"call {number} (~{sum(m for _, m in call):.1f} min):")
        lines += [f"    {command}   # ~{minutes:.1f} min" for command, minutes in call]
    unremade = [r.freshness.file for r in rows if r.freshness.stale is not False and not r.remakable]
    if unremade:
        lines.append(f"stale with no command to remake them (see each above): {', '.join(unremade)}")
    return "\n".join(lines)


def backfill(records: list[dict[str, Any]], root: Path = REPO, path: Path = FINGERPRINTS) -> dict[str, str]:
    """Adds to `path` the fingerprint at its commit of each record that carries none; returns them
    all (`varlen-workbench gpu-records --backfill`). Here, not in `fingerprint`: it writes through
    `records`, which stamps records with `fingerprint`."""
    known = committed_fingerprints(path)
    for record in records:
        if "fingerprint" in record["provenance"] or record["file"] in known:
            continue
        commit = recorded_commit(record)
        if not commit:
            raise ValueError(f"data/gpu/{record['file']} names no commit; its fingerprint cannot be read from git history")
        kind = kind_of(record["file"])
        known[record["file"]] = fingerprint_at(commit, kind, record_versions(record, kind), root)
    write_json(path, dict(sorted(known.items())))
    return known
