"""The post-mortem toolkit: everything a module `postmortems/<id>.py` and its notebook use.

A post-mortem module defines

* `META = Meta(...)`: the single source of the page header, the upstream-status timeline and
  the site's index row; beside it `STATUS = finding_status(META.id, __file__)`, its entry of
  data/upstream-status.toml (`varlen_workbench.workbench.upstream_status`), where upstream stands;
* `CASES`: the `varlen_workbench.workbench.layout.Case`s it studies;
* `reproduce(device=None) -> Results`: runs the study and returns a `Results` dataclass;
* `claims = Claims()`: checkable statements about those results, each registered with the
  evidence that produced it, `@claims("statement", evidence=REPLICA)`, as a function
  `results -> (holds: bool, evidence: str)`;
* optionally `gpu_probes(device) -> dict`: extra measurements `varlen-workbench repro --record` adds to
  a GPU record (what only a GPU run of the upstream code can show).

and shows its findings with the same few tools: `table()` for every table, `figure()` for every
figure, `gpu_records(META)` for what GPU machines recorded. The notebook opens with the reader
block (`READER_SECTIONS`, in order, before any mechanism) and ends with
`claims.report(results)`, which shows the verdict table (compared exactly by nbval), carries the
verdicts in the output's metadata for the site, and raises naming every claim that fails.
"""

from __future__ import annotations

import datetime
import html
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from varlen_workbench.workbench.records import jsonable, load_records
from varlen_workbench.workbench.tables import fixed_width
from varlen_workbench.workbench.upstream_status import UpstreamStatus

CATEGORIES = ("training bug", "tooling bug")
# The reader block: the first sections of every post-mortem notebook, in this order, before any
# mechanism or code of ours. `varlen-workbench new` scaffolds them and the registry checks them.
READER_SECTIONS = ("TL;DR", "Who is affected", "Check your run", "Workarounds", "Upstream status")
METADATA_KEY = "workbench"  # output metadata of the claims cell: the verdicts, for the site


