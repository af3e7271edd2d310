"""Fixed-width text tables, the one format of every table the workbench prints (verdicts,
audits, `varlen-workbench list`): deterministic, so nbval compares them exactly."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def fixed_width(rows: Iterable[Sequence[str]], *, header: bool = True) -> str:
    """Columns padded to their widest cell, except the last (free text: evidence runs long).
    With `header`, the first row is the header and a rule as wide as it separates the rest."""
    rows = [tuple(row) for row in rows]
    if not rows:
        return ""
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join([*(f"{cell:<{w}}" for cell, w in zip(row, width)), row[-1]]).rstrip() for row in rows]
    if header:
        lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
