"""Point 4 of the padding contract: every malformed input gets a clear error.

Each case of the catalogue (workbench.malformed, shared with `workbench audit`) is one malformed
call: the exception type and a regex its message must match (naming the argument, the offending
index/value, and the fix).
"""

from __future__ import annotations

import pytest
import torch

from kernels.contract import check_scale, check_varlen_inputs, check_window_size
from workbench import Case, Region, check_cu_seqlens, pack, region_labels
from workbench.malformed import CATALOGUE, I32, base_args, split_call


def call(**changes):
    positional, keywords = split_call({**base_args(), **changes})
    if "window_size" in keywords:  # the window's own check (varlen_attention runs it before the others)
        check_window_size(keywords.pop("window_size"))
    return check_varlen_inputs(
        *positional, **keywords, dtypes=(torch.float32, torch.float16, torch.bfloat16), head_dims=(16, 32, 64, 128)
    )


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_malformed_input_gets_a_clear_error(case):
    with pytest.raises(case.exception, match=case.message):
        call(**case.changes(base_args()))


def test_catalogue_is_large_and_distinct():
    assert len(CATALOGUE) >= 15
    assert len({c.id for c in CATALOGUE}) == len(CATALOGUE)
    assert len({c.message for c in CATALOGUE}) == len(CATALOGUE)


def test_valid_te_layout_passes_and_reports_shape():
    shape = call()
    assert (shape.total_q, shape.heads, shape.kv_heads, shape.head_dim) == (15, 4, 2, 16)


def test_tail_rows_are_legal_and_labelled_not_rejected():
    """The torch bug's layout: more rows than cu_seqlens[-1] is legal TAIL padding."""
    cu = torch.tensor([0, 144, 432, 944], dtype=I32)
    lengths, _ = check_cu_seqlens(cu, cu, 512, 512, total_q=946, total_k=946)
    assert lengths == [144, 288, 512]
    labels = region_labels(cu, None, 946)
    assert (labels[:944] == Region.REAL).all() and (labels[944:] == Region.TAIL).all()


def test_empty_sequences_are_legal():
    cu = torch.tensor([0, 0, 5, 5], dtype=I32)
    assert check_cu_seqlens(cu, cu, 5, 5, total_q=5, total_k=5)[0] == [0, 5, 0]


def test_int64_boundaries_are_accepted():
    cu = torch.tensor([0, 3], dtype=torch.int64)
    check_cu_seqlens(cu, cu, 3, 3, total_q=3, total_k=3)


def test_default_scale_is_inverse_sqrt_head_dim():
    assert check_scale(None, 64) == 0.125
    assert check_scale(2, 64) == 2.0


def test_case_validation_names_the_field():
    with pytest.raises(ValueError, match=r"Case\.padded_q\[1\] = 2 is shorter than the real length 3"):
        Case((4, 3), padded_q=(4, 2))
    with pytest.raises(ValueError, match=r"Case\.seqlens_k has 1 entries but seqlens_q has 2"):
        Case((4, 3), seqlens_k=(4,))
    with pytest.raises(ValueError, match=r"Case\.heads = 3 must be a positive multiple of kv_heads = 2"):
        Case((4,), heads=3, kv_heads=2)
    with pytest.raises(ValueError, match=r"Case\.dtype = 'int8'"):
        Case((4,), dtype="int8")


def test_packed_batches_always_pass_validation():
    batch = pack(Case((5, 0, 7), seqlens_k=(2, 3, 9), align=4, tail_q=3, tail_k=1, heads=4, kv_heads=2, head_dim=16))
    check_varlen_inputs(
        *batch.args(), cu_seqlens_q_padded=batch.cu_seqlens_q_padded, cu_seqlens_k_padded=batch.cu_seqlens_k_padded
    )
