"""Fixed-width text tables, the one format of every table the workbench prints (verdicts,
audits, `workbench list`): deterministic, so nbval compares them exactly."""
from __future__ import annotations

from typing import Iterable, Sequence


def fixed_width(rows: Iterable[Sequence[str]]) -> str:
    """The first row is the header. Columns are padded to their widest cell, except the last
    (free text: evidence runs long); a rule as wide as the header separates it from the rest."""
    rows = [tuple(row) for row in rows]
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join([*(f"{cell:<{w}}" for cell, w in zip(row, width)), row[-1]]).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
