"""The packed-batch model: layouts, region labels, fills, and moving between layouts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given

from varlen_workbench.workbench.layout import (
    Case,
    Fill,
    Region,
    bshd_to_thd,
    cumulative,
    pack,
    pad_thd,
    real_rows,
    region_labels,
    thd_to_bshd,
    unpad_thd,
)
from varlen_workbench.workbench.strategies import LayoutSpace

# Small packed layouts: empty and length-1 sequences, GAP rows (explicit or aligned), TAIL rows,
# GQA, len_q != len_k, every fill; also layouts with no row at all (the conversions handle them).
cases = LayoutSpace(
    max_batch=4, longest=9, extra_padding=3, tail=5, heads=(1, 2, 4), head_dims=(8,), aligns=(4, 16), nonempty=False
).strategy


def test_te_docstring_layout():
    """TransformerEngine's docstring: [a a a 1 b b 2 2 c c c c 3]."""
    batch = pack(Case((3, 2, 4), padded_q=(4, 3, 5), padded_k=(4, 3, 5)))
    assert batch.cu_seqlens_q.tolist() == [0, 3, 5, 9]
    assert batch.cu_seqlens_q_padded.tolist() == [0, 4, 7, 12]
    te = region_labels(torch.tensor([0, 3, 5, 9]), torch.tensor([0, 4, 8, 13]), 13)
    assert "".join("RG"[int(r)] for r in te) == "RRRGRRGGRRRRG"


def test_align_rounds_each_sequence_up():
    case = Case((100, 150, 120, 130), align=16)
    assert case.padded_lengths("q") == (112, 160, 128, 144)  # the seed's FP8 alignment
    assert case.total_rows("q") == 544


def test_torch_bug_layout_has_tail_rows():
    batch = pack(Case((144, 288, 512), tail_q=2, tail_k=2, heads=1, head_dim=16))
    assert batch.q.shape[0] == 946 and batch.cu_seqlens_q.tolist() == [0, 144, 432, 944]
    assert (batch.regions_q[944:] == Region.TAIL).all() and (batch.regions_q[:944] == Region.REAL).all()


