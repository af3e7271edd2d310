"""Probes: run any implementation of the contract forward and backward, and record what it did.

`probe(impl, batch)` returns one `ProbeRecord`: the tensors (out, dq, dk, dv), their
non-finite counts and largest magnitudes per region (REAL / GAP / TAIL), per-token norms,
the error on REAL rows against the float64 oracle with a FlashAttention-style bound, and wall
time. Notebooks, sweeps, plots and the audit all consume this one record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from varlen_workbench.workbench.bounds import ErrorCheck, error_check
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.layout import PackedBatch, Region
from varlen_workbench.workbench.reference import reference_attention

TENSORS = ("out", "dq", "dk", "dv")
# Keyword arguments that change the attention computed, so the oracle must see them too.
SEMANTIC_KWARGS = ("scale", "causal", "window_size", "cu_seqlens_q_padded", "cu_seqlens_k_padded")
GRAD_OUT_KINDS = ("randn", "ones")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grad_output(batch: PackedBatch, kind: str | torch.Tensor = "randn") -> torch.Tensor:
    """The upstream gradient dO, drawn from the case's seed (`ones` is what `.sum()` gives).

    It is non-zero on padding rows too: a correct kernel must ignore dO there.
    """
    if isinstance(kind, torch.Tensor):
        return kind
    shape = batch.out_shape
    if kind == "ones":
        return torch.ones(shape, dtype=batch.q.dtype, device=batch.device)
    if kind == "randn":
        generator = torch.Generator().manual_seed(batch.case.seed + 1)
        return torch.randn(shape, generator=generator).to(batch.q.dtype).to(batch.device)
    raise ValueError(f"grad_out = {kind!r} must be one of {GRAD_OUT_KINDS} or a tensor shaped like the output.")


def _run(impl: Callable, batch: PackedBatch, d_out: torch.Tensor, backward: bool, kwargs: dict) -> tuple[dict, float, float]:
    _sync(batch.device)
    start = time.perf_counter()
    result = batch.call(impl, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    _sync(batch.device)
    forward_s = time.perf_counter() - start
    tensors = {"out": out.detach()}
    backward_s = 0.0
    if backward:
        start = time.perf_counter()
        out.backward(d_out)
        _sync(batch.device)
        backward_s = time.perf_counter() - start
        for name, leaf in (("dq", batch.q), ("dk", batch.k), ("dv", batch.v)):
            tensors[name] = leaf.grad.detach() if leaf.grad is not None else torch.zeros_like(leaf)
    return tensors, forward_s, backward_s


def _oracle(batch: PackedBatch, d_out: torch.Tensor, dtype: torch.dtype, backward: bool, kwargs: dict) -> dict[str, torch.Tensor]:
    """Reference tensors with the computation done in `dtype` (float64: the oracle)."""
    leaves = [t.detach().to(dtype).requires_grad_(backward) for t in (batch.q, batch.k, batch.v)]
    semantic = {k: v for k, v in kwargs.items() if k in SEMANTIC_KWARGS}
    out = reference_attention(*leaves, *batch.args()[3:], **{**batch.kwargs(), **semantic}, compute_dtype=dtype, validate=False)
    tensors = {"out": out.detach()}
    if backward:
        out.backward(d_out.to(dtype))
        tensors.update(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    return tensors


@dataclass
class ProbeRecord:
    """Everything one forward+backward of one implementation on one batch showed."""

    impl: str
    case: Any  # varlen_workbench.workbench.layout.Case
    device: str
    poisoned: bool
    tensors: dict[str, torch.Tensor] = field(repr=False)  # out, dq, dk, dv on CPU
    regions_q: torch.Tensor = field(repr=False)
    regions_k: torch.Tensor = field(repr=False)
    nonfinite: dict[str, dict[str, int]]  # tensor -> region -> non-finite element count
    max_abs: dict[str, dict[str, float]]  # tensor -> region -> max |x| (NaN if any NaN)
    token_norms: dict[str, torch.Tensor] = field(repr=False)  # tensor -> per-row L2 norm
    errors: dict[str, ErrorCheck]  # tensor -> error on REAL rows vs the oracle (empty if skipped)
    forward_s: float
    backward_s: float

    def regions(self, name: str) -> torch.Tensor:
        return self.regions_q if name in ("out", "dq") else self.regions_k

    @property
    def real_finite(self) -> bool:
        return all(counts["REAL"] == 0 for counts in self.nonfinite.values())

    @property
    def real_within_bound(self) -> bool:
        return bool(self.errors) and all(e.within for e in self.errors.values())

    @property
    def padding_exactly_zero(self) -> bool:
        """Every GAP and TAIL row of every tensor is exactly 0 (NaN counts as not zero)."""
        return all(self.max_abs[name][r] == 0.0 for name in self.max_abs for r in ("GAP", "TAIL"))

    def nonfinite_in(self, region: str, tensors: tuple[str, ...] = TENSORS) -> int:
        return sum(self.nonfinite[t][region] for t in tensors if t in self.nonfinite)

    def summary(self) -> dict[str, Any]:
        """One flat, JSON-ready row for tables and sweeps."""
        row: dict[str, Any] = {"impl": self.impl, "case": self.case.label(), "device": self.device, "poisoned": self.poisoned}
        for region in ("REAL", "GAP", "TAIL"):
            row[f"nonfinite_{region.lower()}"] = self.nonfinite_in(region)
        row["padding_max_abs"] = max(
            (self.max_abs[n][r] for n in self.max_abs for r in ("GAP", "TAIL")), key=_nan_first, default=0.0
        )
        for name, check in self.errors.items():
            row[f"{name}_err"] = check.error
            row[f"{name}_ratio"] = check.ratio
        row["real_within_bound"] = self.real_within_bound
        row["padding_exactly_zero"] = self.padding_exactly_zero
        row["forward_s"], row["backward_s"] = self.forward_s, self.backward_s
        return row


def _nan_first(x: float) -> float:
    return float("inf") if x != x else x


def _region_stats(x: torch.Tensor, regions: torch.Tensor) -> tuple[dict[str, int], dict[str, float]]:
    flat = x.detach().flatten(1)  # (rows, heads*dim); works for 0 rows too
    counts, peaks = {}, {}
    for region in Region:
        rows = flat[regions == region]
        counts[region.name] = int((~torch.isfinite(rows)).sum())
        if rows.numel() == 0:
            peaks[region.name] = 0.0
        elif torch.isnan(rows).any():
            peaks[region.name] = float("nan")
        else:
            peaks[region.name] = float(rows.abs().max())
    return counts, peaks


def probe(
    impl: Callable,
    batch: PackedBatch,
    *,
    name: str | None = None,
    grad_out: str | torch.Tensor = "randn",
    poisoned: bool = False,
    reference: bool = True,
    backward: bool = True,
    **impl_kwargs: Any,
) -> ProbeRecord:
    """Runs `impl` forward (and backward) on a fresh copy of `batch` and records the result.

    `impl` takes the contract's arguments (`varlen_attention`'s signature). With
    `poisoned=True` it runs under `poisoned_memory()`, so rows it never writes hold NaN.
    `reference=False` skips the oracle (for speed in large sweeps).
    """
    fresh = batch.fresh(requires_grad=backward)
    d_out = grad_output(fresh, grad_out)
    if d_out.shape != fresh.out_shape:
        raise ValueError(
            f"grad_out has shape {tuple(d_out.shape)}; it must match the output's {tuple(fresh.out_shape)} (q's rows and "
            "heads, v's head dim)."
        )
    if poisoned:
        with poisoned_memory():
            tensors, forward_s, backward_s = _run(impl, fresh, d_out, backward, impl_kwargs)
    else:
        tensors, forward_s, backward_s = _run(impl, fresh, d_out, backward, impl_kwargs)
    tensors = {n: t.cpu() for n, t in tensors.items()}

    nonfinite, max_abs, norms = {}, {}, {}
    for tname, t in tensors.items():
        regions = fresh.regions(tname)
        nonfinite[tname], max_abs[tname] = _region_stats(t, regions)
        norms[tname] = t.double().flatten(1).norm(dim=1)

    errors: dict[str, ErrorCheck] = {}
    if reference:
        oracle = _oracle(fresh, d_out, torch.float64, backward, impl_kwargs)
        baseline = _oracle(fresh, d_out, fresh.q.dtype, backward, impl_kwargs)
        for tname, t in tensors.items():
            real = fresh.regions(tname) == Region.REAL
            errors[tname] = error_check(
                tname,
                t[real],
                oracle[tname].cpu()[real],
                baseline[tname].cpu()[real],
                fresh.q.dtype,
                head_dim=fresh.dot_length,
                **fresh.reduction_lengths(),
            )

    return ProbeRecord(
        impl=name or str(getattr(impl, "__name__", type(impl).__name__)),
        case=batch.case,
        device=str(batch.device),
        poisoned=poisoned,
        tensors=tensors,
        regions_q=fresh.regions_q,
        regions_k=fresh.regions_k,
        nonfinite=nonfinite,
        max_abs=max_abs,
        token_norms=norms,
        errors=errors,
        forward_s=forward_s,
        backward_s=backward_s,
    )
