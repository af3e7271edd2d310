"""The probe must report exactly what an implementation did, including its lies."""

from __future__ import annotations

import pytest
import torch

from varlen_workbench.workbench.layout import Case, Fill, Region, pack
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.reference import reference_attention


def in_dtype(*args, **kwargs):
    """A correct implementation in the inputs' own dtype (PyTorch's own attention)."""
    return reference_attention(*args, **kwargs, compute_dtype=args[0].dtype)


class _LeaveTailUninitialised(torch.autograd.Function):
    """The torch bug's mechanism in miniature: copy real rows into an `empty` buffer."""

    @staticmethod
    def forward(ctx, out, total):
        ctx.rows = out.shape[0]
        result = torch.empty((total, *out.shape[1:]), dtype=out.dtype, device=out.device)
        result[: out.shape[0]] = out
        return result

    @staticmethod
    def backward(ctx, grad):
        return grad[: ctx.rows], None


def tail_left_uninitialised(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    end = int(cu_q[-1])
    out = in_dtype(q[:end], k, v, cu_q, cu_k, max_q, max_k, **{**kwargs, "cu_seqlens_q_padded": None})
    return _LeaveTailUninitialised.apply(out, q.shape[0])


def wrong_scale(*args, **kwargs):
    return in_dtype(*args, **{**kwargs, "scale": 1.0})


def test_correct_impl_passes_every_check():
    batch = pack(Case((7, 3), padded_q=(9, 3), tail_q=2, heads=2, head_dim=16, causal=True, fill=Fill.NAN))
    record = probe(in_dtype, batch)
    assert record.real_finite and record.padding_exactly_zero and record.real_within_bound
    assert set(record.errors) == {"out", "dq", "dk", "dv"}
    assert record.summary()["nonfinite_tail"] == 0
    assert record.impl == "in_dtype"


def test_uninitialised_tail_is_nan_under_poisoning_and_counted_per_region():
    batch = pack(Case((6, 4), tail_q=3, heads=1, head_dim=8, fill=Fill.ZEROS))
    record = probe(tail_left_uninitialised, batch, poisoned=True)
    assert record.nonfinite["out"]["TAIL"] == 3 * 1 * 8
    assert record.nonfinite["out"]["REAL"] == 0 and record.nonfinite["out"]["GAP"] == 0
    assert record.max_abs["out"]["TAIL"] != record.max_abs["out"]["TAIL"]  # NaN
    assert not record.padding_exactly_zero
    assert torch.isnan(record.token_norms["out"][batch.regions_q == Region.TAIL]).all()
    # Without poisoning the same rows hold whatever memory held: not reliably NaN.
    assert record.real_within_bound  # REAL rows are still right: the bug is silent there


def test_wrong_scale_is_outside_the_bound_while_finite():
    batch = pack(Case((9, 5), heads=2, head_dim=16))
    record = probe(wrong_scale, batch)
    assert record.real_finite
    assert not record.real_within_bound
    assert record.errors["out"].ratio > 100


def test_semantic_keywords_reach_the_oracle_too():
    batch = pack(Case((9, 5), heads=2, head_dim=16, causal=False))
    assert probe(in_dtype, batch, scale=0.9).real_within_bound
    assert probe(in_dtype, batch, causal=True).real_within_bound


def test_grad_out_kinds_and_errors():
    batch = pack(Case((4,), heads=1, head_dim=8))
    ones = probe(in_dtype, batch, grad_out="ones")
    randn = probe(in_dtype, batch, grad_out="randn")
    assert not torch.equal(ones.tensors["dv"], randn.tensors["dv"])
    with pytest.raises(ValueError, match="grad_out = 'zeros' must be one of"):
        probe(in_dtype, batch, grad_out="zeros")
    with pytest.raises(ValueError, match="grad_out has shape"):
        probe(in_dtype, batch, grad_out=torch.ones(1))


def test_forward_only_probe_and_no_reference():
    batch = pack(Case((4,), heads=1, head_dim=8))
    record = probe(in_dtype, batch, backward=False, reference=False)
    assert set(record.tensors) == {"out"} and record.errors == {}
    assert not record.real_within_bound  # nothing was checked, so nothing is claimed


def test_probe_leaves_the_callers_batch_untouched():
    batch = pack(Case((4,), heads=1, head_dim=8))
    probe(in_dtype, batch)
    assert batch.q.grad is None


def test_probe_handles_a_batch_with_no_rows():
    record = probe(in_dtype, pack(Case((0, 0), heads=1, head_dim=8)))
    assert record.nonfinite["out"] == {"REAL": 0, "GAP": 0, "TAIL": 0}
    assert record.padding_exactly_zero and record.token_norms["dq"].shape == (0,)