@pytest.mark.parametrize(
    "fill, check",
    [
        (Fill.ZEROS, lambda x: (x == 0).all()),
        (Fill.NAN, lambda x: x.isnan().all()),
        (Fill.POS_INF, lambda x: (x == math.inf).all()),
        (Fill.NEG_INF, lambda x: (x == -math.inf).all()),
        (Fill.HUGE, lambda x: (x == torch.finfo(x.dtype).max).all()),
        (Fill.GARBAGE, lambda x: x.isfinite().all() and x.abs().mean() > 1e3),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padding_rows_hold_the_fill_and_real_rows_do_not(fill, check, dtype):
    batch = pack(Case((3, 5), padded_q=(6, 5), tail_q=2, dtype=dtype, fill=fill))
    padding = batch.regions_q != Region.REAL
    assert check(batch.q.detach()[padding])
    assert batch.q.detach()[~padding].isfinite().all()
    assert batch.q.dtype == batch.case.torch_dtype


def test_same_seed_same_numbers_other_seed_other_numbers():
    a, b = pack(Case((4, 7), seed=3)), pack(Case((4, 7), seed=3))
    assert torch.equal(a.q, b.q) and torch.equal(a.v, b.v)
    assert not torch.equal(a.q, pack(Case((4, 7), seed=4)).q)


def test_fresh_gives_independent_leaves():
    batch = pack(Case((4,)))
    other = batch.fresh()
    other.q.sum().backward()
    assert batch.q.grad is None and other.q.grad is not None


@given(cases())
def test_region_labels_count_real_gap_tail(case):
    batch = pack(case)
    for side, regions in (("q", batch.regions_q), ("k", batch.regions_k)):
        padded = case.padded_lengths(side)
        tail = case.tail_q if side == "q" else case.tail_k
        assert int((regions == Region.REAL).sum()) == sum(case.real_lengths(side))
        assert int((regions == Region.GAP).sum()) == sum(padded) - sum(case.real_lengths(side))
        assert int((regions == Region.TAIL).sum()) == tail
        assert (
            real_rows(cumulative(case.real_lengths(side)), cumulative(padded)) == (regions == Region.REAL).nonzero().squeeze(1)
        ).all()


@given(cases())
def test_unpad_then_pad_is_identity_on_real_rows_and_zero_elsewhere(case):
    batch = pack(case, requires_grad=False)
    compact = unpad_thd(batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded)
    assert compact.shape[0] == sum(case.seqlens_q)
    back = pad_thd(compact, batch.cu_seqlens_q, batch.cu_seqlens_q_padded, batch.q.shape[0])
    real = batch.regions_q == Region.REAL
    assert torch.equal(back[real], batch.q[real])
    assert (back[~real] == 0).all()


@given(cases())
def test_thd_bshd_round_trip(case):
    batch = pack(case, requires_grad=False)
    dense, mask = thd_to_bshd(batch.k, batch.cu_seqlens_k, batch.cu_seqlens_k_padded)
    assert dense.shape[:2] == mask.shape == (case.batch, max(case.real_lengths("k")))
    assert (dense[~mask] == 0).all()
    flat, cu, max_len = bshd_to_thd(dense, mask)
    assert torch.equal(cu, batch.cu_seqlens_k) and max_len == batch.max_seqlen_k
    assert torch.equal(flat, unpad_thd(batch.k, batch.cu_seqlens_k, batch.cu_seqlens_k_padded))


def test_unpad_gradient_is_exactly_zero_on_padding_even_with_nan_inputs():
    batch = pack(Case((3, 4), padded_q=(5, 6), tail_q=2, fill=Fill.NAN))
    unpad_thd(batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded).pow(2).sum().backward()
    padding = batch.regions_q != Region.REAL
    assert (batch.q.grad[padding] == 0).all() and batch.q.grad[~padding].isfinite().all()


def test_layout_conversions_reject_bad_input():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="x has 4 rows but cu_seqlens describes 5 real tokens"):
        pad_thd(torch.zeros(4, 1, 2), cu, cu)
    with pytest.raises(ValueError, match="not left-aligned"):
        bshd_to_thd(torch.zeros(1, 3, 1, 2), torch.tensor([[False, True, True]]))
    with pytest.raises(ValueError, match=r"mask must be a bool tensor of shape \(1, 3\)"):
        bshd_to_thd(torch.zeros(1, 3, 1, 2), torch.ones(1, 3))
    with pytest.raises(ValueError, match="max_seqlen = 2 is smaller than the longest sequence"):
        thd_to_bshd(torch.zeros(5, 1, 2), cu, max_seqlen=2)


def test_a_window_is_part_of_the_case_and_reaches_the_call_only_when_set():
    """Case.window (FlashAttention's window_size): a JSON list rebuilds the same Case; a windowless
    case's dict and keyword arguments are what they were before windows (records, functions
    without window_size); a malformed window is refused naming Case.window and the fix."""
    windowed = Case((5, 3), seqlens_k=(4, 6), window=[2, 0], heads=1, head_dim=8)
    assert windowed.window == (2, 0) and windowed == Case(**windowed.to_dict())
    assert windowed.to_dict()["window"] == (2, 0) and "window=(2, 0)" in windowed.label()
    assert pack(windowed, "cpu").kwargs()["window_size"] == (2, 0)
    plain = windowed.with_(window=(-1, -1))
    assert "window" not in plain.to_dict() and "window_size" not in pack(plain, "cpu").kwargs() and "window" not in plain.label()
    with pytest.raises(ValueError, match=r"Case.window = \(-2, 0\): window_size left bound = -2 is invalid: pass -1"):
        Case((3,), window=(-2, 0))
    with pytest.raises(TypeError, match=r"Case.window = 4: window_size must be a \(left, right\) pair"):
        Case((3,), window=4)


def test_v_may_have_a_head_dim_of_its_own():
    """Case.head_dim_v (DeepSeek-style 192/128): v and the output get it; a case without one is
    the case it was before (its dict, its numbers: q and k are drawn first, as before)."""
    mla = Case((5, 3), seqlens_k=(4, 6), tail_q=2, heads=4, kv_heads=2, head_dim=24, head_dim_v=16)
    batch = pack(mla, "cpu")
    assert batch.q.shape[2] == batch.k.shape[2] == 24 and batch.v.shape == (10, 2, 16)
    assert batch.out_shape == (10, 4, 16) and batch.dot_length == 24 and mla.value_head_dim == 16
    assert mla == Case(**mla.to_dict()) and "D=24/16" in mla.label()
    plain = mla.with_(head_dim_v=None)
    assert "head_dim_v" not in plain.to_dict() and "D=24 " in plain.label() and plain.value_head_dim == 24
    same = pack(plain, "cpu")
    for x, y in ((same.q, batch.q), (same.k, batch.k)):  # NaN padding: equal as NaN
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"Case.head_dim_v = {bad!r} must be a positive int"):
            Case((3,), head_dim_v=bad)