# -- evidence -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """What produced a claim's evidence. `LEVELS` orders the kinds from strongest to weakest;
    "ours" (our own kernel, run here) says nothing about upstream and never ranks a page."""

    kind: str
    at: str = ""  # for "source": the upstream repository and commit read, "owner/repo@sha"

    LEVELS = ("upstream-gpu", "upstream-cpu", "replica", "toy", "source", "ours")
    _LABELS = {
        "upstream-gpu": "upstream code on GPU",
        "upstream-cpu": "upstream code on CPU (interpreter)",
        "replica": "our replica of the upstream mechanism",
        "toy": "toy model",
        "source": "reading the upstream source at {at}",
        "ours": "our fixed kernel, run here",
    }
    _SHORT = {
        "upstream-gpu": "upstream GPU",
        "upstream-cpu": "upstream CPU",
        "replica": "replica",
        "toy": "toy model",
        "source": "source",
        "ours": "our kernel",
    }

    def __post_init__(self) -> None:
        if self.kind not in self.LEVELS:
            raise ValueError(f"Evidence kind {self.kind!r} must be one of {self.LEVELS}.")
        if (self.kind == "source") != bool(self.at):
            raise ValueError("Evidence: give `at` ('owner/repo@commit') exactly for kind 'source'; use source_at(...).")

    @property
    def label(self) -> str:
        """The label a reader sees, e.g. 'our replica of the upstream mechanism'."""
        return self._LABELS[self.kind].format(at=self.at)

    @property
    def short(self) -> str:
        """The label in a table column: 'replica', 'upstream GPU', 'source'."""
        return self._SHORT[self.kind]

    @property
    def rank(self) -> int:
        return self.LEVELS.index(self.kind)

    @property
    def about_upstream(self) -> bool:
        return self.kind != "ours"


UPSTREAM_GPU = Evidence("upstream-gpu")
UPSTREAM_CPU = Evidence("upstream-cpu")
REPLICA = Evidence("replica")
TOY = Evidence("toy")
OURS = Evidence("ours")
_COMMIT_REF = re.compile(r"^[\w.-]+/[\w.-]+@[0-9a-f]{7,40}$")


def source_at(ref: str) -> Evidence:
    """Evidence from reading upstream source at a named commit: `source_at("NVIDIA/TransformerEngine@1a2b3c4")`."""
    if not _COMMIT_REF.match(ref):
        raise ValueError(f"source_at({ref!r}): give 'owner/repo@<commit sha, 7 to 40 hex digits>', the commit you read.")
    return Evidence("source", ref)


# -- metadata -------------------------------------------------------------------------------------


def _iso(value: str, what: str) -> datetime.date:
    try:
        return datetime.date.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} = {value!r} must be an ISO date (YYYY-MM-DD).") from None


@dataclass(frozen=True)
class Link:
    """An upstream reference. With a `date`, it is an event of the upstream-status timeline:
    `kind` says what it is (issue, PR, commit, release, docs) and `status` what became of it."""

    label: str
    url: str
    date: str = ""  # ISO date of the event (opened, merged, committed, released)
    kind: str = ""
    status: str = ""  # e.g. "open", "closed, not merged", "merged", "in 1.2.3"

    KINDS = ("", "issue", "PR", "commit", "release", "docs", "thread")

    @property
    def name(self) -> str:
        """The label up to its first colon, e.g. "pytorch#176793"."""
        return self.label.split(":")[0]

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"Link.kind = {self.kind!r} must be one of {self.KINDS}.")
        if not self.url.startswith("https://"):
            raise ValueError(f"Link {self.label!r}: url {self.url!r} must be an https:// address.")
        if self.date:
            _iso(self.date, f"Link {self.label!r} date")
        if self.kind in ("PR", "issue") and re.search(rf"\b{self.kind}\b", self.name, re.IGNORECASE):
            raise ValueError(
                f"Link {self.label!r}: the timeline puts its kind ({self.kind!r}) before the label, so a label naming "
                f"it again reads '{self.kind} {self.name}'; name it as 'project#number' instead."
            )


@dataclass(frozen=True)
class Meta:
    """A post-mortem's identity card: the page header, the upstream timeline, the index row.

    Upstream's status lives apart, in data/upstream-status.toml (`varlen_workbench.workbench.upstream_status`: the
    module's `STATUS`), and is kept apart from ours (`our_verdict`): "open upstream" and "the
    report's claim is wrong" are different facts.
    """

    id: str
    title: str
    component: str  # the upstream software and the piece of it, e.g. "PyTorch / varlen_attn"
    category: str  # one of CATEGORIES: does it damage training, or mislead the tools?
    # One line for the index: what breaks and how badly. Each {figure} in it is filled in by the
    # module's impact_figures() from the committed records (a figure is never typed).
    impact: str
    our_verdict: str  # what we verified of the report, e.g. "mechanism confirmed; the proposed fix is wrong"
    detection: str  # how the bug shows itself to a user
    fix_type: str  # what kind of fix upstream tried and what we propose
    tags: tuple[str, ...]
    reported: str  # ISO date of the upstream report itself (the status's reference); without one, the date we found the bug
    published: str  # ISO date this post-mortem first appeared
    revised: str = ""  # ISO date of its last factual revision
    links: tuple[Link, ...] = ()
    seed: str = ""  # file name of the original report's text in shared/seeds, if any (never shown on a page)

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"Meta.category = {self.category!r} must be one of {CATEGORIES}.")
        if not re.fullmatch(r"[a-z][a-z0-9-]*", self.id or ""):
            raise ValueError(f"Meta.id = {self.id!r} must be lowercase letters, digits and '-', starting with a letter.")
        reported, published = _iso(self.reported, "Meta.reported"), _iso(self.published, "Meta.published")
        latest = _iso(self.revised, "Meta.revised") if self.revised else published
        if published < reported or latest < published:
            raise ValueError(
                f"Meta dates out of order: reported {self.reported}, published {self.published}, revised {self.revised}."
            )
        for link in self.links:
            if link.date and _iso(link.date, "link date") > latest:
                raise ValueError(
                    f"Meta: link {link.label!r} is dated {link.date}, after this post-mortem's last revision "
                    f"({latest}); set Meta.revised to the date you cited it."
                )

    @property
    def timeline(self) -> list[Link]:
        """The dated links, oldest first: the upstream-status section's rows."""
        return sorted((link for link in self.links if link.date), key=lambda link: link.date)

    def check_status(self, status: UpstreamStatus) -> None:
        """Raises ValueError unless `status` is this post-mortem's and its reference is one of the links."""
        if status.finding != self.id:
            raise ValueError(f"Meta {self.id!r} was given the upstream status of {status.finding!r}.")
        if status.reference and status.reference not in {link.url for link in self.links}:
            raise ValueError(
                f"the upstream status of {self.id!r} names reference {status.reference!r}, which is none of META's links: "
                "add the report as a link (the header links it)."
            )

    def origin(self, status: UpstreamStatus) -> tuple[str, Link | None]:
        """How the bug came to light, for the header: ("reported <date> in", the report's link), or
        ("found by our audit, <date>", None) where no upstream report was found ("reported <date>"
        while the trackers are not searched yet: a scaffold)."""
        self.check_status(status)
        report = next((link for link in self.links if link.url == status.reference), None)
        if report is not None:
            return f"reported {self.reported} in", report
        if status.status == "none found":
            return f"found by our audit, {self.reported}", None
        return f"reported {self.reported}", None

    def header_markdown(self, status: UpstreamStatus) -> str:
        """The notebook's header cell (the site renders the same facts from META and the status)."""
        revised = f" · revised {self.revised}" if self.revised else ""
        text, report = self.origin(status)
        origin = text[0].upper() + text[1:] + (f" [{report.name}]({report.url})" if report else "")
        return "\n".join(
            [
                f"# {self.title}",
                "",
                f"**{self.id}** · {self.component} · {self.category}",
                "",
                f"Upstream: **{status.label}** ({status.note}) · Our verdict: **{self.our_verdict}**",
                "",
                f"{origin} · Published {self.published}{revised} · Tags: {', '.join(self.tags)}",
            ]
        )

    def upstream_markdown(self, status: UpstreamStatus) -> str:
        """The 'Upstream status' section: the status (dated), then every dated event with its link."""
        self.check_status(status)
        lines = [
            f"**Upstream status: {status.label}** (checked {status.checked}). {status.note}",
            "",
            f"**Our verdict** (kept apart from upstream's): {self.our_verdict}.",
        ]
        if self.timeline:
            lines += ["", "| date | what | status |", "|---|---|---|"]
            lines += [f"| {e.date} | {e.kind} [{e.label}]({e.url}) | {e.status} |" for e in self.timeline]
        else:
            lines += [
                "",
                "No upstream issue, pull request or fix yet (the status above says when the trackers were last searched).",
            ]
        undated = [link for link in self.links if not link.date]
        if undated:
            lines += ["", "Also: " + " · ".join(f"[{link.label}]({link.url})" for link in undated)]
        return "\n".join(lines)


