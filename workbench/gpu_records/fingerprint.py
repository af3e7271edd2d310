"""Fingerprints of the code a GPU record measured, judged by content, not by paths or commits.

A fingerprint is the sha256 of the sorted content hashes of the measured sources (the kind's
paths in `varlen_workbench.workbench.gpu_records.kinds`) and of `package==version` for each upstream
package: moving or renaming a file leaves it as it was, changing its code does not. A source's
content is its syntax tree without docstrings, comments or layout, with the `varlen_workbench.`
prefix taken out, each dotted name of our modules reduced to its last name (in imports, strings
and attribute chains) and each run of imports sorted: what runs, so that moving modules between
folders or packages (imports rewritten, re-sorted and rewrapped, docs reworded) changes nothing.
A measured file that moved is found at its former path in older commits (`kinds.FORMERLY`).

A record written since carries its fingerprint in its provenance (`records.write_record`).
Records made before that are fingerprinted once from git history, the code at their commit
(`varlen_workbench.workbench.gpu_records.plan.backfill`), into FINGERPRINTS, committed: CI's clone may have no history.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from varlen_workbench.workbench.gpu_records.kinds import UPSTREAM, RecordKind, former_paths
from varlen_workbench.workbench.provenance import GPU_DATA, REPO

# record file -> fingerprint of its code at its commit; beside data/gpu/, whose every file is a record
FINGERPRINTS = GPU_DATA.parent / "gpu-fingerprints.json"


def _docstring(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) and isinstance(statement.value.value, str)
    )


def _path_setup(statement: ast.stmt) -> bool:
    """`sys.path.insert(...)`: where the code is found (scripts did it before the install), not what it runs."""
    call = statement.value if isinstance(statement, ast.Expr) else None
    return isinstance(call, ast.Call) and ast.unparse(call.func) in ("sys.path.insert", "sys.path.append")


# A dotted name in one of our packages, once the `varlen_workbench.` prefix is out: kept as its last
# name, in imports, strings (`python -m ...`) and attribute chains alike.
OUR_MODULE = re.compile(rb"\b(?:kernels|workbench|postmortems)\.(?:\w+\.)*(\w+)")


def _sorted_imports(body: list[ast.stmt]) -> list[ast.stmt]:
    """Each run of consecutive imports in sorted order: an import sorter's reordering changes nothing."""
    out: list[ast.stmt] = []
    run: list[ast.stmt] = []
    for statement in [*body, None]:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            run.append(statement)
            continue
        out += sorted(run, key=ast.dump)
        run = []
        if statement is not None:
            out.append(statement)
    return out


def _code(source: bytes) -> bytes:
    """What a source runs: its syntax tree without docstrings or path set-up (the text itself if
    it does not parse)."""
    text = OUR_MODULE.sub(rb"\1", source.replace(b"varlen_workbench.", b""))
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return text
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            kept = [s for i, s in enumerate(body) if not (i == 0 and _docstring(s)) and not _path_setup(s)]
            node.body = _sorted_imports(kept) or [ast.Pass()]  # type: ignore[attr-defined]
    return ast.dump(tree).encode()


def fingerprint(sources: Iterable[bytes], versions: dict[str, str]) -> str:
    contents = sorted(hashlib.sha256(_code(text)).hexdigest() for text in sources)
    pins = sorted(f"{package}=={version}" for package, version in versions.items())
    return hashlib.sha256("\n".join(contents + pins).encode()).hexdigest()[:16]


def _measured(paths: Iterable[str], kind: RecordKind) -> list[str]:
    """The .py files among `paths` (repository-relative) that the kind's paths name, now or before a move."""
    return sorted(
        p
        for p in paths
        if p.endswith(".py")
        and any(p == m or p.startswith(m.rstrip("/") + "/") for m in (*kind.measures, *former_paths(kind.measures)))
    )


def current_fingerprint(kind: RecordKind, root: Path = REPO, versions: dict[str, str] | None = None) -> str:
    """The fingerprint of the kind's code in the tree at `root`, with the UPSTREAM versions it is
    meant to measure (or `versions`: what a GPU machine has installed)."""
    files = [p for m in kind.measures for p in ([root / m] if (root / m).is_file() else sorted((root / m).rglob("*.py")))]
    chosen = versions or UPSTREAM
    return fingerprint((f.read_bytes() for f in files), {p: chosen[p] for p in kind.upstream})


def installed_versions(kind: RecordKind) -> dict[str, str]:
    """The installed versions of the kind's upstream packages (the declared one where absent)."""
    found = {}
    for package in kind.upstream:
        try:
            found[package] = importlib.metadata.version(package).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            found[package] = UPSTREAM[package]
    return found


def record_versions(record: dict[str, Any], kind: RecordKind) -> dict[str, str]:
    """The upstream versions a record names (its `versions`, else its provenance), else UPSTREAM's."""
    named = {**record.get("provenance", {}), **record.get("versions", {})}
    return {p: str(named.get(p, UPSTREAM[p])).split("+")[0] for p in kind.upstream}


def recorded_commit(record: dict[str, Any]) -> str:
    """The commit a record names (some add a note after it: "d116318 (the code that ran)")."""
    match = re.match(r"[0-9a-f]{7,40}", str(record.get("provenance", {}).get("commit", "")))
    return match.group(0) if match else ""


def fingerprint_at(commit: str, kind: RecordKind, versions: dict[str, str], root: Path = REPO) -> str:
    """The fingerprint of the kind's code as it was at `commit` (git history of `root`)."""

    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=True).stdout

    paths = git("ls-tree", "-r", "--name-only", commit).decode().splitlines()
    return fingerprint((git("show", f"{commit}:{p}") for p in _measured(paths, kind)), versions)


def committed_fingerprints(path: Path = FINGERPRINTS) -> dict[str, str]:
    return json.loads(path.read_text()) if path.exists() else {}


def recorded_fingerprint(record: dict[str, Any], committed: dict[str, str] | None = None) -> str | None:
    """The fingerprint of the code `record` measured: its provenance's, else FINGERPRINTS's; None
    when neither has one (run `varlen-workbench gpu-records --backfill` where git history is)."""
    if "fingerprint" in record.get("provenance", {}):
        return record["provenance"]["fingerprint"]
    return (committed_fingerprints() if committed is None else committed).get(record["file"])
