"""The lse check: a returned (out, lse) has its lse compared with the fp64 oracle's.

REAL rows that see a key within FlashAttention's bound, an infinity on rows that see no key and on
GAP and TAIL rows (docs/contract.md, What each row holds, says -inf; FlashAttention says +inf: the
sign is a convention, NaN or a finite value is not), laid out (H, T_q) or its transpose.
Stand-ins computed by the oracle, each wrong in one way, or right.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_audit import oracle

from varlen_workbench.workbench.audit import Verdict, audit
from varlen_workbench.workbench.layout import real_rows
from varlen_workbench.workbench.reference import reference_attention


def _lse(q, k, v, *args, **kwargs):
    """The oracle's lse in q's dtype, as a kernel returns it (float32)."""
    _, lse = reference_attention(q, k, v, *args, **kwargs, return_lse=True, compute_dtype=q.dtype, validate=False)
    return lse.float()


def lse_right(q, k, v, *args, return_lse=False, **kwargs):
    out = oracle(q, k, v, *args, **kwargs)
    return (out, _lse(q, k, v, *args, **kwargs)) if return_lse else out


def lse_transposed(q, k, v, *args, return_lse=False, **kwargs):
    """(T_q, H) instead of (H, T_q): another layout, the same numbers."""
    out = oracle(q, k, v, *args, **kwargs)
    return (out, _lse(q, k, v, *args, **kwargs).T.contiguous()) if return_lse else out


def lse_unscaled(q, k, v, *args, return_lse=False, scale=None, **kwargs):
    """out right; the lse of the unscaled scores (scale 1, not 1/sqrt(D))."""
    out = oracle(q, k, v, *args, scale=scale, **kwargs)
    return (out, _lse(q, k, v, *args, scale=1.0, **kwargs)) if return_lse else out


def lse_plus_inf_without_keys(q, k, v, *args, return_lse=False, **kwargs):
    """FlashAttention-2's convention: +inf, not -inf, where a row sees no key (padding rows too)."""
    out = oracle(q, k, v, *args, **kwargs)
    if not return_lse:
        return out
    lse = _lse(q, k, v, *args, **kwargs)
    return out, torch.where(torch.isneginf(lse), torch.inf, lse)


def lse_nan_on_padding(q, k, v, *args, return_lse=False, **kwargs):
    """NaN where -inf belongs: what an unwritten lse row under poisoned memory holds."""
    out = oracle(q, k, v, *args, **kwargs)
    if not return_lse:
        return out
    lse = _lse(q, k, v, *args, **kwargs)
    return out, torch.where(torch.isneginf(lse), torch.nan, lse)


def always_out_and_lse(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, scale=None):
    """No return_lse parameter: it returns (out, lse) on every call, and its lse is checked all the same."""
    out = oracle(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale)
    return out, torch.zeros(q.shape[1], q.shape[0])


def out_alone(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, scale=None):
    return oracle(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale)


def return_lse_ignored(q, k, v, *args, return_lse=False, **kwargs):
    return oracle(q, k, v, *args, **kwargs)


@pytest.mark.parametrize(
    ("fn", "layout"), [(lse_right, "(H, T_q)"), (lse_transposed, "(T_q, H)")], ids=["contract-layout", "transposed"]
)
def test_a_right_lse_passes_in_either_layout(fn, layout):
    result = audit(fn, budget=0, checks=["lse"]).result("lse")
    assert result.verdict is Verdict.PASS, result
    assert result.evidence.startswith(f"lse laid out {layout}: worst REAL error") and "; -inf on every row" in result.evidence


def test_flashattentions_plus_inf_is_a_convention_not_a_failure():
    result = audit(lse_plus_inf_without_keys, budget=0, checks=["lse"]).result("lse")
    assert result.verdict is Verdict.PASS and "; +inf on every row that sees no key" in result.evidence, result


@pytest.mark.parametrize(
    ("fn", "evidence"),
    [
        (lse_unscaled, r"REAL rows: error .* > bound"),
        (lse_nan_on_padding, r"14 of 14 values \(7 rows x 2 heads\) on GAP and TAIL rows are not an infinity \(e\.g\. nan\)"),
        (always_out_and_lse, r"REAL rows: error .* > bound"),
        (return_lse_ignored, r"no output: return_lse_ignored returned Tensor with return_lse=True, not \(out, lse\)"),
    ],
    ids=["unscaled", "nan-on-padding", "no-return-lse-parameter", "return-lse-ignored"],
)
def test_a_wrong_lse_fails_with_what_is_wrong(fn, evidence):
    report = audit(fn, budget=0, checks=["real-accuracy", "lse"])
    assert report.verdicts() == {"real-accuracy": "pass", "lse": "FAIL"}, report.table()
    assert re.search(evidence, report.result("lse").evidence), report.result("lse").evidence


def lse_finite_on_real_rows_without_keys(q, k, v, cu_q, *args, return_lse=False, cu_seqlens_q_padded=None, **kwargs):
    """-inf on padding rows, but 0 where a REAL row sees no key (causal, len_q > len_k)."""
    kwargs["cu_seqlens_q_padded"] = cu_seqlens_q_padded
    out = oracle(q, k, v, cu_q, *args, **kwargs)
    if not return_lse:
        return out
    lse = _lse(q, k, v, cu_q, *args, **kwargs)
    real = torch.zeros(q.shape[0], dtype=torch.bool)
    real[real_rows(cu_q, cu_seqlens_q_padded)] = True
    return out, torch.where(torch.isneginf(lse) & real, 0.0, lse)


def test_real_rows_that_see_no_key_must_hold_an_infinity():
    result = audit(lse_finite_on_real_rows_without_keys, budget=0, checks=["lse"]).result("lse")
    assert result.verdict is Verdict.FAIL and result.cases[0].causal, result
    assert result.evidence.endswith(
        "6 of 6 values (3 rows x 2 heads) on REAL rows that see no key are not an infinity (e.g. 0)"
    ), result.evidence


def test_a_function_that_gives_no_lse_is_na_with_the_reason():
    result = audit(out_alone, budget=0, checks=["lse"]).result("lse")
    assert result.verdict is Verdict.NA
    assert (
        result.evidence == "out_alone returns Tensor, not (out, lse), and has no return_lse parameter: it gives no lse to check"
    )
