"""Post-mortem te-thd-2892: TE's layout contract and test recipe, the workaround, RoPE, claims."""
from __future__ import annotations

import pytest
import torch

from kernels import varlen_attention
from postmortems import te_thd_2892 as pm
from workbench import Region, reference_attention


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
