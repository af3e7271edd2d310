"""Post-mortem flash-dmattn-121: its oracle, its diagnosis rule, its cases and claims (the notebook runs the whole study)."""

import math

import pytest
import torch

from postmortems import flash_dmattn_121 as pm
from workbench.postmortem import Claims


def _qkv(batch=2, seqlen=24, heads=2, head_dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seqlen, heads, head_dim, generator=generator, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_dense_reference_matches_sdpa(causal):
    q, k, v = _qkv()
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 1, 24, 24, generator=generator) < 0.6
    mask[..., 0] = True  # no fully masked row: SDPA's semantics coincide
    bias = torch.randn(2, 1, 24, 24, generator=generator, dtype=torch.float64)
    out, lse = pm.dense_reference(q, k, v, mask, bias, causal)
    attn = bias.masked_fill(~mask, -math.inf)
    if causal:
        attn = attn.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), -math.inf)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn
    )
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-12)
    scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * 8**-0.5 + attn
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-12)


def test_dense_reference_rows_without_keys_are_zero_with_zero_gradient():
    q, k, v = (t.requires_grad_() for t in _qkv(batch=1, heads=1))
    mask = torch.ones(1, 1, 24, 24, dtype=torch.bool)
    mask[:, :, 3] = False
    out, lse = pm.dense_reference(q, k, v, mask)
    out.sum().backward()
    assert torch.equal(out[0, 3], torch.zeros_like(out[0, 3])) and torch.isneginf(lse[0, 0, 3])
    assert torch.equal(q.grad[0, 3], torch.zeros_like(q.grad[0, 3]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_mask_patterns():
    case = pm.MaskCase("t", "leading", amount=5, seqlen=64, block_n=32)
    mask = case.mask()[0, 0]
    assert not mask[:5, :32].any() and mask[:5, 32:].all() and mask[5:].all()
    padded = pm.MaskCase("t", "left_pad", amount=7, batch=2, seqlen=16).mask()
    assert padded[0].all() and not padded[1, :, :, :7].any() and padded[1, :, :, 7:].all()
    assert pm.MaskCase("t", "none").mask() is None


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(pattern="diagonal"), "pattern"),
        (dict(pattern="left_pad"), "batch >= 2"),
        (dict(pattern="random", amount=2.0), "0..1"),
    ],
)
def test_mask_case_rejects_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        pm.MaskCase("bad", **fields)


def test_prediction_matches_the_kernel_and_can_disagree():
    case = pm.MaskCase("t", "rows", amount=3, seqlen=32, head_dim=16, block_m=16, block_n=16)
    result = pm.run(case, "replica")
    predicted, observed = pm.predict_nan_rows(case), pm.observed_nan_rows(result)
    assert int(observed["lse"].sum()) == 3
    assert all(torch.equal(predicted[k], observed[k]) for k in ("lse", "out"))
    whole_tile = pm.MaskCase("t", "rows", amount=16, seqlen=32, head_dim=16, block_m=16, block_n=16)
    # Every row of tile 0 masked: no block visited, lse stays -inf, but the output scale is NaN.
    assert int(pm.predict_nan_rows(whole_tile)["lse"].sum()) == 0 and int(pm.predict_nan_rows(whole_tile)["out"].sum()) == 16
    assert not torch.equal(pm.predict_nan_rows(whole_tile)["lse"], observed["lse"])


def test_run_measures_the_guard_within_bound_and_the_patch_outside():
    case = pm.MaskCase("t", "leading", amount=4, seqlen=32, head_dim=16, block_m=16, block_n=16)
    fixed, patched = pm.run(case, "guard"), pm.run(case, "patch")
    assert fixed.all_finite and fixed.all_within
    assert patched.finite("dv") and not patched.finite("lse") and patched.error_ratio("dv") > 1
    with pytest.raises(ValueError, match="variant"):
        pm.run(case, "nan_to_num")


def test_patch_as_written_error_names_isfinite():
    assert "isfinite" in pm.patch_as_written_error()


def test_packed_equivalent_holds_the_dense_values():
    batch, d_out = pm.packed_equivalent()
    x = pm.PADDED.inputs()
    pad, n = int(pm.PADDED.amount), pm.PADDED.seqlen
    assert batch.cu_seqlens_q.tolist() == [0, n, n, 2 * n - pad]
    assert batch.cu_seqlens_q_padded.tolist() == [0, n, n + pad, 2 * n]
    assert torch.equal(batch.q.detach(), x["q"].reshape(-1, 1, pm.PADDED.head_dim)) and d_out.shape == batch.q.shape
    with pytest.raises(ValueError, match="PADDED"):
        pm.packed_equivalent(pm.LEADING)


def test_claims_fail_on_results_that_do_not_support_them():
    broken = pm.Results(
        runs={},
        nan_do={},
        nan_do_oracle_nonfinite={},
        isfinite_error="no error",
        isfinite_in_triton=True,
        coverage=[pm.Coverage((8, 8, False, 16, 16), False, True)],
        predictions={"x": False},
        sweep=pm.verification_sweep(densities=(0.5,), blocks=(16,)),
        padded={},
    )
    verdicts = pm.claims.check(broken)
    assert len(verdicts) == len(pm.claims) >= 10 and not any(v.holds for v in verdicts)


def test_meta_and_module_shape():
    assert pm.META.id == "flash-dmattn-121" and isinstance(pm.claims, Claims)
    assert pm.SEED.seqlen == 256 and pm.SEED.head_dim == 64 and pm.SEED.causal and pm.SEED.pattern == "none"
