"""FlashAttention-style error bounds, relative to what PyTorch itself achieves.

A kernel in a low-precision dtype cannot match the float64 oracle exactly; the honest bar is
PyTorch doing the same computation in the same dtype. FlashAttention's tests require the
kernel's max error to be at most 2x PyTorch's for the output and 3x for gradients. PyTorch's
error is floored at the rounding of fp32 accumulation, which every kernel here uses: sqrt(head_dim)
float32 ulps of the oracle's magnitude (a length-D dot product's rounding). It matters only where
PyTorch happens to be exact (one key: dS = P(dP - delta) cancels to 0 exactly in PyTorch's
formula, while a kernel computing dP and delta by separate dots cannot) — and at one ulp of the
output dtype, the unavoidable rounding of the fp32 result (one bf16 key: PyTorch's dv = dO is
exact, a kernel's fp32 p * dO rounded to bf16 may not be). Elsewhere PyTorch's own error is the
larger, so the bound stays FlashAttention's.
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
        """Kernel error in units of PyTorch's own error (<= factor passes)."""
        return self.error / max(self.baseline, self.floor)

    def __str__(self) -> str:
        verdict = "ok" if self.within else "FAIL"
        return f"{self.name}: err {self.error:.3g} <= {self.factor:g} x max({self.baseline:.3g}, {self.floor:.2g})  [{verdict}]"


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.double() - b.double()).abs()
    if diff.numel() == 0:
        return 0.0
    return float("nan") if torch.isnan(diff).any() else float(diff.max())


def error_check(name: str, value: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor, dtype: torch.dtype) -> ErrorCheck:
    """Compares `value` and `baseline` (PyTorch in `dtype`) with `oracle`, all already restricted to REAL rows."""
    finite_oracle = oracle[torch.isfinite(oracle)]
    magnitude = float(finite_oracle.abs().max()) if finite_oracle.numel() else 0.0
    scale = max(1.0, magnitude)
    accumulation = torch.finfo(torch.float32).eps * scale * math.sqrt(value.shape[-1] if value.dim() else 1)
    storage = torch.finfo(dtype).eps * scale  # the one rounding of the fp32 result to the output dtype
    floor = max(accumulation, storage)
    factor = FACTORS.get(name, 3.0)
    return ErrorCheck(name, _max_abs_diff(value, oracle), _max_abs_diff(baseline, oracle), factor, floor)


def lse_error(value: torch.Tensor, oracle: torch.Tensor) -> float:
    """Max error between two lse tensors, where -inf must match -inf exactly."""
    both_inf = torch.isneginf(value) & torch.isneginf(oracle)
    if (torch.isneginf(value) != torch.isneginf(oracle)).any():
        return math.inf
    return _max_abs_diff(value[~both_inf], oracle[~both_inf])
