"""One source for upstream status: data/upstream-status.toml, read by varlen_workbench.workbench.upstream_status.

Every post-mortem has an entry, dated; "fixed" is said only where the fixed release ran here;
the header, the index, the matrix's "known / new?" and `varlen-workbench list` all say what the file says."""

from __future__ import annotations

import re

import pytest
from markupsafe import escape

from varlen_workbench.workbench.provenance import REPO
from varlen_workbench.workbench.registry import Registry
from varlen_workbench.workbench.upstream_status import STATUS_FILE, UpstreamStatus, finding_status, parse, statuses


def _entry(**fields):
    return {"status": "none found", "checked": "2026-12-05", "note": "searched", **fields}


def test_each_status_says_what_a_reader_needs():
    merged = UpstreamStatus("x", "fix merged", "2026-12-05", "n", reference="https://r", fixed_in="torch 2.12.0")
    assert merged.label == "fix merged in torch 2.12.0, not run here" and merged.css_class == "wb-status-fix-merged"
    shipped = UpstreamStatus("x", "fix shipped", "2026-12-05", "n", reference="https://r", fixed_in="1.3", run_here="r.json")
    assert shipped.label == "fixed in 1.3 (run here)"
    reported = UpstreamStatus("x", "reported", "2026-12-05", "n", reference="https://r", state="open")
    assert reported.label == "reported (open)" and reported.known
    assert not UpstreamStatus("x", "none found", "2026-12-05", "n").known
    assert merged.sentence().startswith("fix merged in torch 2.12.0, not run here (checked 2026-12-05). ")


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"status": "fixed"}, "must be one of"),
        ({"checked": "last week"}, "must be the ISO date"),
        ({"note": " "}, "give a note"),
        ({"status": "reported", "reference": "https://r"}, "give state"),
        ({"status": "fix merged", "reference": "https://r"}, "give fixed_in"),
        ({"status": "fix shipped", "reference": "https://r", "fixed_in": "1.3"}, "give run_here"),
        ({"reference": "https://r"}, "drop reference"),
        ({"colour": "red"}, "unknown fields ['colour']"),
    ],
)
def test_a_malformed_entry_is_refused_naming_the_fault(fields, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse({"x": _entry(**fields)})


def test_fix_shipped_needs_the_record_of_the_run(tmp_path):
    (tmp_path / STATUS_FILE).parent.mkdir(parents=True)
    (tmp_path / STATUS_FILE).write_text(
        '[x]\nstatus = "fix shipped"\nreference = "https://r"\nfixed_in = "1.3"\nrun_here = "x-h200.json"\n'
        'checked = "2026-12-05"\nnote = "n"\n'
    )
    (tmp_path / "pkg").mkdir()
    with pytest.raises(FileNotFoundError, match="run_here = 'x-h200.json' is no record under data/gpu/"):
        finding_status("x", tmp_path / "pkg" / "cases.py")
    (tmp_path / "data" / "gpu").mkdir()
    (tmp_path / "data" / "gpu" / "x-h200.json").write_text("{}")
    assert finding_status("x", tmp_path / "pkg" / "cases.py").label == "fixed in 1.3 (run here)"


def test_a_finding_without_an_entry_is_named_with_the_file():
    with pytest.raises(KeyError, match=r"has no entry \[no-such-finding\]"):
        finding_status("no-such-finding", REPO / "postmortems" / "x" / "cases.py")


def test_every_postmortem_has_a_dated_entry_and_every_entry_a_postmortem():
    found = statuses(REPO)
    ids = Registry().ids()
    assert sorted(found) == ids
    for pm in Registry().postmortems():
        assert pm.status is found[pm.id] and pm.status.checked >= pm.meta.published, pm.id
        # "fixed" only where the fixed release ran here, with the record that shows it
        assert pm.status.label.startswith("fixed") == (pm.status.status == "fix shipped"), pm.id


def test_sdpa_cudnn_masked_rows_says_merged_not_run():
    """The index once showed a green "fixed" while no torch with the fix had run here."""
    status = statuses(REPO)["sdpa-cudnn-masked-rows"]
    assert status.label == "fix merged in torch 2.12.0, not run here"
    assert status.reference == "https://github.com/pytorch/pytorch/issues/177842"


def test_the_status_renders_on_the_page_header_and_the_index(published_site):
    index = (published_site / "index.html").read_text()
    for pm in Registry().postmortems():
        badge = f'<span class="wb-status {pm.status.css_class}"'
        page = (published_site / f"{pm.id}.html").read_text()
        assert f"{badge}>{pm.status.label}</span> checked {pm.status.checked}." in page, pm.id
        assert f'{badge} title="{escape(pm.status.sentence())}">{pm.status.label}</span>' in index, pm.id


def test_no_timeline_row_names_its_kind_twice():
    """The timeline writes each event as '<kind> [<label>]': a label that names its kind again read
    'PR PR #10688' and 'PR TE PR #2911' in the upstream tables."""
    from varlen_workbench.workbench.postmortem import Link

    doubled = re.compile(r"\b(PR|issue) \[(?:[\w.-]+ )?\1\b", re.IGNORECASE)
    for pm in Registry().postmortems():
        table = pm.meta.upstream_markdown(pm.status)
        assert not doubled.search(table), (pm.id, doubled.search(table))
    with pytest.raises(ValueError, match="names it again|name it as 'project#number'"):
        Link("TE PR #2911: auto-pad", "https://github.com/NVIDIA/TransformerEngine/pull/2911", "2026-04-21", "PR")
    with pytest.raises(ValueError, match="project#number"):
        Link("PR #10688: bf16", "https://github.com/triton-lang/triton/pull/10688", "2026-06-20", "PR")
    Link("TE#2911: auto-pad", "https://github.com/NVIDIA/TransformerEngine/pull/2911", "2026-04-21", "PR")
