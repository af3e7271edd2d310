"""Who is affected, declared as data (varlen_workbench.workbench.affected): the masked batches it builds, the layouts'
rules, the text it renders. Each post-mortem's declaration is checked against its library by the
paste-block battery (tests/test_snippets.py)."""

import pytest
import torch

from varlen_workbench.postmortems import (
    fa4_unwritten_padding,
    flash_dmattn_121,
    flash_dmattn_flex_mask,
    fsa_varlen_descriptors,
    sdpa_cudnn_masked_rows,
    torch_varlen_176793,
)
from varlen_workbench.workbench.affected import Affected, Layout, MaskedBatch
from varlen_workbench.workbench.layout import Case

DECLARED = [
    fa4_unwritten_padding,
    flash_dmattn_121,
    flash_dmattn_flex_mask,
    fsa_varlen_descriptors,
    sdpa_cudnn_masked_rows,
    torch_varlen_176793,
]


def test_a_right_padding_mask_sees_each_items_real_keys():
    x = MaskedBatch(lengths_k=(5, 3, 8), seq=8).build()
    assert x["attn_mask"].shape == (3, 2, 8, 8) and x["attn_mask"].dtype == torch.bool
    assert x["visible"][:, 0, 0].sum(-1).tolist() == [5, 3, 8] and torch.equal(x["visible"], x["attn_mask"])
    assert x["attn_bias"] is None and x["real_q"].all()


def test_causal_and_windows_are_bottom_right_per_item():
    """Query i of an item sees key j when i + len_k - len_q - left <= j <= i + len_k - len_q + right."""
    x = MaskedBatch(lengths_q=(6, 6), lengths_k=(3, 6), seq=6, window=(2, 1), mask_shape="(B, 1, S, S)").build()
    rows_with_keys = x["visible"][0, 0].any(-1).tolist()
    assert rows_with_keys == [False, False, True, True, True, True]  # rows 0, 1 see no key
    assert x["visible"][0, 0, 2].tolist() == [True, False, False, False, False, False]  # row 2: keys 0 .. 0
    causal = MaskedBatch(lengths_q=(6,), lengths_k=(4,), seq=6, causal=True, mask_shape="(B, 1, S, S)").build()
    assert causal["visible"][0, 0].sum(-1).tolist() == [0, 0, 1, 2, 3, 4]


def test_left_padding_and_is_causal():
    """flash-dmattn's is_causal is top-left over padded positions: left padding leaves the first rows no key."""
    x = MaskedBatch(lengths_k=(4, 2), seq=4, left=True, is_causal=True).build()
    assert x["attn_mask"][1, 0, 0].tolist() == [False, False, True, True]
    assert x["visible"][1, 0].any(-1).tolist() == [False, False, True, True]


def test_mask_forms():
    base = MaskedBatch(lengths_k=(3, 0), seq=4, bias=True, keyless_rows=1)
    additive = base.with_(mask_dtype="additive").build()
    assert additive["attn_bias"] is None and torch.isneginf(additive["attn_mask"][1]).all()
    visible = additive["visible"]
    assert torch.equal(additive["attn_mask"][visible], additive["bias"][visible])  # the bias rides on visible keys
    assert not visible[0, 1, 0].any() and visible[0, 0, 0].any()  # one head's first row sees nothing
    floats = base.with_(mask_dtype="float").build()
    assert set(floats["attn_mask"].unique().tolist()) == {0.0, 1.0} and floats["attn_bias"] is not None
    shared = MaskedBatch(lengths_k=(3, 4), seq=4, mask_shape="(B, 1, 1, S)").build()
    assert shared["attn_mask"].shape == (2, 1, 1, 4) and shared["visible"].shape == (2, 2, 4, 4)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"mask_shape": "(B, S)"}, "mask_shape"),
        ({"mask_dtype": "int"}, "mask_dtype"),
        ({"lengths_k": (9,)}, "lengths"),
        ({"mask_shape": "(B, 1, 1, S)", "causal": True}, "one row per item"),
        ({"mask_shape": "(B, 1, S, S)", "keyless_rows": 1}, "same for every head"),
        ({"mask_shape": "none"}, "without a mask"),
    ],
)
def test_a_batch_the_shapes_cannot_express_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        MaskedBatch(**{"lengths_k": (3,), "seq": 4, **changes})


def test_affected_needs_both_kinds_unique_names_and_no_refused_hit():
    case = Case((3,))
    hit, spared = Layout("a", True, "why", case), Layout("b", False, "why", case)
    with pytest.raises(ValueError, match="at least one affected and one unaffected"):
        Affected(scope=(), layouts=(hit,))
    with pytest.raises(ValueError, match="unique"):
        Affected(scope=(), layouts=(hit, spared, hit))
    with pytest.raises(ValueError, match="refuses loudly is not affected"):
        Layout("c", True, "why", case, refused="ValueError")
    with pytest.raises(KeyError, match="no layout 'd'"):
        Affected(scope=(), layouts=(hit, spared)).layout("d")


def test_the_text_names_every_layout_under_its_verdict():
    case = Case((3,))
    who = Affected(
        scope=("**lib 1.0**: the scope.",),
        layouts=(
            Layout("TAIL rows", True, "unwritten.", case, gpu=True),
            Layout("No padding", False, "all written.", case),
            Layout("GQA", False, "raises.", case, refused="ValueError"),
        ),
        notes=("**Elsewhere:** the same.",),
    )
    assert who.markdown().splitlines() == [
        "* **lib 1.0**: the scope.",
        "* **Hit:**",
        "    * **TAIL rows** *(shown on a GPU only)*: unwritten.",
        "* **Not hit:**",
        "    * **No padding**: all written.",
        "* **Refused with an error (loud, never silently wrong):**",
        "    * **GQA**: raises.",
        "* **Elsewhere:** the same.",
    ]


@pytest.mark.parametrize("pm", DECLARED, ids=[pm.META.id for pm in DECLARED])
def test_each_page_declares_its_layouts(pm):
    """Every page with a check declares hit and spared layouts, each buildable."""
    assert pm.WHO.affected and pm.WHO.unaffected
    for layout in pm.WHO.layouts:
        if isinstance(layout.inputs, MaskedBatch):
            layout.inputs.build()
    assert all(layout.name in pm.WHO.markdown() for layout in pm.WHO.layouts)
