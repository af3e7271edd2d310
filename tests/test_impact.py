"""The index's impact lines: every figure in them is computed from the committed records (a
post-mortem's `impact_figures()`), never typed into META.impact."""

from __future__ import annotations

import dataclasses
import html
import json
import math
import re
import types

import pytest

from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.registry import Registry, RegistryError, validate_module

# A ratio ("25x", "1,200 times") or an order of magnitude ("~1e9") written into the text.
TYPED_FIGURE = re.compile(r"\d[\d,.]*\s*(?:x\b|×|times\b)|~\s*1e[+-]?\d")


@pytest.mark.parametrize(
    "impact",
    [
        "finite outputs and gradients about 20 to 1,200 times PyTorch's own error on the H200",
        "return finite results ~1e9 too large, without an error",
        "22.7-1170x PyTorch's own error",
    ],
)
def test_a_typed_figure_is_found(impact):
    assert TYPED_FIGURE.search(impact)


def test_no_impact_line_types_a_figure():
    for pm in Registry().postmortems():
        assert not TYPED_FIGURE.search(pm.meta.impact), f"{pm.id}: compute the figure in impact_figures(): {pm.meta.impact}"


def test_flex_mask_impact_is_the_h200_audits_range():
    """Read here from the record's evidence strings, apart from the post-mortem's own parser."""
    record = json.loads((GPU_DATA / "audit-dmattn-flex.json").read_text())
    # NaN or garbage in the padding sets those two checks' errors (the post-mortem reports them apart).
    padding_set = ("padding-leak", "sliding-window")
    evidence = [c["evidence"] for c in record["checks"] if c["verdict"] == "FAIL" and c["name"] not in padding_set]
    evidence += [f["evidence"] for f in record["fuzz"]["failures"] if f["check"] not in padding_set]
    ratios = [float(x) for text in evidence for x in re.findall(r"\(([\d.e+]+)x PyTorch's own error\)", text)]
    impact = Registry().get("flash-dmattn-flex-mask").impact
    assert f"gradients {min(ratios):.3g} to {float(f'{max(ratios):.3g}'):,g} times PyTorch's own error" in impact, impact


def test_interpreter_impact_is_the_records_order_of_magnitude():
    pm = Registry().get("triton-interpreter-bf16-dot")
    (path,) = sorted(GPU_DATA.glob("triton-interpreter-bf16-dot-*.json"))
    relative = json.loads(path.read_text())["results"]["interpreter"]["detector"]["checks"]["bfloat16"]["relative"]
    assert f"relative error is ~1e+{round(math.log10(relative))}," in pm.impact, pm.impact


def test_a_figure_without_impact_figures_is_refused():
    module = Registry().get("torch-varlen-176793").module
    bare = types.ModuleType("varlen_workbench.postmortems.torch_varlen_176793")
    for name in ("STATUS", "CASES", "reproduce", "claims"):
        setattr(bare, name, getattr(module, name))
    bare.META = dataclasses.replace(module.META, impact="{ratio} times worse")  # type: ignore[attr-defined]
    with pytest.raises(RegistryError, match=r"META.impact names \['ratio'\]; define impact_figures\(\)"):
        validate_module(bare)


def test_pages_show_the_computed_impact(published_site):
    index = html.unescape((published_site / "index.html").read_text())
    for pm in Registry().postmortems():
        assert pm.impact in index, pm.id
        assert pm.impact in html.unescape((published_site / f"{pm.id}.html").read_text()), pm.id
