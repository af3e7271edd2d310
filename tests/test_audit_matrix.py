"""The audit matrix page's logic (varlen_workbench.workbench.audit.matrix) on records made here, on the CPU."""

from __future__ import annotations

import json
import logging
import re

import pytest

from varlen_workbench.workbench.audit import audit
from varlen_workbench.workbench.audit.judgements import (
    judgements,
    known_links,
    new_findings,
    parse,
    postmortem_links,
    unjudged,
)
from varlen_workbench.workbench.audit.matrix import (
    COLUMNS,
    cell,
    columns,
    complete,
    fails,
    fuzz_budget,
    grid,
    implementation,
    load_matrix,
    wrappers,
)
from varlen_workbench.workbench.audit.render import heatmap, matrix_html, text_grid
from varlen_workbench.workbench.upstream_status import UpstreamStatus

SDPA = "torch.nn.functional:scaled_dot_product_attention"


@pytest.fixture(scope="module")
def records_dir(tmp_path_factory):
    logging.disable(logging.WARNING)
    directory = tmp_path_factory.mktemp("gpu")
    for row in ("sdpa-math", "sdpa-flash"):
        report = audit(SDPA, row, budget=3, skip=["determinism"])
        (directory / f"audit-{row}.json").write_text(json.dumps(report.to_dict()))
    (directory / "audit-dmattn-flex.json").write_text(
        json.dumps(
            {
                "row": "dmattn-flex",
                "ran": False,
                "rc": 2,
                "output": ["varlen-workbench audit: cannot import transformers"],
                "provenance": {},
            }
        )
    )
    logging.disable(logging.NOTSET)
    return directory


def test_rows_follow_the_matrix_and_cells_carry_their_evidence(records_dir):
    records = load_matrix(records_dir)
    assert [r["row"] for r in records] == ["sdpa-math", "sdpa-flash", "dmattn-flex"]
    g = grid(records)
    assert g["sdpa-math"]["padding-leak"] == "FAIL" and g["sdpa-math"]["real-accuracy"] == "pass"
    assert set(g["sdpa-flash"].values()) == {"n/a"}  # it cannot run here: every check says why
    assert set(g["dmattn-flex"].values()) == {"not run"} and "transformers" in cell(records[2], "gqa")[1]
    assert g["sdpa-math"]["input-validation"] == "n/a" and g["sdpa-math"]["sliding-window"] == "pass"
    # A check no recorded run ran (determinism, skipped here) has no column; one that some run
    # ran is "not run" where a record lacks it.
    assert "determinism" not in g["sdpa-math"] and columns(records) == [
        c for c in COLUMNS if c not in ("determinism", "sanitizer")
    ]
    partial = [records[0], {**records[1], "checks": [c for c in records[1]["checks"] if c["name"] != "gqa"]}]
    assert grid(partial)["sdpa-flash"]["gqa"] == "not run" and "not in the recorded run" in cell(partial[1], "gqa")[1]
    assert implementation(records[0]).startswith("sdpa-math (torch ")
    assert ("sdpa-math", "padding-leak") in {(row, check) for row, check, _ in fails(records)}
    # A row is complete when nothing in it is "not run": the matrix script skips it unless forced.
    assert not any(map(complete, records))  # determinism was skipped; dmattn-flex did not run
    whole = {**records[0], "checks": [*records[0]["checks"], {"name": "determinism", "verdict": "n/a", "evidence": "-"}]}
    assert not complete(whole) and fuzz_budget(whole) is None  # 3 layouts fuzzed
    fuzzed = {**whole["fuzz"], "tried": 1000}
    assert complete({**whole, "fuzz": fuzzed}) and fuzz_budget({**whole, "fuzz": fuzzed}) == "1000 layouts"
    slow = {**whole, "fuzz": {**whole["fuzz"], "tried": 800, "seconds": 480.0, "search_seconds": 420.3, "workers": 2}}
    assert complete(slow) and fuzz_budget(slow) == "480 s of fuzzing (420 s search, then shrinking; 1.1 s a layout)"
    # One layout's time is its worker's: 900 layouts in 420 s by 3 workers took 1.4 s each, not 0.47.
    assert fuzz_budget({**slow, "fuzz": {**slow["fuzz"], "tried": 900, "workers": 3}}).endswith("1.4 s a layout)")
    assert fuzz_budget({**slow, "fuzz": {**slow["fuzz"], "tried": 900, "workers": 1}}) is None
    short = {**slow, "fuzz": {**slow["fuzz"], "search_seconds": 300.0}}
    assert not complete(short), "a search short of FUZZ_SEARCH (a lower time limit, or cut at a deadline) is not complete"
    cut = {**slow, "fuzz": {**slow["fuzz"], "partial": "search ended, shrinking under way: its failures as drawn, not shrunk"}}
    assert complete(cut), "a search that ran its time is the budget met, though a kill cut its shrinking"
    assert not complete({**slow, "checks": [*whole["checks"][:-1], _lost("determinism")]})
    hung = {"name": "determinism", "verdict": "n/a", "evidence": "not run: timed out after 150 s (the check's time limit)"}
    assert complete({**slow, "checks": [*whole["checks"][:-1], hung]}), "a check past its time limit is an answer"
    checks_only = {**whole, "fuzz": None, "budget": 0}  # `--budget 0`: the fuzzer is left to another run
    assert cell(checks_only, "fuzzer") == ("not run", "fuzzing not asked (--budget 0)") and not complete(checks_only)


