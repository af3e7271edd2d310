"""varlen_workbench.workbench.bounds: the fp32 floor covers a correct kernel's rounding, and a real bug still fails."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from varlen_workbench.kernels import varlen
from varlen_workbench.workbench.bounds import error_check
from varlen_workbench.workbench.layout import Case, Fill, Region, pack
from varlen_workbench.workbench.reference import reference_attention

varlen_attention = functools.partial(varlen.varlen_attention, backend="triton")
EPS32 = torch.finfo(torch.float32).eps


def _forward(case: Case) -> tuple[dict[str, int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reduction lengths, kernel out, fp64 oracle, PyTorch in the case's dtype) on REAL rows."""
    batch = pack(case, requires_grad=False)
    real = batch.regions_q == Region.REAL
    kernel = batch.call(varlen_attention).cpu()[real]
    oracle = batch.call(reference_attention).cpu()[real]
    baseline = batch.call(reference_attention, compute_dtype=batch.q.dtype).cpu()[real]
    return batch.reduction_lengths(), kernel, oracle, baseline


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("keys", [0, 1, 67, 4096])
def test_floor_never_drops_below_one_length_d_dot(head_dim, keys):
    """The floor grows with the sums behind a tensor; it never falls below sqrt(D) fp32 ulps."""
    oracle = torch.full((3, 2, head_dim), 0.5, dtype=torch.float64)
    for name in ("out", "dq", "dk", "dv"):
        check = error_check(name, oracle.float(), oracle, oracle, torch.float32, keys=keys, queries=keys)
        assert check.floor >= EPS32 * math.sqrt(head_dim)  # scale max(1, 0.5) = 1
        assert check.floor == pytest.approx(EPS32 * (math.sqrt(head_dim + keys) + math.log(max(keys, 1))))


def test_dk_and_dv_sum_over_queries_the_rest_over_keys():
    oracle = torch.ones(4, 1, 16, dtype=torch.float64)
    floor = {
        name: error_check(name, oracle, oracle, oracle, torch.float32, keys=9, queries=400).floor
        for name in ("out", "dq", "dk", "dv")
    }
    assert floor["out"] == floor["dq"] < floor["dk"] == floor["dv"]


def test_missing_lengths_name_the_argument():
    x = torch.ones(4, 1, 16)
    with pytest.raises(ValueError, match="pass queries >= 0"):
        error_check("dk", x, x, x, torch.float32, keys=4)
    with pytest.raises(ValueError, match="keys = -1"):
        error_check("out", x, x, x, torch.float32, keys=-1)
    with pytest.raises(ValueError, match="needs head_dim="):
        error_check("lse", x[:, 0, 0], x[:, 0, 0], x[:, 0, 0], torch.float32, keys=4)


def test_lse_rows_without_keys_must_match_exactly():
    oracle = torch.tensor([1.5, -math.inf], dtype=torch.float64)
    check = functools.partial(error_check, "lse", oracle=oracle, baseline=oracle, dtype=torch.float32, keys=3, head_dim=16)
    assert check(value=oracle.float()).within
    assert not check(value=torch.tensor([1.5, 0.0])).within


def test_where_pytorch_is_the_larger_the_bound_stays_flashattentions():
    lengths, kernel, oracle, baseline = _forward(Case((67,), heads=1, head_dim=16, dtype="float16"))
    check = error_check("out", kernel, oracle, baseline, torch.float16, **lengths)
    assert check.baseline > check.floor and check.bound == 2 * check.baseline and check.within


def test_planted_errors_fail_the_floored_bound():
    """fp32 over 67 keys, where the floor is larger than PyTorch's error: ten floors off in one
    value fails, and so does a kernel that drops one key (by thousands of bounds)."""
    case = Case((67,), heads=1, head_dim=16, dtype="float32", fill=Fill.NAN)
    lengths, kernel, oracle, baseline = _forward(case)
    check = functools.partial(error_check, "out", oracle=oracle, baseline=baseline, dtype=torch.float32, **lengths)
    assert check(kernel).within and check(kernel).floor > check(kernel).baseline
    planted = kernel.clone()
    planted[33, 0, 5] += 10 * check(kernel).floor
    assert not check(planted).within
    batch = pack(case, requires_grad=False)
    batch.v[40] = 0  # key 40's value never reaches any query
    dropped = batch.call(varlen_attention).cpu()[batch.regions_q == Region.REAL]
    assert check(dropped).error > 1000 * check(dropped).bound
