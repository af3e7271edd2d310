"""A ready-to-file upstream report for a finding upstream does not know.

`UpstreamReport` holds what a maintainer wants in an issue: the versions, a repro of at most about
30 lines, expected against actual behaviour, the suspected line of upstream code (file, line, and
the commit or wheel it was read at) and a suggested fix. A page's section "Report it upstream"
renders it with `Markdown(report.markdown())`; the repro becomes a block a reader can copy, and
the paste-block battery (tests/test_snippets.py) runs it exactly as shown: on the CPU where it can
run, and where it needs a GPU, against the page's stand-in, with `shown` naming the GPU record
that holds the library's own behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

REPRO_LINES = 32  # "at most about 30 lines": what a maintainer reads before deciding to look


@dataclass(frozen=True)
class Source:
    """A line of upstream code a report points at, as read at `at` (a commit or a wheel)."""

    path: str
    line: int | None  # None: the function is named in `code`, no line number was read
    at: str  # "owner/repo@commit", or "<package> <version> wheel", or the diff it was read in
    code: str  # the line (or the statement) as it reads there
    url: str = ""  # a permalink, where the code was read in a repository

    def markdown(self) -> str:
        name = self.path if self.line is None else f"{self.path}:{self.line}"
        where = f"[`{name}`]({self.url})" if self.url else f"`{name}`"
        return f"{where} ({self.at}): `{self.code}`"


@dataclass(frozen=True)
class UpstreamReport:
    """An issue (or, where upstream knows the bug, a comment) ready to file. `repro` starts with a
    comment line that names the bug (the battery knows the block by it) and prints `prints`; `actual`
    says what upstream does, and `shown` where that was shown: the CPU run here, or a GPU record."""

    title: str
    file_at: str  # the tracker's new-issue address, or the issue or PR to comment on
    versions: tuple[str, ...]
    repro: str
    prints: tuple[str, ...]  # what the repro prints where `shown` says it ran (the battery checks it)
    expected: str
    actual: str
    shown: str
    suspected: tuple[Source, ...]
    fix: str
    related: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        lines = self.repro.strip().splitlines()
        if not lines or not lines[0].startswith("# "):
            raise ValueError(f"UpstreamReport {self.title!r}: the repro starts with a '# ' comment naming the bug.")
        if len(lines) > REPRO_LINES:
            raise ValueError(f"UpstreamReport {self.title!r}: the repro has {len(lines)} lines; keep it to {REPRO_LINES}.")
        if not self.file_at.startswith("https://"):
            raise ValueError(f"UpstreamReport {self.title!r}: file_at = {self.file_at!r} must be an https:// address.")
        if not self.suspected:
            raise ValueError(f"UpstreamReport {self.title!r}: name the suspected upstream line (Source).")

    @property
    def name(self) -> str:
        """The repro's first line without its '# ': how the battery names the block."""
        return self.repro.strip().splitlines()[0][2:]

    def markdown(self) -> str:
        """The issue text, for a maintainer: title, where to file, versions, repro, expected, actual,
        the suspected code, the suggested fix."""
        parts = [
            f"**Title:** {self.title}  \n**File at:** <{self.file_at}>",
            "**Versions:**\n\n" + "\n".join(f"* {v}" for v in self.versions),
            f"**Reproduction:**\n\n```python\n{self.repro.strip()}\n```",
            "It prints:\n\n" + "\n".join(f"* `{line}`" for line in self.prints),
            f"**Expected:** {self.expected}",
            f"**Actual:** {self.actual} *Where shown:* {self.shown}.",
            "**Where:**\n\n" + "\n".join(f"* {source.markdown()}" for source in self.suspected),
            f"**Suggested fix:** {self.fix}",
        ]
        if self.related:
            parts.append("**Related:**\n\n" + "\n".join(f"* {r}" for r in self.related))
        return "\n\n".join(parts)
