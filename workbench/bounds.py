"""FlashAttention-style error bounds, relative to what PyTorch itself achieves.

A kernel in a low-precision dtype cannot match the float64 oracle exactly; the honest bar is
PyTorch doing the same computation in the same dtype. FlashAttention's tests require the
kernel's max error to be at most 2x PyTorch's for the output and 3x for gradients.

PyTorch's error is one draw of the rounding, and where it is small its draw can be smaller
than a correct kernel's. So it is floored at the fp32 rounding that no correct kernel
accumulating in fp32 avoids, in ulps of the oracle's magnitude (at least 1: unit-scale inputs):

* sqrt(D + n) for the sums: each value is a length-D dot (a score, or dP = dO . v) summed over
  n terms, the keys a query sees (out, lse, dq) or the query rows, through a GQA group, that a
  key is seen by (dk, dv). sqrt is the probabilistic bound of rounding errors that are
  independent with mean zero (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019); the worst case
  is D + n, which no kernel reaches.
* ln(keys) for the softmax: FlashAttention's exp2 with scale * log2(e) folded in and rounded to
  fp32 perturbs p_j relatively by an ulp per unit of its gap to the row max, x_max - x_j (the
  rounding of each logit itself PyTorch's fp32 scores carry too). The probabilities weight
  those gaps, and sum_j p_j (x_max - x_j) <= lse - sum_j p_j x_j (the row's entropy) <=
  ln(keys), however wide the logits spread.

In float32 this floor is nearly always the larger (PyTorch's error is typically under a fifth of it),
so there the bound is 2x / 3x the rounding no fp32 kernel avoids. In float16 and bfloat16
PyTorch's own error is the larger and the bound stays FlashAttention's, except where PyTorch is
near exact (one key: dS = P(dP - delta) cancels to 0 exactly in PyTorch's formula, while a
kernel computing dP and delta by separate dots cannot) and at one ulp of the output dtype, the
unavoidable rounding of the fp32 result (one bf16 key: PyTorch's dv = dO is exact, a kernel's
fp32 p * dO rounded to bf16 may not be). Either way the bound stays far below what a wrong key
costs (a whole p_j * v_j, about |v| / keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FACTORS = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}


@dataclass(frozen=True)
class ErrorCheck:
    """The error of one tensor on REAL rows against the oracle, and its bound."""

    name: str
    error: float  # max |impl - oracle|
    baseline: float  # max |PyTorch in the same dtype - oracle|
    factor: float
    floor: float

    @property
    def bound(self) -> float:
        return self.factor * max(self.baseline, self.floor)

    @property
    def within(self) -> bool:
        """False for NaN errors: a NaN never passes a bound."""
        return bool(self.error <= self.bound)

    @property
    def ratio(self) -> float:
        """Kernel error in units of PyTorch's own error, or of the floor where that is the larger (<= factor passes)."""
        return self.error / max(self.baseline, self.floor)

    def __str__(self) -> str:
        verdict = "ok" if self.within else "FAIL"
        return f"{self.name}: err {self.error:.3g} <= {self.factor:g} x max({self.baseline:.3g}, {self.floor:.2g})  [{verdict}]"


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.double() - b.double()).abs()
    if diff.numel() == 0:
        return 0.0
    return float("nan") if torch.isnan(diff).any() else float(diff.max())


# dk and dv sum over the query rows a key is seen by; every other tensor over a query's keys.
_SUMMED_OVER_QUERIES = ("dk", "dv")


def _fp32_ulps(name: str, head_dim: int, keys: int, queries: int | None = None) -> float:
    """The floor of `name`'s error in fp32 ulps of its magnitude (see the module docstring)."""
    if keys < 0:
        raise ValueError(f"keys = {keys} counts the keys a query sees; it must be >= 0 (e.g. max_seqlen_k).")
    if name in _SUMMED_OVER_QUERIES:
        if queries is None or queries < 0:
            raise ValueError(
                f"{name} sums over query rows: pass queries >= 0, the most query rows one key is seen by "
                f"(max_seqlen_q x the GQA group heads // kv_heads), got {queries}."
            )
        terms = queries
    else:
        terms = keys
    return math.sqrt(head_dim + terms) + math.log(max(keys, 1))


def error_check(
    name: str,
    value: torch.Tensor,
    oracle: torch.Tensor,
    baseline: torch.Tensor,
    dtype: torch.dtype,
    *,
    keys: int,
    queries: int | None = None,
    head_dim: int | None = None,
) -> ErrorCheck:
    """Compares `value` and `baseline` (PyTorch in `dtype`) with `oracle`, all already restricted to REAL rows.

    `keys`: the most keys one query sees (`max_seqlen_k` bounds it); `queries`, needed for dk and
    dv: the most query rows one key is seen by, over its GQA group (`max_seqlen_q * heads // kv_heads`).
    `PackedBatch.reduction_lengths()` gives both for a batch. `head_dim`: the length of each
    score's dot, by default `value`'s last dimension (out and the gradients end in it); lse,
    which has none, must pass it.
    """
    if head_dim is None:
        if name == "lse":
            raise ValueError("error_check('lse', ...) needs head_dim=: lse has no head dimension to read it from.")
        head_dim = value.shape[-1] if value.dim() else 1
    finite_oracle = oracle[torch.isfinite(oracle)]
    magnitude = float(finite_oracle.abs().max()) if finite_oracle.numel() else 0.0
    scale = max(1.0, magnitude)
    accumulation = torch.finfo(torch.float32).eps * scale * _fp32_ulps(name, head_dim, keys, queries)
    storage = torch.finfo(dtype).eps * scale  # the one rounding of the fp32 result to the output dtype
    floor = max(accumulation, storage)
    factor = FACTORS.get(name, 3.0)
    error = lse_error if name == "lse" else _max_abs_diff  # lse: -inf rows (no visible key) must match
    return ErrorCheck(name, error(value, oracle), error(baseline, oracle), factor, floor)


def lse_error(value: torch.Tensor, oracle: torch.Tensor) -> float:
    """Max error between two lse tensors, where -inf must match -inf exactly."""
    both_inf = torch.isneginf(value) & torch.isneginf(oracle)
    if (torch.isneginf(value) != torch.isneginf(oracle)).any():
        return math.inf
    return _max_abs_diff(value[~both_inf], oracle[~both_inf])
