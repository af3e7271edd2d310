"""Ready-to-file upstream reports (varlen_workbench.workbench.upstream_report): what a maintainer gets, and the rules a
report keeps. Each repro runs, as its page shows it, in the paste-block battery (tests/test_snippets.py)."""

import pytest

from varlen_workbench.postmortems import (
    fa4_unwritten_padding,
    flash_dmattn_flex_mask,
    fsa_varlen_descriptors,
    sdpa_cudnn_masked_rows,
)
from varlen_workbench.workbench.audit.reports import REPORTS as AUDIT_REPORTS
from varlen_workbench.workbench.upstream_report import REPRO_LINES, Source, UpstreamReport

EVERY = (
    fa4_unwritten_padding.REPORT,
    flash_dmattn_flex_mask.REPORT,
    sdpa_cudnn_masked_rows.REPORT,
    *fsa_varlen_descriptors.REPORTS,
    *AUDIT_REPORTS,
)


def _report(**changes):
    fields = dict(
        title="t",
        file_at="https://example.org/issues/new",
        versions=("lib 1.0",),
        repro="# lib 1.0: the bug\nprint(1)\n",
        prints=("1",),
        expected="e.",
        actual="a.",
        shown="the CPU",
        suspected=(Source("lib/x.py", 3, "org/lib@abc1234", "x = empty()", "https://example.org/x.py#L3"),),
        fix="f.",
    )
    return UpstreamReport(**{**fields, **changes})


def test_the_issue_text_has_what_a_maintainer_needs():
    text = _report().markdown()
    for part in ("**Title:** t", "**Versions:**", "```python\n# lib 1.0: the bug\nprint(1)\n```", "* `1`", "**Expected:** e.",
                 "**Actual:** a. *Where shown:* the CPU.", "[`lib/x.py:3`](https://example.org/x.py#L3) (org/lib@abc1234): `x = empty()`",
                 "**Suggested fix:** f."):  # fmt: skip
        assert part in text, part
    assert _report().name == "lib 1.0: the bug"
    assert "`lib/x.py` (a diff)" in Source("lib/x.py", None, "a diff", "x").markdown()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"repro": "print(1)\n"}, "starts with a '# ' comment"),
        ({"repro": "# bug\n" + "x = 1\n" * REPRO_LINES}, "keep it to"),
        ({"file_at": "github.com/x"}, "https://"),
        ({"suspected": ()}, "suspected upstream line"),
    ],
)
def test_a_report_without_what_it_needs_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        _report(**changes)


@pytest.mark.parametrize("report", EVERY, ids=[r.name for r in EVERY])
def test_every_report_names_its_repro_uniquely_and_says_what_it_prints(report):
    assert report.prints and report.suspected and report.versions
    assert [r.name for r in EVERY].count(report.name) == 1