def _lost(name: str) -> dict[str, str]:
    return {"name": name, "verdict": "n/a", "evidence": "not run: the CUDA context was lost at check gqa"}


def test_html_picture_and_text_show_every_cell(records_dir):
    records = load_matrix(records_dir)
    page = matrix_html(records)
    assert page.count("<details>") == len(records) * len(columns(records)) and "(nan padding)" in page
    text = text_grid(records).splitlines()
    row = next(line.split() for line in text if line.startswith("sdpa-math"))
    assert row[:4] == ["sdpa-math", "pass", "n/a", "n/a"] and len(row) == len(columns(records)) + 1
    assert max(map(len, text)) <= 110, "the grid fits a page's output box without wrapping"
    assert all(name in " ".join(text) for name in columns(records)), "the key names every column"
    fig = heatmap(records)
    assert len(fig.axes[0].texts) == len(records) * len(columns(records))
    assert dict((row, adapter) for row, adapter, _ in wrappers(records))["sdpa-math"] == "sdpa-math"
    assert "sdpa_kernel(MATH)" in wrappers(records)[0][2]


def test_postmortem_links_name_registered_pages_for_committed_fails():
    """Each post-mortem of the judgements names a registered page, its cells are FAILs of the
    committed H200 matrix, and the cell links to that page (the fuzzer's cell gathers its
    fuzz:<check> links)."""
    from varlen_workbench.workbench.registry import Registry

    ids = set(Registry().ids())
    records = load_matrix()
    found = {(row, check) for row, check, _ in fails(records)}
    linked = {cell: j.postmortem for cell, j in judgements().items() if j.postmortem}
    assert linked, "no post-mortem linked from the matrix"
    for (row, check), pm_id in linked.items():
        assert pm_id in ids, f"{row} / {check} links {pm_id!r}, which is not a registered post-mortem ({sorted(ids)})"
        assert (row, check) in found, f"{row} / {check} links a post-mortem but is no FAIL of the committed matrix"
    assert postmortem_links("dmattn-flex", "fuzzer") == ["flash-dmattn-flex-mask"]
    assert postmortem_links("dmattn-flex", "determinism") == []
    assert '<a href="flash-dmattn-flex-mask.html">flash-dmattn-flex-mask</a>' in matrix_html(records)


def test_every_committed_fail_is_judged_and_a_documented_one_is_never_new():
    records = load_matrix()
    assert not unjudged(records)
    assert judgements()[("sdpa-cudnn", "determinism")].kind == "documented"
    assert ("sdpa-cudnn", "determinism") not in new_findings(records)
    assert known_links("sdpa-cudnn", "determinism")[0][0].endswith("sdp_utils.cpp")
    assert ("torch-varlen", "no-real-query") in new_findings(records)
    assert [url for url, _ in known_links("sdpa-math", "fuzzer")] == ["https://github.com/pytorch/pytorch/issues/101967"]


@pytest.mark.parametrize(
    "data, says",
    [
        ({"mechanisms": {"m": {"kind": "maybe", "text": "t"}}}, "has kind 'maybe'"),
        ({"mechanisms": {"m": {"kind": "documented", "text": "t"}}}, "gives no link"),
        ({"mechanisms": {}, "cells": [{"mechanism": "m", "rows": ["r"], "checks": ["c"]}]}, "not under [mechanisms]"),
        (
            {
                "mechanisms": {"m": {"kind": "upstream", "text": "t"}},
                "cells": [{"mechanism": "m", "rows": ["r"], "checks": ["c", "c"]}],
            },
            "r / c is judged twice",
        ),
        (
            {
                "mechanisms": {"m": {"kind": "upstream", "text": "t"}},
                "cells": [{"mechanism": "m", "rows": ["r"], "checks": ["c"], "upstream": [{"url": "u"}]}],
            },
            "each link is {url = ..., says = ...}",
        ),
    ],
)
def test_a_malformed_judgements_file_is_refused_naming_the_fault(data, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse(data, "judgements.toml")


_NOTED = {
    "mechanisms": {"m": {"kind": "upstream", "text": "the mechanism"}},
    "cells": [{"mechanism": "m", "note": "here", "rows": ["r"], "checks": ["fuzz:c"], "postmortem": "pm"}],
}


def test_a_note_precedes_its_mechanism_text():
    judged = parse(_NOTED, upstream={"pm": UpstreamStatus("pm", "none found", "2026-12-05", "searched")})
    assert judged[("r", "fuzz:c")].text == "here: the mechanism" and judged[("r", "fuzz:c")].postmortem == "pm"
    assert not judged[("r", "fuzz:c")].known


def test_a_cell_is_known_when_its_postmortem_s_upstream_status_names_a_report():
    """The status file is the one source: a post-mortem whose status names a report makes its cells
    known (sdpa-cudnn-masked-rows: pytorch#177842), with no link typed in the judgements."""
    report = "https://github.com/pytorch/pytorch/issues/177842"
    fixed = UpstreamStatus("pm", "fix merged", "2026-12-05", "merged", reference=report, fixed_in="torch 2.12.0")
    (link,) = parse(_NOTED, upstream={"pm": fixed})[("r", "fuzz:c")].links
    assert link == (report, "upstream status, checked 2026-12-05: fix merged in torch 2.12.0, not run here")
    with pytest.raises(ValueError, match="names post-mortem 'pm', which has no upstream status"):
        parse(_NOTED, upstream={})
    assert ("sdpa-cudnn", "fully-masked-rows") not in new_findings(load_matrix())
    assert report in [url for url, _ in known_links("sdpa-cudnn", "fully-masked-rows")]
