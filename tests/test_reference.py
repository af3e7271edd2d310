"""The oracle against PyTorch's scaled_dot_product_attention, and its padding guarantees.

The oracle runs on any device; these tests pin the CPU so that the masks they build line up.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given

from varlen_workbench.workbench.layout import Case, Fill, Region, pack
from varlen_workbench.workbench.reference import per_document_sdpa, reference_attention
from varlen_workbench.workbench.strategies import LayoutSpace


def sdpa_per_sequence(batch, causal: bool, window: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """Independent formulation: SDPA in float64 on each sequence, explicit bottom-right mask
    (the window's bounded sides as tril/triu diagonals; causal bounds the right at 0)."""
    left, right = window[0], 0 if causal else window[1]
    case = batch.case
    q, k, v = (t.detach().double() for t in (batch.q, batch.k, batch.v))
    out = torch.zeros_like(q)
    bq, bk = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    pq, pk = batch.cu_seqlens_q_padded.tolist(), batch.cu_seqlens_k_padded.tolist()
    group = case.heads // (case.kv_heads or case.heads)
    for i in range(case.batch):
        lq, lk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        if lq == 0:
            continue
        qi = q[pq[i] : pq[i] + lq].transpose(0, 1)
        ki = k[pk[i] : pk[i] + lk].transpose(0, 1).repeat_interleave(group, 0)
        vi = v[pk[i] : pk[i] + lk].transpose(0, 1).repeat_interleave(group, 0)
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if right >= 0:
            mask = mask.tril(diagonal=lk - lq + right)
        if left >= 0:
            mask = mask.triu(diagonal=lk - lq - left)
        if lk == 0:
            continue  # no key at all: the contract's output is 0
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask)
        oi = torch.where(mask.any(-1)[None, :, None], oi, 0.0)  # rows with no visible key -> 0
        out[pq[i] : pq[i] + lq] = oi.transpose(0, 1)
    return out


# Cross-attention lengths, GAP rows, TAIL rows, GQA groups of 1-3, causal, windows, non-finite fills.
layouts = LayoutSpace(
    max_batch=3,
    longest=12,
    heads=(1, 2, 3, 6),
    head_dims=(8,),
    aligns=(4,),
    fills=(Fill.NAN, Fill.POS_INF, Fill.GARBAGE),
    nonempty=False,
).strategy


@given(layouts())
def test_oracle_matches_sdpa_per_sequence(case):
    batch = pack(case, device="cpu", requires_grad=False)
    out = reference_attention(*batch.args(), **batch.kwargs())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, sdpa_per_sequence(batch, case.causal, case.window), rtol=1e-10, atol=1e-12)


def test_oracle_custom_scale_matches_sdpa():
    batch = pack(Case((5, 9), heads=2, head_dim=16, fill=Fill.NAN), device="cpu", requires_grad=False)
    out = reference_attention(*batch.args(), **batch.kwargs(), scale=0.3)
    q, k, v = (t.double()[:5].transpose(0, 1) for t in (batch.q, batch.k, batch.v))
    torch.testing.assert_close(out[:5].transpose(0, 1), F.scaled_dot_product_attention(q, k, v, scale=0.3))


def test_oracle_lse_is_logsumexp_of_scaled_scores():
    batch = pack(Case((6,), seqlens_k=(4,), heads=1, head_dim=8, causal=True), device="cpu", requires_grad=False)
    _, lse = reference_attention(*batch.args(), **batch.kwargs(), return_lse=True)
    q, k = batch.q.double()[:, 0], batch.k.double()[:, 0]
    scores = (q @ k.T) / math.sqrt(8)
    mask = torch.ones(6, 4, dtype=torch.bool).tril(diagonal=-2)
    expected = torch.logsumexp(scores.masked_fill(~mask, -math.inf), -1)
    assert torch.isneginf(lse[0, :2]).all()  # len_q > len_k: the first 2 queries see no key
    torch.testing.assert_close(lse[0], expected)


@pytest.mark.parametrize("fill", [Fill.NAN, Fill.POS_INF, Fill.NEG_INF, Fill.HUGE, Fill.GARBAGE])
def test_oracle_padding_rows_exactly_zero_in_output_and_gradients(fill):
    case = Case(
        (5, 0, 3),
        seqlens_k=(4, 2, 0),
        padded_q=(7, 2, 3),
        padded_k=(6, 2, 1),
        tail_q=2,
        tail_k=3,
        heads=4,
        kv_heads=2,
        head_dim=8,
        causal=True,
        fill=fill,
    )
    batch = pack(case, device="cpu")
    out, lse = reference_attention(*batch.args(), **batch.kwargs(), return_lse=True)
    # dO is non-zero (even NaN) on padding rows: the oracle must still give zero there.
    d_out = torch.randn_like(out)
    d_out[batch.regions_q != Region.REAL] = math.nan
    out.backward(d_out)
    pad_q, pad_k = batch.regions_q != Region.REAL, batch.regions_k != Region.REAL
    assert (out.detach()[pad_q] == 0).all()
    assert torch.isneginf(lse.detach()[:, pad_q]).all()
    for grad, pad in ((batch.q.grad, pad_q), (batch.k.grad, pad_k), (batch.v.grad, pad_k)):
        assert (grad[pad] == 0).all()
        assert grad[~pad].isfinite().all()


