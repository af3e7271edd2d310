"""The audit matrix page's logic (workbench.audit.matrix) on records made here, on the CPU."""

from __future__ import annotations

import json
import logging

import pytest

from workbench.audit import audit
from workbench.audit.matrix import (
    COLUMNS,
    POSTMORTEMS,
    cell,
    columns,
    fails,
    grid,
    heatmap,
    implementation,
    load_matrix,
    matrix_html,
    postmortem_links,
    text_grid,
    wrappers,
)

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
                "output": ["workbench audit: cannot import transformers"],
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
    assert "determinism" not in g["sdpa-math"] and columns(records) == [c for c in COLUMNS if c != "determinism"]
    partial = [records[0], {**records[1], "checks": [c for c in records[1]["checks"] if c["name"] != "gqa"]}]
    assert grid(partial)["sdpa-flash"]["gqa"] == "not run" and "not in the recorded run" in cell(partial[1], "gqa")[1]
    assert implementation(records[0]).startswith("sdpa-math (torch ")
    assert ("sdpa-math", "padding-leak") in {(row, check) for row, check, _ in fails(records)}


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
    """Each POSTMORTEMS cell is a FAIL of the committed H200 matrix, its id a registered post-mortem,
    and the cell links to that page (the fuzzer's cell gathers its fuzz:<check> links)."""
    from workbench.registry import Registry

    ids = set(Registry().ids())
    records = load_matrix()
    found = {(row, check) for row, check, _ in fails(records)}
    assert POSTMORTEMS, "no post-mortem linked from the matrix"
    for (row, check), pm_id in POSTMORTEMS.items():
        assert pm_id in ids, f"POSTMORTEMS[{(row, check)}] = {pm_id!r} is not a registered post-mortem ({sorted(ids)})"
        assert (row, check) in found, f"POSTMORTEMS links {row} / {check}, which is no FAIL of the committed matrix"
    assert postmortem_links("dmattn-flex", "fuzzer") == ["flash-dmattn-flex-mask"]
    assert postmortem_links("dmattn-flex", "determinism") == []
    assert '<a href="flash-dmattn-flex-mask.html">flash-dmattn-flex-mask</a>' in matrix_html(records)
