"""Where each finding stands upstream: one data file, `data/upstream-status.toml`, and its reader.

Every statement of a finding's upstream status renders from that file: the page header and its
"Upstream status" section (`varlen_workbench.workbench.postmortem.Meta.header_markdown` / `upstream_markdown`), the
index row, `varlen-workbench list`, the audit matrix's "known / new?" (`varlen_workbench.workbench.audit.judgements`) and the
GPU audits page. A post-mortem's `cases.py` reads its entry next to META:

    STATUS = finding_status(META.id, __file__)

"Fixed" is said only where the fixed release ran here (`fix shipped`, with the record that shows it);
a fix merged upstream and not run here says so ("fix merged in torch 2.12.0, not run here").

This module reads TOML only (no torch): `varlen-workbench list` answers without importing a post-mortem.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import tomllib

STATUS_FILE = Path("data") / "upstream-status.toml"  # under a project's root (the directory holding postmortems/)
STATUSES = ("none found", "reported", "fix merged", "fix shipped", "not checked")
_FIELDS = {"status", "state", "reference", "fixed_in", "run_here", "checked", "note"}


@dataclass(frozen=True)
class UpstreamStatus:
    """One finding's entry of the status file."""

    finding: str  # the post-mortem id
    status: str  # one of STATUSES
    checked: str  # ISO date the upstream history and trackers were last read for this entry
    note: str
    reference: str = ""  # the upstream report: the url of one of the post-mortem's links
    state: str = ""  # for "reported": what became of the report ("open", "closed, not fixed")
    fixed_in: str = ""  # for "fix merged" / "fix shipped": the release that carries the fix
    run_here: str = ""  # for "fix shipped": the data/gpu record of the fixed release run here

    def __post_init__(self) -> None:
        where = f"upstream status of {self.finding!r}"
        if self.status not in STATUSES:
            raise ValueError(f"{where}: status = {self.status!r} must be one of {STATUSES}.")
        try:
            datetime.date.fromisoformat(self.checked)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: checked = {self.checked!r} must be the ISO date the trackers were read.") from None
        if not self.note.strip():
            raise ValueError(f"{where}: give a note saying what a reader needs to act on it.")
        needs = {
            "none found": {"reference": False, "state": False, "fixed_in": False, "run_here": False},
            "not checked": {"reference": False, "state": False, "fixed_in": False, "run_here": False},
            "reported": {"reference": True, "state": True, "fixed_in": False, "run_here": False},
            "fix merged": {"reference": True, "state": False, "fixed_in": True, "run_here": False},
            "fix shipped": {"reference": True, "state": False, "fixed_in": True, "run_here": True},
        }[self.status]
        for name, required in needs.items():
            if bool(getattr(self, name)) != required:
                verb = "give" if required else "drop"
                raise ValueError(f"{where}: status {self.status!r}: {verb} {name} (see {STATUS_FILE}'s header).")

    @property
    def label(self) -> str:
        """The badge: 'reported (open)', 'fix merged in torch 2.12.0, not run here', 'fixed in X (run here)'."""
        if self.status == "reported":
            return f"reported ({self.state})"
        if self.status == "fix merged":
            return f"fix merged in {self.fixed_in}, not run here"
        if self.status == "fix shipped":
            return f"fixed in {self.fixed_in} (run here)"
        return self.status

    @property
    def css_class(self) -> str:
        """'wb-status-fix-merged', ...: one colour per status (site.css)."""
        return "wb-status-" + re.sub(r"[^a-z]+", "-", self.status).strip("-")

    @property
    def known(self) -> bool:
        """Whether upstream knows of it: a report or a fix exists."""
        return bool(self.reference)

    def sentence(self) -> str:
        """The status and its note, dated: the header's and the index's text."""
        return f"{self.label} (checked {self.checked}). {self.note}"


def parse(data: dict, source: str = str(STATUS_FILE)) -> dict[str, UpstreamStatus]:
    """{finding id: UpstreamStatus} from the file's parsed TOML; ValueError naming what is wrong."""
    found = {}
    for finding, entry in data.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: [{finding}] must be a table of {sorted(_FIELDS)}.")
        extra = set(entry) - _FIELDS
        if extra:
            raise ValueError(f"{source}: [{finding}] has unknown fields {sorted(extra)}; the fields are {sorted(_FIELDS)}.")
        missing = {"status", "checked", "note"} - set(entry)
        if missing:
            raise ValueError(f"{source}: [{finding}] lacks {sorted(missing)}.")
        try:
            found[finding] = UpstreamStatus(finding, **entry)
        except ValueError as error:  # say which file holds the entry to mend
            raise ValueError(f"{source}: [{finding}]: {str(error).split(': ', 1)[1]}") from None
    return found


@cache
def _read(path: Path, stamp: tuple[int, int]) -> dict[str, UpstreamStatus]:
    """The parsed file; `stamp` (mtime, size) makes an edited file read again (`varlen-workbench new` appends to it)."""
    with open(path, "rb") as handle:
        return parse(tomllib.load(handle), str(path))


def statuses(root: Path) -> dict[str, UpstreamStatus]:
    """Every entry of `root`'s status file ({} when the project has none yet)."""
    path = (Path(root) / STATUS_FILE).resolve()
    if not path.exists():
        return {}
    stat = path.stat()
    return _read(path, (stat.st_mtime_ns, stat.st_size))


def project_root(module_file: str | Path) -> Path:
    """The project root above a post-mortem's file: the nearest directory holding the status file."""
    here = Path(module_file).resolve()
    for directory in here.parents:
        if (directory / STATUS_FILE).exists():
            return directory
    raise FileNotFoundError(f"no {STATUS_FILE} above {here}: the project's upstream statuses live there.")


def finding_status(finding: str, module_file: str | Path) -> UpstreamStatus:
    """The entry of `finding` in the status file of the project holding `module_file`."""
    root = project_root(module_file)
    found = statuses(root)
    if finding not in found:
        raise KeyError(f"{root / STATUS_FILE} has no entry [{finding}]: add one (status, checked, note; see the file's header).")
    status = found[finding]
    if status.run_here and not (root / "data" / "gpu" / status.run_here).exists():
        raise FileNotFoundError(
            f"{root / STATUS_FILE} [{finding}]: run_here = {status.run_here!r} is no record under data/gpu/; "
            "'fix shipped' needs the record of the fixed release run here."
        )
    return status


def scaffold_entry(finding: str, today: str) -> str:
    """The entry `varlen-workbench new` appends for a new post-mortem: nobody searched the trackers yet."""
    return (
        f'\n[{finding}]\nstatus = "not checked"\nchecked = "{today}"\n'
        'note = "Not searched yet: search the upstream trackers and history, then set status, reference and note."\n'
    )


__all__ = ["STATUSES", "STATUS_FILE", "UpstreamStatus", "finding_status", "parse", "project_root", "scaffold_entry", "statuses"]
