"""What each FAIL of the audit matrix means: editorial judgements kept as data, not code.

data/audit/judgements.toml names each mechanism once (its kind: upstream, documented or wrapper;
its text; for a documented one, where upstream documents it) and the FAIL cells it explains,
with the upstream reports found for them and the post-mortem page that explains them. This
module reads it into one `Judgement` per (row, check), "fuzz:<check>" for a fuzzer failure, and
answers the page's questions: which FAILs are judged, which are known upstream, which appear new.

A FAIL is known when upstream reported it (a tracker link, or the upstream status of the
post-mortem that explains it: data/upstream-status.toml) or documents it (a "documented"
mechanism's links): a documented behaviour is never "new".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import tomllib

from varlen_workbench.workbench.audit.matrix import fails
from varlen_workbench.workbench.provenance import REPO
from varlen_workbench.workbench.upstream_status import UpstreamStatus, statuses

JUDGEMENTS_FILE = REPO / "data" / "audit" / "judgements.toml"
KINDS = ("upstream", "documented", "wrapper")
Link = tuple[str, str]  # (url, what it says)


@dataclass(frozen=True)
class Judgement:
    kind: str
    mechanism: str  # its name in the file
    text: str
    links: tuple[Link, ...] = ()  # upstream reports of the cell, then the mechanism's documentation
    postmortem: str | None = None
    nan_padding: bool = False  # the FAIL needs non-finite values planted in the padding (zeroed padding avoids it)

    @property
    def known(self) -> bool:
        return bool(self.links)


def _links(entries: list[dict[str, str]], where: str) -> tuple[Link, ...]:
    try:
        return tuple((entry["url"], entry["says"]) for entry in entries)
    except (KeyError, TypeError):
        raise ValueError(f"{where}: each link is {{url = ..., says = ...}}; got {entries!r}") from None


def _status_link(status: UpstreamStatus) -> tuple[Link, ...]:
    """The upstream report a post-mortem's status names, as a cell's link (none: no report found)."""
    return ((status.reference, f"upstream status, checked {status.checked}: {status.label}"),) if status.known else ()


def parse(
    data: dict[str, Any], source: str = "judgements", upstream: dict[str, UpstreamStatus] | None = None
) -> dict[tuple[str, str], Judgement]:
    """{(row, check): Judgement} from the file's parsed TOML; ValueError naming what is wrong. A cell
    that names a post-mortem carries the report its upstream status names (`upstream`: the statuses
    of data/upstream-status.toml by post-mortem id)."""
    upstream = upstream or {}
    mechanisms = data.get("mechanisms", {})
    for name, mechanism in mechanisms.items():
        if mechanism.get("kind") not in KINDS:
            raise ValueError(f"{source}: mechanism {name!r} has kind {mechanism.get('kind')!r}; use one of {KINDS}.")
        if mechanism["kind"] == "documented" and not mechanism.get("links"):
            raise ValueError(f"{source}: mechanism {name!r} is 'documented' but gives no link to where upstream says so.")
    judged: dict[tuple[str, str], Judgement] = {}
    for i, entry in enumerate(data.get("cells", [])):
        name = entry.get("mechanism")
        if name not in mechanisms:
            raise ValueError(f"{source}: cells entry {i} names mechanism {name!r}, which is not under [mechanisms].")
        mechanism = mechanisms[name]
        text = f"{entry['note']}: {mechanism['text']}" if entry.get("note") else mechanism["text"]
        postmortem = entry.get("postmortem")
        if postmortem is not None and postmortem not in upstream:
            raise ValueError(f"{source}: cells entry {i} names post-mortem {postmortem!r}, which has no upstream status.")
        links = (
            _links(entry.get("upstream", []), f"{source}: cells entry {i}")
            + (_status_link(upstream[postmortem]) if postmortem is not None else ())
            + _links(mechanism.get("links", []), f"{source}: mechanism {name!r}")
        )
        first: dict[str, str] = {}
        for url, says in links:  # each url once, as first said (a cell's own report before its post-mortem's)
            first.setdefault(url, says)
        links = tuple(first.items())
        for row in entry["rows"]:
            for check in entry["checks"]:
                if (row, check) in judged:
                    raise ValueError(f"{source}: {row} / {check} is judged twice (cells entry {i} and an earlier one).")
                judged[(row, check)] = Judgement(
                    mechanism["kind"], name, text, links, postmortem, mechanism.get("nan_padding", False)
                )
    return judged


@cache
def judgements(path: Path = JUDGEMENTS_FILE) -> dict[tuple[str, str], Judgement]:
    """The judgements of `path` (the project's file by default)."""
    with open(path, "rb") as handle:
        return parse(tomllib.load(handle), str(path), statuses(REPO))


def known_links(row: str, column: str) -> list[Link]:
    """The upstream links of one matrix cell (the fuzzer's cell: those of every fuzz:<check> of the row)."""
    cells = [
        j for (r, c), j in judgements().items() if r == row and (c == column or (column == "fuzzer" and c.startswith("fuzz:")))
    ]
    return list(dict.fromkeys(link for j in cells for link in j.links))


def postmortem_links(row: str, column: str) -> list[str]:
    """The post-mortem ids of one cell (the fuzzer's cell: those of every fuzz:<check> of the row)."""
    cells = [
        j for (r, c), j in judgements().items() if r == row and (c == column or (column == "fuzzer" and c.startswith("fuzz:")))
    ]
    return sorted({j.postmortem for j in cells if j.postmortem})


def unjudged(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """FAIL cells without a judgement (the page asserts there are none)."""
    return [(row, check) for row, check, _ in fails(records) if (row, check) not in judgements()]


def new_findings(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Judged FAILs that upstream neither reported nor documents: they appear to be new."""
    found = judgements()
    return [(row, check) for row, check, _ in fails(records) if (row, check) in found and not found[(row, check)].known]


def unmatched(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Judged cells of recorded rows that are no FAIL of the records (fixed upstream, or not run)."""
    failing = {(row, check) for row, check, _ in fails(records)}
    rows = {record["row"] for record in records}
    return [cell for cell in judgements() if cell[0] in rows and cell not in failing]


__all__ = [
    "JUDGEMENTS_FILE",
    "KINDS",
    "Judgement",
    "judgements",
    "known_links",
    "new_findings",
    "parse",
    "postmortem_links",
    "unjudged",
    "unmatched",
]