# -- results, tables, figures, GPU records --------------------------------------------------------


@dataclass
class Results:
    """Base of a post-mortem's results: a dataclass of everything `reproduce()` measured.
    `summary()` is what `varlen-workbench repro --record` writes (tensors small enough as values)."""

    def summary(self) -> dict[str, Any]:
        return {f.name: jsonable(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class Table:
    """A table of strings: fixed-width text (what nbval compares and a terminal prints) and an
    HTML table on the site. Rows past `fold` are folded behind a "more rows" toggle there."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    title: str = ""
    fold: int = 12

    def __str__(self) -> str:
        text = fixed_width([self.header, *self.rows])
        return f"{self.title}\n{text}" if self.title else text

    __repr__ = __str__

    def _repr_html_(self) -> str:
        def row(cells: Sequence[str], tag: str = "td") -> str:
            return "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>"

        head = f"<thead>{row(self.header, 'th')}</thead>"
        shown, folded = self.rows[: self.fold], self.rows[self.fold :]
        body = "<tbody>" + "".join(row(r) for r in shown) + "</tbody>"
        more = ""
        if folded:
            more = (
                f'<tbody class="wb-folded-rows" hidden>{"".join(row(r) for r in folded)}</tbody>'
                f'<tfoot><tr><td colspan="{len(self.header)}"><button type="button" class="wb-more-rows">'
                f"{len(folded)} more rows</button></td></tr></tfoot>"
            )
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f'<table class="wb-table">{caption}{head}{body}{more}</table>'


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str = "", fold: int = 12) -> Table:
    """The one table of a post-mortem: strings as given, floats to 3 significant digits.
    End a cell with it (not `print`) so the site shows an HTML table."""
    header = tuple(header)
    body = tuple(tuple(_cell(v) for v in r) for r in rows)
    for i, r in enumerate(body):
        if len(r) != len(header):
            raise ValueError(f"table(): row {i} has {len(r)} cells for {len(header)} columns ({header}).")
    return Table(header, body, title, fold)


def figure(nrows: int = 1, ncols: int = 1, *, width: float = 7.0, height: float = 2.6, **kwargs: Any):
    """The one figure of a post-mortem: `(fig, axes)`, axes a 2-D array, in the house style
    (white face, constrained layout, no pyplot state). A cell ending with `fig` shows it."""
    from varlen_workbench.workbench.plots import figure as _plots_figure

    return _plots_figure(nrows, ncols, width=width, height=height, **kwargs)


def gpu_records(meta: Meta) -> list[dict[str, Any]]:
    """What GPU machines recorded for this post-mortem: every `data/gpu/<id>-*.json` written by
    `varlen-workbench repro ID --device cuda --record data/gpu/ID-<gpu>.json`, oldest file name first,
    each with `provenance` (GPU, versions, commit, date, command). [] when none was recorded."""
    return load_records(f"{meta.id}-*.json")


def recorded_probes(record: dict[str, Any] | None, meta: Meta) -> dict[str, Any]:
    """The `probes` of a GPU record (`latest_gpu_record`), for a claim about them: without a
    record, `NotRecorded` naming the command that makes one, so that the claim is shown NOT
    RECORDED with that command as its evidence (rather than vanishing from the page)."""
    if record is None:
        raise NotRecorded(
            f"no GPU record of {meta.id}: record one with `varlen-workbench repro {meta.id} --device cuda "
            f"--record data/gpu/{meta.id}-<gpu>.json`"
        )
    return record["probes"]


def latest_gpu_record(meta: Meta, probe: str | None = None) -> dict[str, Any] | None:
    """The most recently made (provenance date) of `gpu_records(meta)`, among those whose
    `probes` carry `probe` when it is given; None when there is none (a claim about it then
    says so in its evidence)."""
    records = [r for r in gpu_records(meta) if probe is None or probe in r.get("probes", {})]
    return max(records, key=lambda r: r["provenance"].get("date", "")) if records else None


# -- claims ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimVerdict:
    """One claim checked: the statement, whether it holds, the evidence text and its level.

    `unrecorded`: the claim is about a GPU record that nobody has made yet (its check raised
    `NotRecorded`): it does not hold, and it has not failed either; the verdict table says
    NOT RECORDED and the evidence names the command that records it."""

    claim: str
    holds: bool
    evidence: str
    level: Evidence
    unrecorded: bool = False

    @property
    def failed(self) -> bool:
        return not self.holds and not self.unrecorded

    @property
    def verdict(self) -> str:
        return "HOLDS" if self.holds else "NOT RECORDED" if self.unrecorded else "FAILS"

    def to_dict(self) -> dict[str, Any]:
        data = {
            "claim": self.claim,
            "holds": self.holds,
            "evidence": self.evidence,
            "level": self.level.kind,
            "at": self.level.at,
        }
        return {**data, "unrecorded": True} if self.unrecorded else data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClaimVerdict:
        level = Evidence(data["level"], data.get("at", ""))
        return cls(data["claim"], bool(data["holds"]), data["evidence"], level, bool(data.get("unrecorded", False)))


class NotRecorded(LookupError):
    """Raised by a claim's check when the GPU record it reads does not exist (see `recorded_probes`)."""


class ClaimFailed(AssertionError):
    """Raised by `Claims.report` when a claim no longer holds; names every failing claim."""


def _evaluate(statement: str, level: Evidence, check: Callable[[Any], tuple[bool, str]], results: Any) -> ClaimVerdict:
    unrecorded = False
    try:
        holds, evidence = check(results)
    except NotRecorded as exc:  # shown as NOT RECORDED, with the command that records it
        holds, evidence, unrecorded = False, str(exc), True
    except Exception as exc:  # a broken check must show up as a failed claim, not vanish
        holds, evidence = False, f"check raised {type(exc).__name__}: {exc}"
    return ClaimVerdict(statement, bool(holds), evidence, level, unrecorded)


@dataclass
class Claims:
    """An ordered set of named claims about a post-mortem's results, each with its evidence level.

    One claim is the headline (`headline=True`): the bug itself, as shown; its evidence level is the
    one the index gives the post-mortem (a GPU control or our kernel's run says nothing of how the
    bug was shown)."""

    _checks: list[tuple[str, Evidence, Callable[[Any], tuple[bool, str]]]] = field(default_factory=list)
    headline: str = ""  # the statement of the headline claim

    def __call__(self, statement: str, *, evidence: Evidence, headline: bool = False) -> Callable:
        if any(statement == s for s, _, _ in self._checks):
            raise ValueError(f"claim {statement!r} is registered twice.")
        if headline and self.headline:
            raise ValueError(f"claims {self.headline!r} and {statement!r} are both the headline; keep one.")
        if not isinstance(evidence, Evidence):
            raise TypeError(
                f"claim {statement!r}: evidence must be a varlen_workbench.workbench.postmortem.Evidence (UPSTREAM_GPU, UPSTREAM_CPU, "
                f"REPLICA, TOY, OURS or source_at('owner/repo@commit')), got {evidence!r}."
            )

        def register(check: Callable[[Any], tuple[bool, str]]) -> Callable[[Any], tuple[bool, str]]:
            self._checks.append((statement, evidence, check))
            if headline:
                self.headline = statement
            return check

        return register

    def __len__(self) -> int:
        return len(self._checks)

    @property
    def statements(self) -> list[str]:
        return [s for s, _, _ in self._checks]

    @property
    def levels(self) -> list[Evidence]:
        return [e for _, e, _ in self._checks]

    @property
    def headline_level(self) -> Evidence:
        """The evidence that showed the bug itself: the headline claim's level."""
        return next(e for s, e, _ in self._checks if s == self.headline)

    def check(self, results: Any, starting: Callable[[int, str], None] | None = None) -> list[ClaimVerdict]:
        """Evaluates every claim; a check that raises is a claim that does not hold. `starting(i,
        statement)` hears of each claim before it is checked (`varlen-workbench repro`'s progress)."""
        verdicts = []
        for i, (statement, level, check) in enumerate(self._checks):
            if starting:
                starting(i, statement)
            verdicts.append(_evaluate(statement, level, check, results))
        return verdicts

    def verdict(self, results: Any, prefix: str) -> ClaimVerdict:
        """The one claim whose statement starts with `prefix`, evaluated alone."""
        found = [c for c in self._checks if c[0].startswith(prefix)]
        if len(found) != 1:
            raise KeyError(f"{len(found)} claims start with {prefix!r}; the statements are {self.statements}")
        return _evaluate(*found[0], results)

    def report(self, results: Any) -> list[ClaimVerdict]:
        """Shows the verdict table (text for nbval and terminals, HTML and the verdicts as output
        metadata in a notebook); raises `ClaimFailed` naming the claims that do not hold (a claim
        whose GPU record was never made is shown NOT RECORDED, and raises nothing)."""
        verdicts = self.check(results)
        _show_verdicts(verdicts)
        failed = [v for v in verdicts if v.failed]
        if failed:
            names = "; ".join(f"{v.claim!r} ({v.evidence})" for v in failed)
            raise ClaimFailed(f"{len(failed)} of {len(verdicts)} claims do not hold: {names}")
        return verdicts


def claims_table(verdicts: Iterable[ClaimVerdict]) -> Table:
    """verdict, evidence level, claim, evidence: deterministic, so nbval compares it exactly."""
    return table(
        ("verdict", "level", "claim", "evidence"),
        ((v.verdict, v.level.short, v.claim, v.evidence) for v in verdicts),
        fold=1000,
    )


def _show_verdicts(verdicts: list[ClaimVerdict]) -> None:
    shown = claims_table(verdicts)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(shown)
        return
    display(
        {"text/plain": str(shown), "text/html": shown._repr_html_()},
        raw=True,
        metadata={METADATA_KEY: {"claims": [v.to_dict() for v in verdicts]}},
    )


def overall_verdict(verdicts: Iterable[ClaimVerdict]) -> str:
    verdicts = list(verdicts)
    held = sum(v.holds for v in verdicts)
    unrecorded = sum(v.unrecorded for v in verdicts)
    awaiting = f"; {unrecorded} await a GPU record" if unrecorded else ""
    return f"{held}/{len(verdicts)} claims hold{awaiting}" if verdicts else "no claims"
