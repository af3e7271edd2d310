""" "Reported" only with the report's link: a post-mortem header says "reported <date> in <the
report>" where someone reported the bug upstream (its status names the report), and "found by our
audit, <date>" where no upstream report was found."""

from __future__ import annotations

import dataclasses
import html
import re

import pytest

from varlen_workbench.postmortems.fa4_unwritten_padding import META as FOUND
from varlen_workbench.postmortems.fa4_unwritten_padding import STATUS as FOUND_STATUS
from varlen_workbench.postmortems.torch_varlen_176793 import META as REPORTED
from varlen_workbench.postmortems.torch_varlen_176793 import STATUS as REPORTED_STATUS
from varlen_workbench.workbench.registry import Registry


def test_a_reported_bug_names_its_report_and_links_it():
    text, report = REPORTED.origin(REPORTED_STATUS)
    assert (text, report and report.name) == ("reported 2026-03-07 in", "pytorch#176793")
    assert "Reported 2026-03-07 in [pytorch#176793](https://github.com/pytorch/pytorch/issues/176793)" in (
        REPORTED.header_markdown(REPORTED_STATUS)
    )


def test_a_bug_nobody_reported_says_who_found_it():
    assert FOUND.origin(FOUND_STATUS) == ("found by our audit, 2026-12-01", None)
    assert "Found by our audit, 2026-12-01 ·" in FOUND.header_markdown(FOUND_STATUS)
    assert "Reported" not in FOUND.header_markdown(FOUND_STATUS)


def test_a_report_must_be_one_of_the_links_and_the_status_its_own():
    with pytest.raises(ValueError, match="none of META's links"):
        REPORTED.origin(dataclasses.replace(REPORTED_STATUS, reference="https://github.com/pytorch/pytorch/issues/1"))
    with pytest.raises(ValueError, match="was given the upstream status of 'fa4-unwritten-padding'"):
        REPORTED.origin(FOUND_STATUS)


def test_every_postmortem_names_its_report_where_upstream_knows():
    for pm in Registry().postmortems():
        assert bool(pm.status.reference) == (pm.status.status in ("reported", "fix merged", "fix shipped")), pm.id


def test_a_fresh_scaffold_passes_and_a_status_missing_its_report_names_the_file_the_field_and_the_fix(project):
    """`varlen-workbench new` then `make test` passes (the entry it adds is "not checked"); a status that
    says "reported" without its reference fails naming the status file, the entry and the fix."""
    from varlen_workbench.workbench.errors import RegistryError
    from varlen_workbench.workbench.registry import forget_modules
    from varlen_workbench.workbench.upstream_status import STATUS_FILE

    project.scaffold("my-bug", "A title")
    assert project.get("my-bug").status.status == "not checked"
    status_file = project.root / STATUS_FILE
    status_file.write_text(status_file.read_text().replace('status = "not checked"', 'status = "reported"\nstate = "open"'))
    forget_modules(f"{project.package}.my_bug")
    with pytest.raises(RegistryError) as error:
        project.get("my-bug")
    assert f"{status_file}: [my-bug]: status 'reported': give reference" in str(error.value), str(error.value)


_DATES = re.compile(r"<dt>Dates</dt><dd>(.*?)</dd>", re.DOTALL)


def test_page_headers_say_reported_only_with_the_link(published_site):
    for pm in Registry().postmortems():
        dates = html.unescape(_DATES.search((published_site / f"{pm.id}.html").read_text()).group(1))  # type: ignore[union-attr]
        if pm.status.reference:
            assert f'reported {pm.meta.reported} in <a class="wb-link" href="{pm.status.reference}">' in dates, pm.id
        else:
            assert dates.startswith(f"found by our audit, {pm.meta.reported} ") and "reported" not in dates, pm.id
