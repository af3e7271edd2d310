""" "Reported" only with the report's link: a post-mortem header says "reported <date> in <the
report>" where someone reported the bug upstream, and "found by our audit, <date>" where nobody did."""

from __future__ import annotations

import dataclasses
import html
import re

import pytest

from postmortems.fa4_unwritten_padding import META as FOUND
from postmortems.torch_varlen_176793 import META as REPORTED
from workbench.registry import Registry


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


def test_every_postmortem_names_its_report_unless_upstream_is_unaware():
    for pm in Registry().postmortems():
        assert bool(pm.meta.report) == (pm.meta.upstream_status != "upstream unaware"), pm.id


_DATES = re.compile(r"<dt>Dates</dt><dd>(.*?)</dd>", re.DOTALL)


def test_page_headers_say_reported_only_with_the_link(published_site):
    for pm in Registry().postmortems():
        dates = html.unescape(_DATES.search((published_site / f"{pm.id}.html").read_text()).group(1))  # type: ignore[union-attr]
        if pm.meta.report:
            assert f'reported {pm.meta.reported} in <a class="wb-link" href="{pm.meta.report}">' in dates, pm.id
        else:
            assert dates.startswith(f"found by our audit, {pm.meta.reported} ") and "reported" not in dates, pm.id
