"""Whether a GPU record still describes the code that ships, and the stamp a page shows for it.

`freshness(record)` compares the fingerprint of the code the record measured (at its commit:
`varlen_workbench.workbench.gpu_records.fingerprint.recorded_fingerprint`) with that code now; its `html()`
is the stamp a page shows (site/templates/postmortem/provenance.html.j2): the record's file,
date, GPU and commit, with a "recorded on earlier code" badge where they differ. Nothing here
fails on a stale record: the page says so instead.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from varlen_workbench.workbench.gpu_records.fingerprint import current_fingerprint, recorded_commit, recorded_fingerprint
from varlen_workbench.workbench.gpu_records.kinds import RecordKind, kind_of
from varlen_workbench.workbench.provenance import REPO

STALE = "recorded on earlier code"
UNKNOWN = "code not fingerprinted"


@dataclass(frozen=True)
class Freshness:
    file: str
    date: str
    gpu: str
    commit: str
    stale: bool | None  # None: no fingerprint for the code it measured

    @property
    def badge(self) -> str:
        return "" if self.stale is False else STALE if self.stale else UNKNOWN

    def line(self) -> str:
        return f"data/gpu/{self.file} · {self.gpu} · commit {self.commit} · {self.date}"

    def html(self) -> str:
        badge = f' <span class="wb-stale" title="{html.escape(self.why())}">{self.badge}</span>' if self.badge else ""
        return f'<span class="wb-record">{html.escape(self.line())}{badge}</span>'

    def why(self) -> str:
        if self.stale is None:
            return "no fingerprint of the code it measured: run varlen-workbench gpu-records --backfill"
        return "the code it measured has changed since this commit: varlen-workbench gpu-records plans its remake"


@cache
def _now(kind: RecordKind, root: Path) -> str:
    return current_fingerprint(kind, root)


def freshness(record: dict[str, Any], root: Path = REPO) -> Freshness:
    """The freshness of a record read by `records.load_records` (it needs the `file` name),
    against the code in the tree at `root`."""
    p = record.get("provenance", {})
    then = recorded_fingerprint(record)
    stale = None if then is None else then != _now(kind_of(record["file"]), root)
    return Freshness(
        record["file"], str(p.get("date", "?"))[:10], str(p.get("device", "?")), recorded_commit(record) or "?", stale
    )
