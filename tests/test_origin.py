""" "Reported" only with the report's link: a post-mortem header says "reported <date> in <the
report>" where someone reported the bug upstream, and "found by our audit, <date>" where nobody did."""

from __future__ import annotations

import dataclasses
import html
import re
from pathlib import Path

import pytest

from postmortems.fa4_unwritten_padding import META as FOUND
from postmortems.torch_varlen_176793 import META as REPORTED
from workbench.registry import Registry, forget_modules

ROOT = Path(__file__).resolve().parent.parent


def test_a_reported_bug_names_its_report_and_links_it():
    text, report = REPORTED.origin()
    assert (text, report and report.name) == ("reported 2026-03-07 in", "pytorch#176793")
    assert "Reported 2026-03-07 in [pytorch#176793](https://github.com/pytorch/pytorch/issues/176793)" in (
        REPORTED.header_markdown()
    )


def test_a_bug_nobody_reported_says_who_found_it():
    assert FOUND.origin() == ("found by our audit, 2026-12-01", None)
    assert "Found by our audit, 2026-12-01 ·" in FOUND.header_markdown()
    assert "Reported" not in FOUND.header_markdown()


def test_a_report_must_be_one_of_the_links_and_contradicts_upstream_unaware():
    with pytest.raises(ValueError, match="must be the url of one of Meta.links"):
        dataclasses.replace(REPORTED, report="https://github.com/pytorch/pytorch/issues/1")
    with pytest.raises(ValueError, match="'upstream unaware' with a report"):
        dataclasses.replace(REPORTED, upstream_status="upstream unaware")


def report_problem(pm) -> str | None:
    """Why `pm`'s META breaks the rule "a report exactly where upstream knows", naming the file,
    the field and the fix; None when it keeps it."""
    source = Path(pm.module.__file__)
    cases = source.parent / "cases.py" if source.name == "__init__.py" else source
    where = f"{pm.id}: META in {cases.relative_to(ROOT) if cases.is_relative_to(ROOT) else cases}"
    if pm.meta.upstream_status != "upstream unaware" and not pm.meta.report:
        return (
            f'{where} has upstream_status={pm.meta.upstream_status!r} but report="": set report= to the url of '
            'the upstream report (add it to links first), or upstream_status="upstream unaware" if nobody reported it.'
        )
    if pm.meta.upstream_status == "upstream unaware" and pm.meta.report:
        return f"{where} names report={pm.meta.report!r} with upstream_status 'upstream unaware': give the status it got."
    return None


def test_every_postmortem_names_its_report_unless_upstream_is_unaware():
    problems = [p for pm in Registry().postmortems() if (p := report_problem(pm))]
    assert not problems, "\n".join(problems)


def test_the_report_rule_names_the_file_the_field_and_the_fix(project):
    """A fresh scaffold keeps the rule (`workbench new` then `make test` passes); marked open
    without a report, the failure says where and what to fill."""
    package_path, _ = project.scaffold("my-bug", "A title")
    assert project.get("my-bug").meta.upstream_status == "upstream unaware" and report_problem(project.get("my-bug")) is None
    cases = package_path / "cases.py"
    cases.write_text(cases.read_text().replace('upstream_status="upstream unaware"', 'upstream_status="open"'))
    forget_modules(f"{project.package}.my_bug")
    assert report_problem(project.get("my-bug")) == (
        f"my-bug: META in {cases} has upstream_status='open' but report=\"\": set report= to the url of "
        'the upstream report (add it to links first), or upstream_status="upstream unaware" if nobody reported it.'
    )


_DATES = re.compile(r"<dt>Dates</dt><dd>(.*?)</dd>", re.DOTALL)


def test_page_headers_say_reported_only_with_the_link(published_site):
    for pm in Registry().postmortems():
        dates = html.unescape(_DATES.search((published_site / f"{pm.id}.html").read_text()).group(1))  # type: ignore[union-attr]
        if pm.meta.report:
            assert f'reported {pm.meta.reported} in <a class="wb-link" href="{pm.meta.report}">' in dates, pm.id
        else:
            assert dates.startswith(f"found by our audit, {pm.meta.reported} ") and "reported" not in dates, pm.id
