"""Committed notebooks are as `varlen-workbench execute` leaves them, not as a Lab session saved them:
a Lab run adds live widget views, their state and the session's execution counts (a diff of
megabytes that says nothing). The fix is always the same: `varlen-workbench execute ID`."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def lab_traces(nb: dict) -> list[str]:
    """What in a notebook shows it was saved from an interactive session."""
    traces = []
    if "widgets" in nb.get("metadata", {}):
        traces.append("metadata.widgets (live widget state)")
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in code]
    if counts and all(n is None for n in counts):
        traces.append("no cell is executed")
    elif counts != list(range(1, len(code) + 1)):
        traces.append(f"execution counts {counts[:8]}... are not 1..{len(code)} in order")
    live = [i for i, c in enumerate(nb["cells"]) for o in c.get("outputs", []) if WIDGET_VIEW in o.get("data", {})]
    if live:
        traces.append(f"live widget views in cells {live}")
    return traces


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_is_as_workbench_execute_leaves_it(path):
    traces = lab_traces(json.loads(path.read_text()))
    assert not traces, (
        f"{path.name} is not as `varlen-workbench execute` leaves it ({'; '.join(traces)}): run `varlen-workbench execute {path.stem}`"
    )


def test_lab_traces_are_recognised():
    clean = {"metadata": {}, "cells": [{"cell_type": "code", "execution_count": 1, "outputs": []}]}
    assert lab_traces(clean) == []
    session = {
        "metadata": {"widgets": {}},
        "cells": [{"cell_type": "code", "execution_count": 7, "outputs": [{"data": {WIDGET_VIEW: {}}}]}],
    }
    assert len(lab_traces(session)) == 3
    unexecuted = {"metadata": {}, "cells": [{"cell_type": "code", "execution_count": None, "outputs": []}]}
    assert lab_traces(unexecuted) == ["no cell is executed"]


def test_no_page_types_how_many_checks_fail_or_pass():
    """A count of failing or passing checks is read off a record by code (the fa4 page once typed 'four
    checks fail' beside a record with eight FAILs); prose never states one."""
    import re

    typed = re.compile(
        r"\b(one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|every|all|\d+)( of (its|the) \w+)? checks? "
        r"(fail|pass)",
        re.IGNORECASE,
    )
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                found = typed.search("".join(cell["source"]))
                assert not found, f"{path.name}, cell {i}: {found[0]!r}"
