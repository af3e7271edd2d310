"""Post-mortem te-thd-2892: TE's layout contract and test recipe, the workaround, RoPE, claims."""
from __future__ import annotations

import math

import pytest
import torch

from kernels import varlen_attention
from postmortems import te_thd_2892 as pm
from workbench import Region, pack, probe, reference_attention
from workbench.tinylm import dense_attention


def ignores_padded_layout(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    """A backend that reads memory by the real boundaries (the FlashAttention-2 path TE
    disables when padding sits between sequences)."""
    kwargs.pop("cu_seqlens_q_padded"), kwargs.pop("cu_seqlens_k_padded")
    return reference_attention(q, k, v, cu_q, cu_k, max_q, max_k, compute_dtype=q.dtype, **kwargs)


def test_te_docstring_example_through_the_fixed_kernel():
    record = pm.layout_contract()
    assert pm.TE_DOCSTRING.padded_lengths("q") == (4, 4, 5)  # cu_seqlens_q_padded = [0, 4, 8, 13]
    assert record.tensors["out"].shape == (13, 2, 16)
    assert (record.regions_q == Region.REAL).sum() == 9  # cu_seqlens_q = [0, 3, 5, 9]
    assert record.real_finite and record.padding_exactly_zero and record.real_within_bound


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_te_recipe_on_the_fixed_kernel(dtype):
    result = pm.te_recipe(varlen_attention, (5, 9, 3, 12), dtype=dtype, seed=1)
    assert sum(result.pads) > 0, "the drawn layout must contain padding between sequences"
    assert result.te_passes, result.te_error
    assert result.within_bound, [str(c) for c in result.checks.values()]
    assert result.padding_max_abs == 0.0


def test_te_recipe_catches_a_backend_that_ignores_the_padded_layout():
    result = pm.te_recipe(ignores_padded_layout, (5, 9, 3, 12), seed=1)
    assert not result.te_passes and not result.within_bound


def test_te_recipe_rejects_dtypes_without_te_tolerance():
    with pytest.raises(ValueError, match="dtype = 'float32': TE's recipe states tolerances"):
        pm.te_recipe(varlen_attention, (4, 4), dtype="float32")


@pytest.mark.parametrize("causal", [False, True])
def test_workaround_on_the_fixed_kernel(causal):
    check = pm.workaround_error(pm.padding_case(0.2, causal=causal))
    # Non-causal: padding keys steal softmax mass. Causal: trailing padding is never visible.
    assert check.within is causal, str(check)


def test_workaround_error_grows_with_padding():
    sweep = pm.workaround_sweep(dense_attention)
    errors = [c.error for _, c in sweep[False]]
    assert sweep[False][0][1].within and not any(c.within for f, c in sweep[False] if f > 0)
    assert errors == sorted(errors)
    assert all(c.within for _, c in sweep[True])


def test_padding_case_rejects_bad_fractions():
    with pytest.raises(ValueError, match="fraction = 1.0 must be in"):
        pm.padding_case(1.0, causal=True)


def test_tail_blind_backend_leaves_tail_rows_unwritten():
    case = pm.Case((6, 5), padded_q=(6, 9), heads=2, head_dim=16, causal=True, fill=pm.Fill.ZEROS)
    record = probe(pm.tail_blind(dense_attention), pack(case, "cpu"), poisoned=True)
    tail = record.regions_q == Region.GAP  # the last sequence's padding: a tail in TE's eyes
    assert torch.isnan(record.tensors["out"][tail]).all() and torch.isnan(record.tensors["dq"][tail]).all()
    assert record.real_within_bound  # real rows are exact: the damage is what is not written
    assert probe(pm.tail_blind(dense_attention), pack(case, "cpu")).real_within_bound


def test_training_three_ways():
    runs = pm.train_three_ways(steps=12)
    correct, workaround, end, blind = (runs[name][0] for name in pm.TRAINING_RUNS)
    assert workaround.losses == correct.losses  # causal masking hides trailing padding exactly
    assert end.losses == pytest.approx(correct.losses, rel=1e-5)
    assert not math.isfinite(blind.final_loss)
    chain = runs[pm.TRAINING_RUNS[-1]][1].causal_chain()
    assert chain.origin.step == 0 and chain.first_parameter == "norm.weight"


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_fp8_scales_from_real_rows_survive_poisoned_padding():
    study = pm.fp8_study(fills=(pm.Fill.HUGE, pm.Fill.NAN))
    assert study[("huge", "real")].within and study[("nan", "real")].within
    assert not study[("huge", "all")].within and study[("huge", "all")].ratio > 10  # real tokens rounded to 0
    assert math.isnan(study[("nan", "all")].error)
