"""What a post-mortem is made of: metadata, named claims, and their verdicts.

A module `postmortems/<id>.py` defines

* `META = Meta(...)` — the single source for the notebook header and the site index;
* `CASES` — the `workbench.Case`s it studies;
* `reproduce(device=None) -> dict` — runs the study and returns results;
* `claims = Claims()` — named, checkable statements about those results, each a function
  `results -> (holds: bool, evidence: str)` registered with `@claims("statement")`.

The notebook ends with `claims.report(results)`, which prints the verdict table that nbval
compares exactly, and raises naming every claim that no longer holds.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from workbench.tables import fixed_width

STATUSES = ("open", "fixed", "partially fixed", "closed (not fixed)", "withdrawn", "not a bug", "upstream unaware")


@dataclass(frozen=True)
class Link:
    label: str
    url: str


@dataclass(frozen=True)
class Meta:
    """A post-mortem's identity card (rendered as the notebook header and an index row)."""

    id: str
    title: str
    component: str  # the upstream software and the piece of it, e.g. "PyTorch / varlen_attn"
    upstream_status: str  # one of STATUSES, detailed in `status_note`
    status_note: str
    detection: str  # how the bug shows itself to a user
    fix_type: str  # what kind of fix upstream tried and what we propose
    tags: tuple[str, ...]
    reported: str  # ISO date the bug was reported upstream
    published: str  # ISO date of this post-mortem
    links: tuple[Link, ...] = ()
    seed: str = ""  # file name of the seed claim in shared/seeds, if any

    def __post_init__(self) -> None:
        if self.upstream_status not in STATUSES:
            raise ValueError(f"Meta.upstream_status = {self.upstream_status!r} must be one of {STATUSES}.")
        for name in ("reported", "published"):
            try:
                datetime.date.fromisoformat(getattr(self, name))
            except ValueError:
                raise ValueError(f"Meta.{name} = {getattr(self, name)!r} must be an ISO date (YYYY-MM-DD).") from None
        if not self.id or not all(c.isalnum() or c in "-_" for c in self.id):
            raise ValueError(f"Meta.id = {self.id!r} must be non-empty letters, digits, '-' or '_' (it names files).")

    def header_markdown(self) -> str:
        """The notebook's header cell, generated so that nothing is typed twice."""
        links = " · ".join(f"[{link.label}]({link.url})" for link in self.links)
        lines = [
            f"# {self.title}",
            "",
            f"**{self.id}** · {self.component} · upstream: **{self.upstream_status}** ({self.status_note})",
            "",
            f"Detection: {self.detection} · Fix type: {self.fix_type} · Reported {self.reported} · Published {self.published}",
            "",
            f"Tags: {', '.join(self.tags)}",
        ]
        if links:
            lines += ["", f"Upstream: {links}"]
        return "\n".join(lines)


@dataclass(frozen=True)
class Verdict:
    claim: str
    holds: bool
    evidence: str


class ClaimFailed(AssertionError):
    """Raised by `Claims.report` when a claim no longer holds; names every failing claim."""


@dataclass
class Claims:
    """An ordered set of named claims about a post-mortem's results."""

    _checks: list[tuple[str, Callable[[Any], tuple[bool, str]]]] = field(default_factory=list)

    def __call__(self, statement: str) -> Callable:
        if any(statement == s for s, _ in self._checks):
            raise ValueError(f"claim {statement!r} is registered twice.")

        def register(check: Callable[[Any], tuple[bool, str]]) -> Callable[[Any], tuple[bool, str]]:
            self._checks.append((statement, check))
            return check

        return register

    def __len__(self) -> int:
        return len(self._checks)

    @property
    def statements(self) -> list[str]:
        return [s for s, _ in self._checks]

    def check(self, results: Any) -> list[Verdict]:
        """Evaluates every claim; a check that raises is a claim that does not hold."""
        verdicts = []
        for statement, check in self._checks:
            try:
                holds, evidence = check(results)
            except Exception as exc:  # a broken check must show up as a failed claim, not vanish
                holds, evidence = False, f"check raised {type(exc).__name__}: {exc}"
            verdicts.append(Verdict(statement, bool(holds), evidence))
        return verdicts

    def report(self, results: Any) -> list[Verdict]:
        """Prints the verdict table; raises `ClaimFailed` naming the claims that do not hold."""
        verdicts = self.check(results)
        print(verdict_table(verdicts))
        failed = [v for v in verdicts if not v.holds]
        if failed:
            names = "; ".join(f"{v.claim!r} ({v.evidence})" for v in failed)
            raise ClaimFailed(f"{len(failed)} of {len(verdicts)} claims do not hold: {names}")
        return verdicts


def verdict_table(verdicts: Iterable[Verdict]) -> str:
    """A fixed-width text table: deterministic, so nbval can compare it exactly."""
    return fixed_width(
        [("verdict", "claim", "evidence")] + [("HOLDS" if v.holds else "FAILS", v.claim, v.evidence) for v in verdicts]
    )


def overall_verdict(verdicts: Iterable[Verdict]) -> str:
    verdicts = list(verdicts)
    held = sum(v.holds for v in verdicts)
    return f"{held}/{len(verdicts)} claims hold" if verdicts else "no claims"