def test_rows_without_keys_give_zero_output_zero_grad_and_minus_inf_lse():
    # Sequence 1 has no keys at all; sequence 0 is causal with len_q > len_k.
    batch = pack(Case((5, 3), seqlens_k=(2, 0), heads=1, head_dim=8, causal=True), device="cpu")
    out, lse = reference_attention(*batch.args(), **batch.kwargs(), return_lse=True)
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    blind = torch.tensor([1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert (out.detach()[blind] == 0).all() and torch.isneginf(lse.detach()[0, blind]).all()
    assert (batch.q.grad[blind] == 0).all() and batch.q.grad.isfinite().all()


def test_low_precision_compute_dtype_is_pytorchs_own_error():
    batch = pack(Case((33, 17), heads=2, head_dim=16, dtype="bfloat16"), device="cpu", requires_grad=False)
    exact = reference_attention(*batch.args(), **batch.kwargs())
    low = reference_attention(*batch.args(), **batch.kwargs(), compute_dtype=torch.bfloat16)
    assert low.dtype == torch.bfloat16
    err = (low.double() - exact).abs().max().item()
    assert 1e-4 < err < 5e-2  # bf16 rounding, neither zero nor garbage


@pytest.mark.parametrize("window", [(2, 0), (0, 3), (1, 1), (0, 0), (-1, 2)], ids=str)
def test_oracle_windows_match_sdpa_with_an_explicit_mask(window):
    """Each sequence through SDPA in float64 with the window written out entry by entry
    (bottom-right aligned); rows that see no key are 0 in the oracle."""
    case = Case((7, 3, 9), seqlens_k=(7, 6, 4), align=4, tail_q=2, heads=2, kv_heads=1, head_dim=8, fill=Fill.NAN)
    batch = pack(case, device="cpu", requires_grad=False)
    out = batch.call(reference_attention, window_size=window)
    left, right = window
    q, k, v = (t.double() for t in (batch.q, batch.k, batch.v))
    bq, bk = batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist()
    pq, pk = batch.cu_seqlens_q_padded.tolist(), batch.cu_seqlens_k_padded.tolist()
    for i in range(case.batch):
        lq, lk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        mask = torch.zeros(lq, lk, dtype=torch.bool)
        for r in range(lq):
            for c in range(lk):
                diagonal = r + lk - lq
                mask[r, c] = (left < 0 or c >= diagonal - left) and (right < 0 or c <= diagonal + right)
        qi = q[pq[i] : pq[i] + lq].transpose(0, 1)
        ki = k[pk[i] : pk[i] + lk].transpose(0, 1).repeat_interleave(2, 0)
        vi = v[pk[i] : pk[i] + lk].transpose(0, 1).repeat_interleave(2, 0)
        expected = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask).transpose(0, 1)
        expected = torch.where(mask.any(-1)[:, None, None], expected, 0.0)
        assert torch.allclose(out[pq[i] : pq[i] + lq], expected, atol=1e-12), f"sequence {i}"


def test_per_document_sdpa_is_the_oracle_with_padding_rows_zero():
    q, k, v = (torch.randn(14, h, 16, dtype=torch.float64) for h in (4, 2, 2))
    cu, padded = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 5, 10], dtype=torch.int32)
    layout = dict(cu_seqlens_q_padded=padded, cu_seqlens_k_padded=padded, causal=True)
    out = per_document_sdpa(q, k, v, cu, cu, 5, 5, **layout)
    torch.testing.assert_close(out, reference_attention(q, k, v, cu, cu, 5, 5, **layout))
    assert (out[[3, 4, 10, 11, 12, 13]] == 0).all()  # GAP and TAIL rows


def test_per_document_sdpa_aligns_causal_bottom_right_as_the_oracle():
    """More queries than keys (their first rows see no key: 0), more keys than queries, and a
    document with no keys, against the float64 oracle."""
    cu_q, cu_k = torch.tensor([0, 5, 7, 9], dtype=torch.int32), torch.tensor([0, 3, 8, 8], dtype=torch.int32)
    q, k, v = (
        torch.randn(9, 4, 16, dtype=torch.float64),
        torch.randn(8, 2, 16, dtype=torch.float64),
        torch.randn(8, 2, 8, dtype=torch.float64),
    )
    out = per_document_sdpa(q, k, v, cu_q, cu_k, 5, 5, causal=True)
    torch.testing.assert_close(out, reference_attention(q, k, v, cu_q, cu_k, 5, 5, causal=True))
    assert (out[[0, 1, 7, 8]] == 0).all() and (out[2] != 0).all()
