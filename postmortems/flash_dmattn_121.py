"""Post-mortem flash-dmattn-121: fully masked rows make flash-dmattn's dK/dV NaN; the Copilot fix hides it.

The seed is a Copilot PR presented as the fix for flash-sparse-attention#121 (formerly
SmallDoges/flash-dmattn): `zeros_like` dk/dv buffers and `tl.where(tl.isfinite(x), x, 0.0)` over the
Triton backward. This module runs the upstream code itself, flash-dmattn 1.2.2's Triton backend
(`upstream_module()`: under the interpreter with its `q.is_cuda` assertions stripped, natively as
is), against a float64 dense oracle (`dense_reference`: a row with no visible key has output 0 and
gradient 0), on CPU in fp16 (the interpreter's bf16 `tl.dot` is broken) and, through `gpu_probes`,
on a GPU in bf16. It shows which of the report's claims hold on the released code, the NaN it does
have (a query row with no visible key in key block 0), two workarounds and a tiny model's training.

The replica (`kernels.replicas.dmattn`) is kept for what upstream cannot show: the Copilot patch
applied, and a guard for rows with no visible key.

`reproduce()` returns a `Results`; `claims` checks it; the notebook shows it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import itertools
import math
import subprocess
import sys
import time
import types
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import matplotlib
import matplotlib.colors
import numpy as np
import torch

from kernels import INTERPRETED, default_device, varlen_attention
from kernels.replicas.dmattn import isfinite_exists, launch_patch_as_written, triton_dmattn_func
from workbench import Case, Fill, pack, poisoned_memory, probe
from workbench.bounds import FACTORS, ErrorCheck, error_check, lse_error
from workbench.health import GradientHealth
from workbench.plots import plot_health  # importing plots also lets a cell ending with a Figure show it
from workbench.postmortem import (
    OURS,
    REPLICA,
    TOY,
    UPSTREAM_CPU,
    UPSTREAM_GPU,
    Claims,
    Link,
    Meta,
    figure,
    gpu_records,
    table,
)
from workbench.postmortem import Results as PostmortemResults
from workbench.sweep import SweepResult, sweep

META = Meta(
    id="flash-dmattn-121",
    title="flash-dmattn: its Triton backward NaN-fills dK and dV (lengths off 64, fully masked rows); the proposed NaN-to-zero patch would hide it",
    component="flash-dmattn 1.2.2 (now flash-sparse-attn) / Triton backend",
    category="training bug",
    impact="flash-dmattn 1.2.2 Triton: a length not a multiple of 64, or a row seeing none of keys 0-63 (left padding + causal), NaN-fills dK and dV",
    upstream_status="closed (not fixed)",
    status_note=(
        "#121 is closed; the last flash-dmattn release (1.2.2) still NaN-fills dK/dV in its Triton backend at lengths off 64 "
        "and for fully masked rows; flash-sparse-attn 2.x dropped the boolean-mask API; no fix was merged"
    ),
    our_verdict=(
        "the report's symptom is reproduced on the released Triton backend at lengths not a multiple of 64 (with dK NaN too), "
        "not on its own configuration (256); fully masked rows give a second NaN; the proposed patch cannot compile and, "
        "made to, turns the first into finite, wrong dK/dV and leaves the second's NaN output"
    ),
    detection="NaN in every dK/dV row (finite output) at lengths off 64; NaN output rows and NaN gradients with left padding + causal",
    fix_type="proposed: zeros_like + isfinite masking (cannot compile, hides NaN); workarounds: pad lengths to a multiple of 64, pad on the right or let padding rows see themselves",
    tags=("attention mask", "padding", "ragged length", "NaN", "unsound fix"),
    reported="2025-08-24",
    published="2026-11-29",
    revised="2026-12-01",
    links=(
        Link(
            "flash-sparse-attention#121",
            "https://github.com/HKUSTDial/flash-sparse-attention/issues/121",
            date="2025-08-24",
            kind="issue",
            status="closed; filed against the CUDA backend",
        ),
        Link(
            "flash-sparse-attention#136 (tensor sanitization)",
            "https://github.com/HKUSTDial/flash-sparse-attention/pull/136",
            date="2025-08-29",
            kind="PR",
            status="open, not merged: a nan_to_num helper",
        ),
        Link(
            "flash-sparse-attention#185 (varlen with mask and bias)",
            "https://github.com/HKUSTDial/flash-sparse-attention/pull/185",
            date="2025-10-09",
            kind="PR",
            status="merged; says it zeroes NaN/Inf values",
        ),
        Link(
            "flash-dmattn 1.2.2",
            "https://pypi.org/project/flash-dmattn/1.2.2/",
            date="2025-11-05",
            kind="release",
            status="last flash-dmattn release (sdist files dated 2025-11-05); Triton backend unguarded",
        ),
        Link(
            "flash-sparse-attn 2.0.6",
            "https://pypi.org/project/flash-sparse-attn/2.0.6/",
            date="2026-09-09",
            kind="release",
            status="latest (wheel files dated 2026-09-09); no boolean-mask API; import needs undeclared triton_kernels",
        ),
        Link(
            "guarded Triton backend in the successor repository (read at 0b8d052)",
            "https://github.com/HKUSTDial/flash-sparse-attention/blob/0b8d05282f725c7d823ca428c8d7d782aec69fa2/flash_sparse_attn/flash_sparse_attn_triton.py",
        ),
        Link("triton#11584 (interpreter bf16 dot)", "https://github.com/triton-lang/triton/issues/11584"),
    ),
    seed="001_90a18acb6ed00fca.txt",
)

VARIANTS = {"replica": {}, "patch": {"patch": True}, "guard": {"guard": True}}
TENSORS = ("out", "lse", "dq", "dk", "dv")
GRADS = ("dq", "dk", "dv")
PATTERNS = ("none", "all", "rows", "leading", "left_pad", "right_pad", "left_pad_self", "random")
PADDED_PATTERNS = ("left_pad", "right_pad", "left_pad_self")


# -- the oracle ------------------------------------------------------------------------------


def dense_reference(
    q, k, v, attn_mask=None, attn_bias=None, is_causal=False, scale=None, *, compute_dtype: torch.dtype = torch.float64
):
    """Dense masked attention with `triton_dmattn_func`'s signature, computed in `compute_dtype`.

    Scores `q k^T * scale + bias`; `attn_mask` False, and keys after the query when causal (top-left,
    as flash-dmattn), are invisible. A row with no visible key has output 0 and lse -inf, and
    autograd gives it gradient 0: exp(-inf - (-inf)) is never evaluated. Returns (out (B, Q, H, D),
    lse (B, H, Q)). With `compute_dtype` = the inputs' dtype it is "PyTorch in that dtype", the
    baseline of the FlashAttention-style bounds.
    """
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, group = k.shape[1], heads // k.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    qh = q.to(compute_dtype).transpose(1, 2)
    kh = k.to(compute_dtype).repeat_interleave(group, 2).transpose(1, 2)
    vh = v.to(compute_dtype).repeat_interleave(group, 2).transpose(1, 2)
    scores = qh @ kh.transpose(-1, -2) * scale
    shape = (batch, heads, seqlen_q, seqlen_k)
    if attn_bias is not None:
        scores = scores + attn_bias.to(compute_dtype).expand(batch, -1, seqlen_q, seqlen_k).repeat_interleave(group, 1)
    visible = torch.ones(shape, dtype=torch.bool, device=q.device)
    if is_causal:
        visible = visible & torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        visible = visible & attn_mask.expand(batch, -1, seqlen_q, seqlen_k).repeat_interleave(group, 1)
    has_key = visible.any(-1, keepdim=True)
    scores = torch.where(has_key, scores.masked_fill(~visible, float("-inf")), torch.zeros_like(scores))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = (torch.exp(scores - lse) * has_key) @ vh
    lse = torch.where(has_key, lse, torch.full_like(lse, float("-inf")))
    return out.transpose(1, 2), lse.squeeze(-1)


# -- the cases -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskCase:
    """A dense batch with a boolean mask pattern, described well enough to rebuild it bit for bit.

    `pattern` (one of PATTERNS) and its parameter `amount`:
    none: no mask; all: an all-True mask; rows: query rows [0, amount) fully masked;
    leading: key block 0 (the first `block_n` keys) masked for query rows [0, amount);
    left_pad: batch item 1 left-padded with `amount` tokens, masked as keys for every query
    (HF's 4-D mask); right_pad: the same padding at the end of item 1; left_pad_self: left_pad
    where each padding query row may see itself (so no row is fully masked); random: each
    (query, key) kept with probability `amount`. `loss_mask` zeroes dO on padding query rows,
    as a loss that ignores padding does.
    """

    name: str
    pattern: str
    amount: float = 0
    seqlen: int = 128
    batch: int = 1
    heads: int = 1
    head_dim: int = 32
    dtype: str = "bfloat16"
    causal: bool = False
    block_m: int = 64
    block_n: int = 64
    seed: int = 0
    loss_mask: bool = False

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"MaskCase.pattern = {self.pattern!r} must be one of {PATTERNS}.")
        if self.pattern in PADDED_PATTERNS and self.batch < 2:
            raise ValueError(f"MaskCase(pattern={self.pattern!r}) pads batch item 1: give batch >= 2.")
        if self.loss_mask and self.pattern not in PADDED_PATTERNS:
            raise ValueError(f"MaskCase.loss_mask zeroes dO on padding rows: give a padded pattern {PADDED_PATTERNS}.")
        if self.pattern == "random" and not 0 <= self.amount <= 1:
            raise ValueError(f"MaskCase.amount = {self.amount} is the kept fraction of a random mask: give 0..1.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def mask(self) -> torch.Tensor | None:
        """The (B, 1, Q, K) boolean mask on the CPU (None for pattern 'none')."""
        if self.pattern == "none":
            return None
        n, amount = self.seqlen, int(self.amount)
        mask = torch.ones(self.batch, 1, n, n, dtype=torch.bool)
        if self.pattern == "rows":
            mask[:, :, :amount] = False
        elif self.pattern == "leading":
            mask[:, :, :amount, : self.block_n] = False
        elif self.pattern in ("left_pad", "left_pad_self"):
            mask[1, :, :, :amount] = False
            if self.pattern == "left_pad_self":
                mask[1, :, range(amount), range(amount)] = True
        elif self.pattern == "right_pad":
            mask[1, :, :, n - amount :] = False
        elif self.pattern == "random":
            generator = torch.Generator().manual_seed(self.seed + 7)
            mask = torch.rand(mask.shape, generator=generator) < self.amount
        return mask

    def inputs(self, device=None) -> dict[str, torch.Tensor | None]:
        """q, k, v, d_out (B, S, H, D) and the mask, drawn on the CPU from `seed`, then moved."""
        device = default_device() if device is None else torch.device(device)
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, self.seqlen, self.heads, self.head_dim)
        tensors = {n: torch.randn(shape, generator=generator).to(self.torch_dtype).to(device) for n in ("q", "k", "v", "d_out")}
        if self.loss_mask:
            tensors["d_out"][~self.real_query_rows().to(device)] = 0
        mask = self.mask()
        return tensors | {"mask": None if mask is None else mask.to(device)}

    def padding_rows(self) -> torch.Tensor:
        """(B, S) bool: the padding positions of a padded pattern (none otherwise)."""
        rows = torch.zeros(self.batch, self.seqlen, dtype=torch.bool)
        amount = int(self.amount)
        if self.pattern in ("left_pad", "left_pad_self"):
            rows[1, :amount] = True
        elif self.pattern == "right_pad":
            rows[1, self.seqlen - amount :] = True
        return rows

    def real_query_rows(self) -> torch.Tensor:
        """(B, S) bool: query rows a loss reads: not padding, and with at least one visible key."""
        n = self.seqlen
        mask = self.mask()
        visible = torch.ones(self.batch, 1, n, n, dtype=torch.bool) if mask is None else mask.clone()
        if self.causal:
            visible &= torch.ones(n, n, dtype=torch.bool).tril()
        return visible.any(-1)[:, 0] & ~self.padding_rows()


# The seed's configuration: 1 x 256 x 1 x 64, causal, bf16, no mask, torch.manual_seed(42).
SEED = MaskCase("seed config (no mask)", "none", seqlen=256, head_dim=64, causal=True, seed=42)


# -- the upstream code: flash-dmattn 1.2.2's Triton backend -----------------------------------------

UPSTREAM_PACKAGE = "flash-dmattn"
UPSTREAM_VERSION = "1.2.2"  # the last release of flash-dmattn (its successor is flash-sparse-attn)
UPSTREAM_MODULE = "flash_dmattn.flash_dmattn_triton"
SUCCESSOR_PACKAGE = "flash-sparse-attn"
SUCCESSOR_VERSION = "2.0.6"  # the latest on the registry when this page was revised
# On CPU the interpreter's bf16 tl.dot multiplies raw bit patterns (see triton-interpreter-bf16-dot);
# upstream's kernels call tl.dot on bf16 operands like any other, so on CPU we run them in fp16,
# which 1.2.2 also accepts ("Only support fp16 and bf16"). Natively the GPU run uses bf16.
UPSTREAM_DTYPES = {"cpu": "float16", "cuda": "bfloat16"}


def upstream_dtype(device=None) -> str:
    """The dtype the upstream kernel is studied in on `device`: fp16 under the interpreter, bf16 natively."""
    device = default_device() if device is None else torch.device(device)
    return UPSTREAM_DTYPES["cpu" if INTERPRETED else device.type]


def upstream_version() -> str | None:
    """The installed flash-dmattn's version, or None (install the `upstream` extra: scripts/setup.sh does)."""
    try:
        return importlib.metadata.version(UPSTREAM_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def upstream_module():
    """flash-dmattn's own `flash_dmattn_triton` module, unmodified.

    Natively it is imported as is. Under the Triton interpreter the same source file is compiled
    with Python's assertions stripped (`optimize=1`, what `python -O` does), because 1.2.2 asserts
    `q.is_cuda` before every launch and the interpreter runs on CPU tensors; every kernel and every
    line of its launchers is upstream's. `kernels` is imported first (by this module), which makes
    the interpreter handle runtime loop bounds under numpy >= 2.4.
    """
    version = upstream_version()
    if version is None:
        raise ModuleNotFoundError(
            f"{UPSTREAM_PACKAGE} is not installed: run scripts/setup.sh, or "
            f"FLASH_DMATTN_SKIP_CUDA_BUILD=TRUE FLASH_DMATTN_FORCE_BUILD=TRUE pip install --no-deps --no-build-isolation "
            f"{UPSTREAM_PACKAGE}=={UPSTREAM_VERSION}"
        )
    if not INTERPRETED:
        return importlib.import_module(UPSTREAM_MODULE)
    spec = importlib.util.find_spec(UPSTREAM_MODULE)
    module = types.ModuleType(f"{UPSTREAM_MODULE}_interpreted")
    module.__file__ = spec.origin
    sys.modules[module.__name__] = module  # Triton resolves a kernel's globals through its module
    source = Path(spec.origin).read_text()
    exec(compile(source, spec.origin, "exec", optimize=1), module.__dict__)
    return module


def upstream_triton_func():
    """1.2.2's `triton_dmattn_func(query, key, value, attn_mask=None, attn_bias=None, is_causal=False, softmax_scale=None)`."""
    return upstream_module().triton_dmattn_func


def upstream_call_errors(device=None) -> dict[str, str]:
    """What the report's own snippet and its nearest working spelling raise on 1.2.2 (seed config, no mask)."""
    func = upstream_triton_func()
    case = replace(SEED, dtype=upstream_dtype(device))
    found = {}

    def attempt(name, call):
        x = case.inputs(device)
        leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
        try:
            with _quiet():
                call(*leaves).backward(x["d_out"])
            found[name] = "no error"
        except Exception as exc:  # the exception is the finding
            found[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"

    # the seed's line: `scale=` is not a parameter of 1.2.2 (it is `softmax_scale`)
    attempt("seed snippet as written", lambda q, k, v: func(q, k, v, None, None, is_causal=True, scale=None))
    # the same with softmax_scale: the forward makes a zero bias, the backward returns dbias for a None input
    attempt("softmax_scale, attn_bias=None", lambda q, k, v: func(q, k, v, None, None, is_causal=True, softmax_scale=None))
    return found


@dataclass
class UpstreamRun:
    """flash-dmattn 1.2.2's Triton kernel, forward + backward, on one case, against the fp64 oracle."""

    case: MaskCase
    tensors: dict[str, torch.Tensor] = field(repr=False)
    checks: dict[str, ErrorCheck]
    poisoned: bool = False

    def nonfinite(self, name: str) -> int:
        return int((~torch.isfinite(self.tensors[name].float())).sum())

    def finite(self, name: str) -> bool:
        return self.nonfinite(name) == 0

    @property
    def all_finite(self) -> bool:
        return all(self.finite(n) for n in UPSTREAM_TENSORS)

    @property
    def all_within(self) -> bool:
        return all(self.checks[n].within for n in UPSTREAM_TENSORS)

    def error_ratio(self, name: str) -> float:
        check = self.checks[name]
        return check.error / check.bound

    def nan_rows(self, name: str) -> int:
        """Rows (batch x position) of `name` holding a non-finite entry."""
        t = self.tensors[name].float()
        return int((~torch.isfinite(t)).flatten(2).any(-1).sum())

    def summary(self) -> dict:
        return {
            "case": self.case.name,
            "dtype": self.case.dtype,
            "poisoned": self.poisoned,
            "nonfinite": {n: self.nonfinite(n) for n in UPSTREAM_TENSORS},
            "nan_rows": {n: self.nan_rows(n) for n in UPSTREAM_TENSORS},
            "numel": {n: self.tensors[n].numel() for n in UPSTREAM_TENSORS},
            "error_over_bound": {n: self.error_ratio(n) for n in UPSTREAM_TENSORS},
        }


UPSTREAM_TENSORS = ("out", "dq", "dk", "dv")  # 1.2.2's triton_dmattn_func returns no lse
# The upstream kernel's cases (dtype set per device by `upstream_cases`): the seed's configuration, the
# same at a length that is not a multiple of 64 and an unmasked ragged batch, fully masked rows, a fully masked leading block, and a left-padded causal batch (HF's 4-D padding
# mask), without and with a loss mask, then the two workarounds: pad on the right, or let each
# padding query row see itself.
_PAD = dict(amount=40, batch=2, causal=True)
UPSTREAM_CASES = (
    SEED,
    MaskCase("seed config at Q=K=200 (not a multiple of 64)", "none", seqlen=200, head_dim=64, causal=True, seed=42),
    MaskCase("no mask, Q=K=100", "none", seqlen=100),
    MaskCase("8 fully masked rows", "rows", amount=8),
    MaskCase("leading block masked, 16 rows", "leading", amount=16),
    MaskCase("left-padded batch (40), causal", "left_pad", **_PAD),
    MaskCase("left-padded, loss mask on padding", "left_pad", loss_mask=True, **_PAD),
    MaskCase("workaround: right-padded, loss mask", "right_pad", loss_mask=True, **_PAD),
    MaskCase("workaround: padding rows see themselves, loss mask", "left_pad_self", loss_mask=True, **_PAD),
)


def upstream_run(case: MaskCase, device=None, *, poisoned: bool = False) -> UpstreamRun:
    """1.2.2's `triton_dmattn_func` on `case` (in `case.dtype`): mask expanded to (B, H, Q, K) as it
    asserts, an explicit zero bias (None breaks its backward), dO as the case draws it (zero on padding
    query rows when `case.loss_mask`). `poisoned` runs it with NaN-filled fresh memory."""
    func = upstream_triton_func()
    x = case.inputs(device)
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    shape = (case.batch, case.heads, case.seqlen, case.seqlen)
    mask = None if x["mask"] is None else x["mask"].expand(shape).contiguous()
    bias = torch.zeros(shape, dtype=case.torch_dtype, device=leaves[0].device)
    context = poisoned_memory() if poisoned else contextlib.nullcontext()
    with _quiet(), context:
        out = func(*leaves, mask, bias, case.causal, None)
        out.backward(x["d_out"])
    tensors = {"out": out.detach()} | {g: t.grad for g, t in zip(GRADS, leaves)}
    ref = oracle(case, None if device is None else str(device))
    rows = case.real_query_rows().to(tensors["out"].device)  # outputs compared on rows a loss would read
    checks = {
        "out": error_check(
            "out", tensors["out"][rows], ref["oracle"]["out"][rows], ref["baseline"]["out"][rows], case.torch_dtype
        )
    }
    checks |= {g: error_check(g, tensors[g], ref["oracle"][g], ref["baseline"][g], case.torch_dtype) for g in GRADS}
    return UpstreamRun(case, tensors, checks, poisoned)


# -- running one variant on one case ----------------------------------------------------------


@contextlib.contextmanager
def _quiet():
    """The interpreter's numpy warns where exp(-inf - (-inf)) is born (and at the guard's log(0)),
    and at reductions over all-NaN rows; we count NaN ourselves."""
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="All-NaN slice encountered", category=RuntimeWarning)
        yield


@functools.lru_cache(maxsize=64)
def oracle(case: MaskCase, device: str | None = None, d_out_nan_row: int | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """{"oracle": float64 tensors, "baseline": PyTorch in the case's dtype}, each out/lse/dq/dk/dv."""
    x = case.inputs(device)
    d_out = _d_out(x["d_out"], d_out_nan_row)
    tensors = {}
    for kind, dtype in (("oracle", torch.float64), ("baseline", case.torch_dtype)):
        leaves = [x[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v")]
        out, lse = dense_reference(*leaves, x["mask"], None, case.causal, compute_dtype=dtype)
        out.backward(d_out.to(dtype))
        tensors[kind] = {"out": out.detach(), "lse": lse.detach()} | {g: t.grad for g, t in zip(GRADS, leaves)}
    return tensors


def _d_out(d_out: torch.Tensor, nan_row: int | None) -> torch.Tensor:
    """dO, with NaN on one query row when studying NaN that arrives from the loss."""
    if nan_row is None:
        return d_out
    d_out = d_out.clone()
    d_out[:, nan_row] = float("nan")
    return d_out


def _lse_check(value: torch.Tensor, oracle_lse: torch.Tensor, baseline: torch.Tensor, dtype: torch.dtype) -> ErrorCheck:
    finite = oracle_lse[torch.isfinite(oracle_lse)]
    floor = torch.finfo(dtype).eps * max(1.0, float(finite.abs().max()) if finite.numel() else 0.0)
    return ErrorCheck("lse", lse_error(value, oracle_lse), lse_error(baseline, oracle_lse), 2.0, floor)


@dataclass
class Run:
    """One variant of the replica, forward + backward, on one case, measured against the oracle."""

    case: MaskCase
    variant: str
    tensors: dict[str, torch.Tensor] = field(repr=False)
    checks: dict[str, ErrorCheck]

    def nonfinite(self, name: str) -> int:
        """NaN and infinite entries; for lse only NaN and +inf (-inf is a row with no visible key)."""
        t = self.tensors[name].float()
        return int((torch.isnan(t) | torch.isposinf(t)).sum() if name == "lse" else (~torch.isfinite(t)).sum())

    def finite(self, name: str) -> bool:
        return self.nonfinite(name) == 0

    @property
    def all_finite(self) -> bool:
        return all(self.finite(n) for n in TENSORS)

    @property
    def all_within(self) -> bool:
        return all(self.checks[n].within for n in TENSORS)

    def error_ratio(self, name: str) -> float:
        """Error in units of the bound (<= 1 passes; NaN for a non-finite tensor)."""
        check = self.checks[name]
        return check.error / check.bound

    def summary(self) -> dict:
        return {
            "case": self.case.name,
            "variant": self.variant,
            "nonfinite": {n: self.nonfinite(n) for n in TENSORS},
            "error": {n: self.checks[n].error for n in TENSORS},
            "bound": {n: self.checks[n].bound for n in TENSORS},
        }


def run(case: MaskCase, variant: str = "replica", device=None, d_out_nan_row: int | None = None) -> Run:
    """Forward + backward of one variant of the replica (replica / patch / guard) on `case`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant = {variant!r} must be one of {tuple(VARIANTS)}.")
    device = None if device is None else str(device)
    x = case.inputs(device)
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    with _quiet():
        out, lse = triton_dmattn_func(
            *leaves,
            x["mask"],
            None,
            case.causal,
            return_lse=True,
            block_m=case.block_m,
            block_n=case.block_n,
            **VARIANTS[variant],
        )
        out.backward(_d_out(x["d_out"], d_out_nan_row))
    tensors = {"out": out.detach(), "lse": lse.detach()} | {g: t.grad for g, t in zip(GRADS, leaves)}
    ref = oracle(case, device, d_out_nan_row)
    checks = {n: error_check(n, tensors[n], ref["oracle"][n], ref["baseline"][n], case.torch_dtype) for n in ("out",) + GRADS}
    checks["lse"] = _lse_check(tensors["lse"], ref["oracle"]["lse"], ref["baseline"]["lse"], case.torch_dtype)
    return Run(case, variant, tensors, checks)


# -- the mechanism in 1.2.2, predicted ---------------------------------------------------------------

UPSTREAM_BLOCK_N = 64  # 1.2.2's forward: BLOCK_M = 128, BLOCK_N = 64, every key block visited (no skipping)


def predict_upstream_nan_rows(case: MaskCase) -> torch.Tensor:
    """(B, Q) bool: the query rows whose output 1.2.2's Triton forward turns NaN, from the mask alone.

    1.2.2 visits every key block from the first, and its online softmax has no guard: in key block 0
    a row with no visible key has m_ij = max(-inf, -inf) = -inf and p = exp(-inf - (-inf)) = NaN,
    and the NaN never leaves its running statistics. So a row is NaN exactly when none of keys
    [0, 64) is visible to it (after the causal mask), whatever it sees later."""
    n = case.seqlen
    mask = case.mask()
    visible = torch.ones(case.batch, 1, n, n, dtype=torch.bool) if mask is None else mask.clone()
    if case.causal:
        visible &= torch.ones(n, n, dtype=torch.bool).tril()
    return ~visible[:, 0, :, :UPSTREAM_BLOCK_N].any(-1)


UPSTREAM_BWD_BLOCK_M = 64  # 1.2.2's backward: BLOCK_M = 64 (autotune has one config), BLOCK_N = 128


def predict_upstream_nan_grad_items(case: MaskCase) -> torch.Tensor:
    """(B,) bool: the batch items whose dK and dV 1.2.2 fills with NaN in every row, from the mask and length.

    Two ways in. A NaN output row (`predict_upstream_nan_rows`) reaches every key through
    `dV += pT dO` and `dK += dsT Q` (NaN * 0 is NaN, so a zero dO does not stop it). And when Q is not a
    multiple of the backward's 64-row block, its last block reads rows past Q: the forward loaded the
    mask there as 0 (1.2.2 always has a mask: it makes an all-ones one when given None), so those rows
    are fully masked and their stored lse is NaN; dO there is 0, and NaN * 0 poisons every key again,
    in every batch item, while the output and dQ (whose rows past Q are never stored) stay finite."""
    ragged = case.seqlen % UPSTREAM_BWD_BLOCK_M != 0
    return predict_upstream_nan_rows(case).any(-1) | ragged


def observed_upstream_nan_grad_items(result: UpstreamRun) -> torch.Tensor:
    """(B,) bool: items whose dK and dV hold a non-finite value in every key row."""
    rows = [(~torch.isfinite(result.tensors[g].float())).flatten(2).any(-1).all(-1) for g in ("dk", "dv")]
    return (rows[0] & rows[1]).cpu()


def observed_upstream_nan_rows(result: UpstreamRun) -> torch.Tensor:
    """(B, Q) bool: rows where the upstream output holds a non-finite value."""
    return (~torch.isfinite(result.tensors["out"].float())).flatten(2).any(-1).cpu()


SWEEP_DENSITIES = (0.02, 0.05, 0.1, 0.3)  # fraction of (query, key) pairs a random mask keeps
SWEEP_SEQLENS = (64, 100, 128)


def random_case(density: float, seqlen: int, dtype: str = "float16") -> MaskCase:
    """A random-mask case, its seed fixed by the point (small: every point runs the interpreter on CPU)."""
    return MaskCase(
        f"random {density:g}, Q=K={seqlen}",
        "random",
        amount=density,
        seqlen=seqlen,
        head_dim=16,
        dtype=dtype,
        seed=round(density * 1000) + seqlen,
    )


def sweep_point(density: float, seqlen: int, device=None) -> dict:
    """1.2.2 on one random mask: NaN rows observed vs predicted, and how much of dV is lost."""
    case = random_case(density, seqlen, upstream_dtype(device))
    result = upstream_run(case, device)
    predicted, observed = predict_upstream_nan_rows(case), observed_upstream_nan_rows(result)
    return {
        "nan_rows": int(observed.sum()),
        "predicted_nan_rows": int(predicted.sum()),
        "prediction_exact": bool(torch.equal(predicted, observed)),
        "dv_nonfinite_fraction": result.nonfinite("dv") / result.tensors["dv"].numel(),
        "dk_nonfinite_fraction": result.nonfinite("dk") / result.tensors["dk"].numel(),
        "grad_items_exact": bool(torch.equal(predict_upstream_nan_grad_items(case), observed_upstream_nan_grad_items(result))),
    }


def upstream_sweep(device=None, densities=SWEEP_DENSITIES, seqlens=SWEEP_SEQLENS) -> SweepResult:
    """`sweep_point` over densities x lengths (workbench.sweep: a failing point is a record, not a crash)."""
    return sweep(functools.partial(sweep_point, device=device), density=list(densities), seqlen=list(seqlens), progress=False)


# -- empty_like -> zeros_like, on the upstream code ---------------------------------------------------

# Lengths that are multiples of 64 (others NaN-fill dK/dV, see predict_upstream_nan_grad_items), causal and
# not, with and without a mask: square, as 1.2.2's causal mask is top-left aligned.
COVERAGE_CASES = (
    MaskCase("Q=K=128", "none", seqlen=128),
    MaskCase("Q=K=192, causal", "none", seqlen=192, causal=True),
    MaskCase("Q=K=64, all-True mask", "all", seqlen=64),
)


@dataclass(frozen=True)
class Coverage:
    case: str
    identical: bool  # every gradient from NaN-filled fresh memory == from the ordinary allocator, bit for bit
    finite: bool  # the unpoisoned run's gradients are finite (else bit-equality of NaN is not informative)


def upstream_coverage(device=None) -> list[Coverage]:
    """1.2.2's backward with NaN-filled fresh memory vs without: an unwritten dk/dv row would hold NaN."""
    found = []
    for case in COVERAGE_CASES:
        case = replace(case, dtype=upstream_dtype(device))
        plain, poisoned = upstream_run(case, device), upstream_run(case, device, poisoned=True)
        same = all(
            torch.equal(torch.nan_to_num(plain.tensors[g], nan=7.0), torch.nan_to_num(poisoned.tensors[g], nan=7.0))
            and torch.equal(torch.isnan(plain.tensors[g]), torch.isnan(poisoned.tensors[g]))
            for g in GRADS
        )
        found.append(Coverage(case.name, same, plain.finite("dk") and plain.finite("dv")))
    return found


# -- the replica: what upstream cannot show (the Copilot patch applied) -------------------------------

# The replica runs the mechanism with and without the PR's masking; bf16 as the seed (on CPU its dots
# are upcast, see kernels.interpreter). Its block skipping (`any_active`) is not in 1.2.2, which visits
# every block; on these cases both turn the same rows NaN.
REPLICA_CASES = (
    SEED,
    MaskCase("all-True mask, Q=K=100", "all", seqlen=100),  # 1.2.2 always has a mask: it makes all-ones for None
    MaskCase("8 fully masked rows", "rows", amount=8),
    MaskCase("leading block masked, 16 rows", "leading", amount=16),
    MaskCase("left-padded batch (40), causal", "left_pad", amount=40, batch=2, causal=True),
)
PADDED = REPLICA_CASES[4]
NAN_DO_ROW = 200  # a query row of the seed config where dO arrives as NaN (a NaN loss term)


def patch_as_written_error(device=None) -> str:
    """The one line that matters of launching the PR's masking (natively a CompilationError
    wrapping the AttributeError the interpreter raises directly)."""
    try:
        launch_patch_as_written(default_device() if device is None else torch.device(device))
    except Exception as exc:  # whatever the mode raises is the finding
        message = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {next((m for m in message if 'isfinite' in m), message[-1] if message else '')}"
    return "no error"


# -- the padding lesson: the same batch, packed, through our kernel -----------------------------------

# PADDED packed for varlen_attention: item 1's 40 padding tokens become an empty sequence whose padded
# segment holds them (GAP rows), so no query sees them. The registry's CASES: the one packed (THD)
# layout this post-mortem studies; the dense cases are MaskCases.
_N, _NPAD = PADDED.seqlen, int(PADDED.amount)
PACKED = Case(
    seqlens_q=(_N, 0, _N - _NPAD),
    padded_q=(_N, _NPAD, _N - _NPAD),
    padded_k=(_N, _NPAD, _N - _NPAD),
    heads=PADDED.heads,
    head_dim=PADDED.head_dim,
    dtype=PADDED.dtype,
    causal=PADDED.causal,
    fill=Fill.ZEROS,
)
CASES = (PACKED,)


def packed_equivalent(case: MaskCase = PADDED, device=None):
    """`case`'s left-padded dense batch as the packed batch `PACKED` (same q/k/v values), and dO packed likewise."""
    if replace(case, dtype=PADDED.dtype) != PADDED:
        raise ValueError("packed_equivalent takes PADDED, the left_pad MaskCase that PACKED lays out.")
    x = case.inputs(device)
    batch = pack(replace(PACKED, dtype=case.dtype), x["q"].device)
    flat = {name: x[name].reshape(-1, case.heads, case.head_dim).detach().clone().requires_grad_() for name in ("q", "k", "v")}
    return replace(batch, **flat), x["d_out"].reshape(-1, case.heads, case.head_dim)


def ours_on_packed(device=None):
    """The left-padded batch packed, through our varlen_attention (probe: exact-zero padding, real rows vs the oracle)."""
    batch, d_out = packed_equivalent(PADDED, device)
    return probe(varlen_attention, batch, name="varlen_attention", grad_out=d_out)


# -- the damage over training: a tiny model, buggy beside fixed ---------------------------------------

TRAIN_SEQLEN, TRAIN_HEADS, TRAIN_HEAD_DIM, TRAIN_VOCAB = 64, 1, 16, 32
TRAIN_STEPS = 4
TRAIN_PADS = (0, 8, 24, 40)  # left padding of batch item 1 (the explorer's slider); 24 shows the bug
TRAIN_VARIANTS = (
    "flash-dmattn 1.2.2",
    "1.2.2 + proposed patch (replica)",
    "1.2.2, sanitized (nan_to_num on out, dq, dk, dv)",
    "workaround on 1.2.2: padding rows see themselves",
)
SHOWN_VARIANTS = (TRAIN_VARIANTS[0], TRAIN_VARIANTS[2], TRAIN_VARIANTS[3])  # the patch's run looks like 1.2.2's: NaN


class TinyAttentionLM(torch.nn.Module):
    """Embedding, one causal attention layer with a residual, and a vocabulary head: enough for
    the gradient of every parameter to pass through the attention's dQ, dK and dV."""

    def __init__(self, attend, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        dim = TRAIN_HEADS * TRAIN_HEAD_DIM
        self.attend = attend
        self.embed = torch.nn.Embedding(TRAIN_VOCAB, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.head = torch.nn.Linear(dim, TRAIN_VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, seqlen = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(batch, seqlen, 3, TRAIN_HEADS, TRAIN_HEAD_DIM).unbind(2)
        y = self.attend(q, k, v).reshape(batch, seqlen, -1).to(x.dtype)
        return self.head(x + self.proj(y))


def _train_mask(pad: int, see_self: bool) -> MaskCase:
    return MaskCase("train", "left_pad_self" if see_self else "left_pad", amount=pad, seqlen=TRAIN_SEQLEN, batch=2, causal=True)


def _attention(variant: str, pad: int, device):
    """The attention a variant trains with, in the upstream dtype of `device`, on the left-padded batch's mask."""
    dtype = getattr(torch, upstream_dtype(device))
    case = _train_mask(pad, see_self=variant == TRAIN_VARIANTS[3])
    mask = case.mask().to(device)
    if variant == TRAIN_VARIANTS[1]:
        return lambda q, k, v: triton_dmattn_func(q.to(dtype), k.to(dtype), v.to(dtype), mask, None, True, patch=True)
    func = upstream_triton_func()
    full = mask.expand(2, TRAIN_HEADS, TRAIN_SEQLEN, TRAIN_SEQLEN).contiguous()
    bias = torch.zeros(full.shape, dtype=dtype, device=device)
    if variant == TRAIN_VARIANTS[2]:
        return lambda q, k, v: _Sanitized.apply(func, q.to(dtype), k.to(dtype), v.to(dtype), full, bias)
    return lambda q, k, v: func(q.to(dtype), k.to(dtype), v.to(dtype), full, bias, True, None)


class _Sanitized(torch.autograd.Function):
    """1.2.2's kernel with its output and gradients passed through `nan_to_num` (zeros for NaN): what
    the `_sanitize_tensors` helper in 1.2.2's CUDA interface does where it is called (every call is
    commented out in 1.2.2), and what any "zero the non-finite values" fix amounts to."""

    @staticmethod
    def forward(ctx, func, q, k, v, mask, bias):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = func(*leaves, mask, bias, True, None)
        ctx.graph = (leaves, out)
        return torch.nan_to_num(out.detach(), nan=0.0)

    @staticmethod
    def backward(ctx, d_out):
        leaves, out = ctx.graph
        grads = torch.autograd.grad(out, leaves, d_out)
        return (None, *(torch.nan_to_num(g, nan=0.0) for g in grads), None, None)


@functools.lru_cache(maxsize=16)
def train_health(pad: int, device: str | None = None) -> dict[str, GradientHealth]:
    """TRAIN_STEPS of SGD on a copy-the-previous-token task, batch 2 with item 1 left-padded by `pad`
    tokens (loss on real tokens only), per variant from the same initial weights and batches:
    variant -> the GradientHealth monitor of its run."""
    if not 0 <= pad < TRAIN_SEQLEN:
        raise ValueError(f"train_health(pad={pad}): give 0 <= pad < {TRAIN_SEQLEN}.")
    device = default_device() if device is None else torch.device(device)
    generator = torch.Generator().manual_seed(121)
    batches = [torch.randint(1, TRAIN_VOCAB, (2, TRAIN_SEQLEN), generator=generator) for _ in range(TRAIN_STEPS)]
    real = torch.ones(2, TRAIN_SEQLEN, dtype=torch.bool)
    real[1, :pad] = False
    runs = {}
    for variant in TRAIN_VARIANTS:
        model = TinyAttentionLM(_attention(variant, pad, device)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        monitor = GradientHealth(model)
        for tokens in batches:
            tokens = tokens.clone()
            tokens[~real] = 0  # the padding token
            tokens = tokens.to(device)
            with _quiet():
                logits = model(tokens)
                targets_ok = real[:, 1:].to(device)  # predict token t-1 at position t, on real positions
                loss = torch.nn.functional.cross_entropy(logits[:, 1:][targets_ok], tokens[:, :-1][targets_ok])
                optimizer.zero_grad()
                loss.backward()
            optimizer.step()
            monitor.step(loss)
        monitor.close()
        runs[variant] = monitor
    return runs


def plot_training(pad: int, device=None):
    """Per-parameter gradient norms over training, the three variants side by side (an explorer frame)."""
    runs = train_health(pad, None if device is None else str(device))
    return plot_health(
        {v: runs[v] for v in SHOWN_VARIANTS}, title=f"batch item 1 left-padded by {pad} of {TRAIN_SEQLEN} tokens (causal)"
    )


def training_summary(runs: dict[str, GradientHealth]) -> dict[str, dict]:
    """Per variant: first step with a non-finite gradient (None if never) and the last step's norms."""
    found = {}
    for variant, monitor in runs.items():
        first = next((r.step for r in monitor.history if r.nonfinite_grads), None)
        found[variant] = {
            "first_nonfinite_step": first,
            "nonfinite_at_step0": len(monitor.history[0].nonfinite_grads),
            "params": len(monitor.names),
            "final_norms": {name: monitor.norms(name)[-1] for name in monitor.names.values()},
        }
    return found


def training_deviation(runs: dict[str, GradientHealth]) -> float:
    """Largest relative difference, over parameters and steps, between the sanitized run's gradient norms
    and the workaround's (the correct gradients): how far the sanitized, finite gradients are off."""
    patched, fixed = runs[TRAIN_VARIANTS[2]], runs[TRAIN_VARIANTS[3]]
    worst = 0.0
    for name in fixed.names.values():
        for a, b in zip(patched.norms(name), fixed.norms(name)):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst


# -- tables -------------------------------------------------------------------------------------------


def worst_ratio(ratios) -> float:
    """The largest error ratio, NaN if any is NaN (a non-finite tensor has no error to compare)."""
    ratios = list(ratios)
    return math.nan if any(x != x for x in ratios) else max(ratios)


def ratio_text(x: float) -> str:
    return "NaN" if x != x else f"{x:.2f}"


def upstream_table(results: Results):
    """1.2.2's Triton kernel per case: non-finite entries of each tensor, and its worst error in units of the bound."""
    rows = []
    for r in results.upstream.values():
        worst = worst_ratio(r.error_ratio(n) for n in UPSTREAM_TENSORS)
        rows.append([r.case.name, *(f"{r.nonfinite(n)}/{r.tensors[n].numel()}" for n in UPSTREAM_TENSORS), ratio_text(worst)])
    return table(
        ["case", *(f"bad {n}" for n in UPSTREAM_TENSORS), "err/bound"],
        rows,
        title=f"flash-dmattn {results.upstream_version}, {results.upstream_dtype}",
    )


def patch_table(results: Results):
    """The patch (replica) on each failing case: what it made finite, what it left, and how wrong the finite ones are."""
    rows = []
    for case in results.failing():
        buggy, patched = results.get(case, "replica"), results.get(case, "patch")
        fixed = [n for n in TENSORS if not buggy.finite(n) and patched.finite(n)]
        left = [n for n in TENSORS if not patched.finite(n)]
        rows.append(
            [
                case.name,
                ", ".join(fixed) or "-",
                ", ".join(left) or "-",
                *(f"{patched.error_ratio(g):.0f}x" for g in ("dk", "dv")),
            ]
        )
    return table(["failing case", "made finite", "still non-finite", "dK err/bound", "dV err/bound"], rows)


def nan_do_table(results: Results):
    """NaN in one row of dO: non-finite gradient entries from autograd (oracle), the replica and the patch."""
    rows = [["fp64 oracle (autograd)", *(results.nan_do_oracle_nonfinite[g] for g in GRADS)]]
    rows += [[v, *(r.nonfinite(g) for g in GRADS)] for v, r in results.nan_do.items()]
    return table(["", *(f"bad {g}" for g in GRADS)], rows)


def coverage_table(results: Results):
    return table(
        ["case (1.2.2)", "NaN-filled memory changes no bit", "gradients finite"],
        [[c.case, c.identical, c.finite] for c in results.coverage],
    )


def gpu_table(record: dict):
    """The GPU record's upstream cases: 1.2.2 natively in bf16."""
    rows = []
    for name, r in record["probes"]["cases"].items():
        if not r["ok"]:
            rows.append([name, r["error"], "", "", "", ""])
            continue
        worst = worst_ratio(r["error_over_bound"].values())
        rows.append([name, *(f"{r['nonfinite'][n]}/{r['numel'][n]}" for n in UPSTREAM_TENSORS), ratio_text(worst)])
    return table(["case", *(f"bad {n}" for n in UPSTREAM_TENSORS), "err/bound"], rows)


def _successor_cell(results: Results, case_name: str) -> str:
    """What the GPU record says flash-sparse-attn's dense kernel did on one case (it needs CUDA)."""
    if results.gpu is None:
        return "no GPU record"
    successor = results.gpu["probes"]["successor"]
    run = successor.get(case_name) if successor.get("ok") else None
    if run is None:
        return "not run: " + successor.get("error", "no such probe")
    if not run["ok"]:
        return "raised " + run["error"]
    bad = [n for n, c in run["nonfinite"].items() if c]
    return f"NaN in {', '.join(bad)}" if bad else "finite (GPU, bf16)"


def report_claims_table(results: Results):
    """The report's claims, each checked on 1.2.2 (this run, and the GPU record) and on flash-sparse-attn 2.0.6."""
    seed, ragged = results.up(SEED), results.upstream[UPSTREAM_CASES[1].name]

    def state(run: UpstreamRun) -> str:
        bad = [n for n in UPSTREAM_TENSORS if not run.finite(n)]
        return f"NaN in {', '.join(bad)}" if bad else "finite, within bound" if run.all_within else "finite, outside the bound"

    gpu_seeds = "no GPU record"
    if results.gpu is not None:
        runs = results.gpu["probes"]["seed_config_seeds"]
        gpu_seeds = "; ".join(f"{k}: NaN in {s['nonfinite_runs']}/{s['runs']} seeds" for k, s in runs.items())
    coverage = all(c.identical and c.finite for c in results.coverage)
    rows = [
        [
            "the snippet runs",
            results.call_errors["seed snippet as written"],
            "no triton_dmattn_func; import: " + results.successor_import,
        ],
        [
            "NaN in dV on 1x256x1x64, causal, bf16",
            f"no: {results.upstream_dtype} here {state(seed)}; H200 bf16 {gpu_seeds}",
            _successor_cell(results, SEED.name),
        ],
        [
            "only dV is NaN (dQ, dK, out, lse fine)",
            f"at 200 tokens: {state(ragged)}; dK with dV always",
            "at 200 tokens: " + _successor_cell(results, UPSTREAM_CASES[1].name),
        ],
        [
            "cause: empty_like dk/dv",
            "no: NaN-filled memory changes no bit" if coverage else "not shown",
            "not checked (other code)",
        ],
        ["fix: tl.where(tl.isfinite(x), x, 0)", "cannot compile; made to, hides the NaN (replica)", "not applicable (API gone)"],
    ]
    return table(["the report says", f"flash-dmattn {results.upstream_version}", f"flash-sparse-attn {SUCCESSOR_VERSION}"], rows)


# -- plots --------------------------------------------------------------------------------------------


def _draw_mask(ax, case: MaskCase, nan_rows: torch.Tensor, item: int = 0) -> None:
    """The mask of batch item `item` (dark = visible), 1.2.2's first key block, NaN rows in red."""
    n = case.seqlen
    mask = case.mask()
    visible = torch.ones(n, n, dtype=torch.bool) if mask is None else mask[item, 0].clone()
    if case.causal:
        visible &= torch.ones(n, n, dtype=torch.bool).tril()
    ax.imshow(
        visible.float().numpy(),
        cmap=matplotlib.colors.ListedColormap(["#ffffff", "#8c959f"]),
        vmin=0,
        vmax=1,
        interpolation="nearest",
        extent=(-0.5, n - 0.5, n - 0.5, -0.5),
    )
    rows = torch.nonzero(nan_rows).flatten().tolist()
    for r in rows:
        ax.axhspan(r - 0.5, r + 0.5, color="#d1495b", alpha=0.55, lw=0)
    if n > UPSTREAM_BLOCK_N:
        ax.axvline(UPSTREAM_BLOCK_N - 0.5, color="#2f6db5", lw=1.2, ls="--")
    ax.grid(False)
    ax.set_xlabel(f"key (dashed: end of key block 0, {UPSTREAM_BLOCK_N} keys)")
    ax.set_ylabel("query")
    ax.set_title(f"mask (grey = visible)\nred: {len(rows)} NaN output rows", fontsize=9)


def plot_mechanism(results: Results, case: MaskCase, item: int = 0):
    """Left: `case`'s mask with 1.2.2's NaN output rows. Right: per-key |dV| of the oracle and of 1.2.2, the patch (replica) and the workaround."""
    name = case.name
    up = results.upstream[name]
    fig, axes = figure(1, 2, width=10.5, height=4.0)
    left, right = axes[0]
    _draw_mask(left, up.case, observed_upstream_nan_rows(up)[item], item)
    ref = oracle(up.case, results.device)["oracle"]
    keys = torch.arange(case.seqlen)
    right.plot(keys, ref["dv"][item].double().norm(dim=(-2, -1)).cpu(), color="#1f2328", lw=2.2, label="fp64 oracle")
    dv = up.tensors["dv"][item].double().norm(dim=(-2, -1)).cpu()
    right.plot(
        keys,
        torch.nan_to_num(dv, nan=0.0),
        color="#d1495b",
        lw=0,
        marker="x",
        ms=3,
        label=f"1.2.2: {up.nan_rows('dv')} NaN rows (drawn at 0)",
    )
    replica = {c.name: c for c in REPLICA_CASES}
    if name in replica:
        patched = results.get(replica[name], "patch").tensors["dv"][item].double().norm(dim=(-2, -1)).cpu()
        right.plot(keys, patched, color="#e09f3e", lw=1.4, label="proposed patch (replica): finite, wrong")
    right.set_xlabel("key")
    right.set_ylabel("|dV| per key")
    right.set_title(f"dV per key, batch item {item}", fontsize=9)
    right.legend(loc="upper right", fontsize=8)
    fig.suptitle(name, x=0.01, ha="left", fontsize=10)
    return fig


def plot_sweep(results: Results):
    """NaN output rows of 1.2.2 on random masks: observed vs predicted by the first-key-block rule."""
    fig, axes = figure(1, 1, width=6.4, height=3.0)
    ax = axes[0, 0]
    records = [p for p in results.sweep.records if p["ok"]]
    positions = {d: i for i, d in enumerate(SWEEP_DENSITIES)}
    for k, (seqlen, marker) in enumerate(zip(SWEEP_SEQLENS, ("o", "s", "D"))):
        points = [p for p in records if p["seqlen"] == seqlen]
        x = [positions[p["density"]] + (k - 1) * 0.15 for p in points]
        ax.plot(x, [p["nan_rows"] for p in points], marker, ms=8, mfc="none", label=f"observed, Q=K={seqlen}")
        ax.plot(x, [p["predicted_nan_rows"] for p in points], "x", ms=6, color="#1f2328")
    ax.plot([], [], "x", color="#1f2328", label="predicted")
    ax.set_xticks(range(len(SWEEP_DENSITIES)), [f"{d:g}" for d in SWEEP_DENSITIES])
    ax.set_xlabel("mask density (fraction of (query, key) pairs kept)")
    ax.set_ylabel("NaN output rows")
    ax.set_title("flash-dmattn 1.2.2 on random masks", fontsize=10)
    ax.legend(fontsize=8)
    return fig


# -- the whole study ----------------------------------------------------------------------------------


@dataclass
class Results(PostmortemResults):
    device: str | None
    upstream_version: str | None
    upstream_dtype: str
    call_errors: dict[str, str]  # the seed's snippet and its nearest spelling, on 1.2.2
    upstream: dict[str, UpstreamRun]  # case name -> 1.2.2's kernel on it
    seed_poisoned: UpstreamRun  # the seed configuration with NaN-filled fresh memory
    sweep: SweepResult  # 1.2.2 on random masks: NaN rows observed vs predicted
    coverage: list[Coverage]  # 1.2.2 under NaN-filled memory: every dk/dv row written?
    replica: dict[tuple[str, str], Run]  # (case name, variant) -> the replica
    nan_do: dict[str, Run]  # the seed config with NaN in one row of dO, replica and patch
    nan_do_oracle_nonfinite: dict[str, int]
    isfinite_error: str
    isfinite_in_triton: bool
    ours: object  # ProbeRecord of our kernel on the packed layout
    training: dict  # the tiny model at TRAIN_PAD: per variant first non-finite step, final norms; 'deviation'
    successor_import: str  # what `import flash_sparse_attn` (2.0.6) raises here, or 'ok'
    gpu: dict | None  # the latest GPU record (data/gpu/flash-dmattn-121-*.json), None before one is committed

    def up(self, case: MaskCase) -> UpstreamRun:
        return self.upstream[case.name]

    def get(self, case: MaskCase, variant: str) -> Run:
        return self.replica[(case.name, variant)]

    def failing(self) -> list[MaskCase]:
        """Replica cases where the unpatched replica returns a non-finite tensor."""
        return [c for c in REPLICA_CASES if not self.get(c, "replica").all_finite]

    def summary(self) -> dict:
        return {
            "device": self.device,
            "upstream_version": self.upstream_version,
            "upstream_dtype": self.upstream_dtype,
            "call_errors": self.call_errors,
            "upstream": [r.summary() for r in self.upstream.values()],
            "seed_poisoned": self.seed_poisoned.summary(),
            "sweep": self.sweep.records,
            "coverage": [vars(c) for c in self.coverage],
            "replica": [r.summary() for r in self.replica.values()],
            "isfinite_error": self.isfinite_error,
            "training": self.training,
            "successor_import": self.successor_import,
        }


def reproduce(device=None) -> Results:
    """1.2.2's Triton kernel on every upstream case, the sweep and the coverage check; the replica with
    and without the patch; our kernel on the packed layout."""
    dtype = upstream_dtype(device)
    replica = {(c.name, v): run(c, v, device) for c in REPLICA_CASES for v in VARIANTS}
    nan_do = {v: run(SEED, v, device, d_out_nan_row=NAN_DO_ROW) for v in ("replica", "patch")}
    nan_oracle = oracle(SEED, None if device is None else str(device), NAN_DO_ROW)["oracle"]
    return Results(
        device=None if device is None else str(device),
        upstream_version=upstream_version(),
        upstream_dtype=dtype,
        call_errors=upstream_call_errors(device),
        upstream={c.name: upstream_run(c, device) for c in upstream_cases(dtype)},
        seed_poisoned=upstream_run(replace(SEED, dtype=dtype), device, poisoned=True),
        sweep=upstream_sweep(device),
        coverage=upstream_coverage(device),
        replica=replica,
        nan_do=nan_do,
        nan_do_oracle_nonfinite={g: int((~torch.isfinite(nan_oracle[g])).sum()) for g in GRADS},
        isfinite_error=patch_as_written_error(device),
        isfinite_in_triton=isfinite_exists(),
        ours=ours_on_packed(device),
        training=_training(device),
        successor_import=successor_import_error(),
        gpu=gpu_record(),
    )


def gpu_record() -> dict | None:
    """The latest GPU record of this post-mortem (its file name sorts last), or None."""
    records = gpu_records(META)
    return records[-1] if records else None


def successor_import_error() -> str:
    """`import flash_sparse_attn` in a fresh interpreter: 'ok', or the exception's first line."""
    code = "import flash_sparse_attn"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return "ok"
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


TRAIN_PAD = 24  # the padding the explorer opens on and the training claim is checked at


def _training(device) -> dict:
    runs = train_health(TRAIN_PAD, None if device is None else str(device))
    return {"pad": TRAIN_PAD, "variants": training_summary(runs), "deviation": training_deviation(runs)}


# -- GPU probes: what only the upstream code run natively shows ------------------------------------

GPU_SEEDS = tuple(range(8))  # the seed configuration over 8 draws (device time is scarce)
TIMING_SEQLENS = (1024, 896, 768, 640)  # a right-padded batch of 4 (the workaround layout), 8 heads of 64, causal
TIMING_HEADS, TIMING_HEAD_DIM = 8, 64


def upstream_cases(dtype: str) -> tuple[MaskCase, ...]:
    """The cases the upstream kernel is run on, in `dtype` (fp16 on CPU, bf16 on the GPU)."""
    return tuple(replace(c, dtype=dtype) for c in UPSTREAM_CASES)


def _outcome(run) -> dict:
    try:
        return {"ok": True, **run()}
    except Exception as exc:  # a probe that fails is recorded, not fatal: the rest still runs
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}


def _time_ms(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def speed_vs_upstream(device) -> dict:
    """Forward + backward time of 1.2.2's Triton kernel on a right-padded dense batch (boolean mask,
    the workaround layout) and of our varlen_attention on the same tokens packed, bf16, causal."""
    func = upstream_triton_func()
    batch, n = len(TIMING_SEQLENS), max(TIMING_SEQLENS)
    generator = torch.Generator().manual_seed(121)
    shape = (batch, n, TIMING_HEADS, TIMING_HEAD_DIM)
    dense = [torch.randn(shape, generator=generator).to(torch.bfloat16).to(device).requires_grad_() for _ in range(3)]
    d_out = torch.randn(shape, generator=generator).to(torch.bfloat16).to(device)
    mask = torch.zeros(batch, TIMING_HEADS, n, n, dtype=torch.bool, device=device)
    for i, length in enumerate(TIMING_SEQLENS):
        mask[i, :, :, :length] = True
    bias = torch.zeros(mask.shape, dtype=torch.bfloat16, device=device)

    def upstream_step():
        for t in dense:
            t.grad = None
        func(*dense, mask, bias, True, None).backward(d_out)

    rows = torch.cat([torch.arange(length) + i * n for i, length in enumerate(TIMING_SEQLENS)]).to(device)
    packed = [t.detach().reshape(-1, TIMING_HEADS, TIMING_HEAD_DIM)[rows].clone().requires_grad_() for t in dense]
    packed_d_out = d_out.reshape(-1, TIMING_HEADS, TIMING_HEAD_DIM)[rows]
    cu = torch.tensor([0, *itertools.accumulate(TIMING_SEQLENS)], dtype=torch.int32, device=device)

    def ours_step():
        for t in packed:
            t.grad = None
        varlen_attention(*packed, cu, cu, n, n, causal=True).backward(packed_d_out)

    upstream_ms, ours_ms = _time_ms(upstream_step), _time_ms(ours_step)
    return {
        "seqlens": list(TIMING_SEQLENS),
        "heads": TIMING_HEADS,
        "head_dim": TIMING_HEAD_DIM,
        "upstream_ms": upstream_ms,
        "ours_ms": ours_ms,
        "ours_over_upstream": ours_ms / upstream_ms,
    }


def _stub_triton_kernels() -> list[str]:
    """flash-sparse-attn 2.0.6 imports `triton_kernels` (Triton's own kernel library, not on the
    registry and not a declared dependency) for its projection kernels only. Stubs stand in for the
    names imported, so that the dense attention path can be imported; they raise if ever called."""
    stubbed = []
    for name in ("triton_kernels", "triton_kernels.matmul_ogs", "triton_kernels.numerics"):
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        module = types.ModuleType(name)

        def missing(*args, _name=name, **kwargs):
            raise ModuleNotFoundError(f"{_name} is stubbed: flash-sparse-attn's projection kernels need the real package")

        for attr in ("matmul_ogs", "PrecisionConfig", "FlexCtx", "InFlexData", "OutFlexData"):
            setattr(module, attr, missing)
        sys.modules[name] = module
        stubbed.append(name)
    return stubbed


def successor_probe(device) -> dict:
    """flash-sparse-attn (the successor): does it import, and its dense kernel on the seed configuration."""
    found: dict = {}
    try:
        found["version"] = importlib.metadata.version(SUCCESSOR_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False}
    found["installed"] = True
    found["plain_import"] = _outcome(lambda: {"module": importlib.import_module("flash_sparse_attn").__name__})
    if not found["plain_import"]["ok"]:
        found["stubbed"] = _stub_triton_kernels()

    def dense(case: MaskCase):
        fsa = importlib.import_module("flash_sparse_attn")
        x = case.inputs(device)
        leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]  # (B, S, H, D), as 1.2.2
        # is_autotune=False: its default 64 x 64 tiles, no autotuning sweep (minutes of compilation)
        out = fsa.flash_dense_attn_func(*leaves, is_causal=case.causal, is_autotune=False)
        out.backward(x["d_out"])
        ref = oracle(case, str(device))
        tensors = dict(zip(UPSTREAM_TENSORS, (out.detach(), *(t.grad for t in leaves))))
        return {
            "error_over_bound": {
                n: error_check(n, t, ref["oracle"][n], ref["baseline"][n], torch.bfloat16).ratio / FACTORS[n]
                for n, t in tensors.items()
            },
            "nonfinite": {n: int((~torch.isfinite(t.float())).sum()) for n, t in tensors.items()},
        }

    for case in (SEED, UPSTREAM_CASES[1]):  # the seed's configuration, and the same at 200 tokens
        found[case.name] = _outcome(lambda c=case: dense(replace(c, dtype="bfloat16")))
    return found


def _seed_runs(device) -> dict:
    seeds = {}
    for poisoned in (False, True):
        runs = [
            _outcome(lambda s=s, p=poisoned: upstream_run(replace(SEED, dtype="bfloat16", seed=s), device, poisoned=p).summary())
            for s in GPU_SEEDS
        ]
        seeds["poisoned" if poisoned else "plain"] = {
            "runs": len(runs),
            "errors": sorted({r["error"] for r in runs if not r["ok"]}),
            "nonfinite_runs": sum(r["ok"] and any(r["nonfinite"].values()) for r in runs),
            "dv_nonfinite_runs": sum(r["ok"] and r["nonfinite"]["dv"] > 0 for r in runs),
            "worst_error_over_bound": max((max(r["error_over_bound"].values()) for r in runs if r["ok"]), default=None),
        }
    return seeds


def gpu_probes(device, *, budget_s: float | None = None, on_step=None) -> dict:
    """What `workbench repro flash-dmattn-121 --device cuda --record ...` adds to the GPU record:
    flash-dmattn 1.2.2's own Triton kernel run natively in bf16 (the seed's dtype): the report's
    snippet, every upstream case, the seed configuration over GPU_SEEDS with and without NaN-filled
    fresh memory, the successor package, and 1.2.2's speed beside our kernel, in that order.

    With `budget_s`, a probe that would start after that many seconds is recorded as skipped;
    `on_step(found)` is called after each probe (to write the record as it grows)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"gpu_probes(device={device}): run it on CUDA (workbench repro ... --device cuda).")
    start = time.monotonic()
    found: dict = {"upstream_version": upstream_version(), "dtype": "bfloat16"}
    steps = (
        ("call_errors", lambda: _outcome(lambda: upstream_call_errors(device))),
        ("cases", lambda: {c.name: _outcome(lambda c=c: upstream_run(c, device).summary()) for c in upstream_cases("bfloat16")}),
        ("seed_config_seeds", lambda: _seed_runs(device)),
        ("successor", lambda: _outcome(lambda: successor_probe(device))),
        ("speed", lambda: _outcome(lambda: speed_vs_upstream(device))),
    )
    for name, probe_fn in steps:
        elapsed = time.monotonic() - start
        if budget_s is not None and elapsed > budget_s:
            found[name] = {"ok": False, "error": f"skipped: the {budget_s:g} s time budget was spent ({elapsed:.0f} s)"}
        else:
            print(f"gpu_probes: {name} at {elapsed:.0f} s", flush=True)
            found[name] = probe_fn()
        found["seconds"] = round(time.monotonic() - start, 1)
        if on_step is not None:
            on_step(found)
    print(f"gpu_probes: done in {found['seconds']} s", flush=True)
    return found


GPU_RECORD = "data/gpu/flash-dmattn-121-h200.json"


def record_gpu_probes(path: str = GPU_RECORD, device: str = "cuda", budget_s: float = 120.0) -> dict:
    """Writes the GPU record from `gpu_probes` alone (no reproduce(): its claims ran natively in the
    earlier device call), rewriting it after every probe so that a killed run still leaves one."""
    from workbench.records import write_record

    def write(found: dict) -> None:
        payload = {
            "id": META.id,
            "title": META.title,
            "verdict": "probes only",
            "note": "gpu_probes() alone, under a time budget; reproduce() and its claims ran natively in an earlier call",
            "claims": [],
            "results": {},
            "probes": found,
        }
        write_record(
            path,
            payload,
            command=f"python -c 'from postmortems import flash_dmattn_121 as pm; pm.record_gpu_probes()' (budget {budget_s:g} s)",
        )

    return gpu_probes(device, budget_s=budget_s, on_step=write)


# -- claims ------------------------------------------------------------------------------------------

claims = Claims()
_AFFECTED = ("8 fully masked rows", "leading block masked, 16 rows", "left-padded batch (40), causal")
_WORKAROUNDS = ("workaround: right-padded, loss mask", "workaround: padding rows see themselves, loss mask")
_RAGGED = ("seed config at Q=K=200 (not a multiple of 64)", "no mask, Q=K=100")


def _counts(result, names) -> str:
    return ", ".join(f"{n} {result.nonfinite(n)}" for n in names)


def _item_rows_nan(result: UpstreamRun, name: str, item: int) -> bool:
    """Every row of batch item `item` of gradient `name` holds NaN."""
    return bool((~torch.isfinite(result.tensors[name][item].float())).flatten(1).any(-1).all())


@claims(
    "the report's snippet does not run on 1.2.2: `scale=` is no parameter, and without a bias the backward raises",
    evidence=UPSTREAM_CPU,
)
def _snippet(r: Results):
    errors = r.call_errors
    holds = errors["seed snippet as written"].startswith("TypeError") and errors["softmax_scale, attn_bias=None"].startswith(
        "RuntimeError"
    )
    return holds, " | ".join(errors.values())


@claims(
    "seed configuration (1x256x1x64, causal, no mask) on 1.2.2: finite and within the oracle's bound, also under NaN-filled memory",
    evidence=UPSTREAM_CPU,
)
def _seed(r: Results):
    plain, poisoned = r.up(SEED), r.seed_poisoned
    holds = all(x.all_finite and x.all_within for x in (plain, poisoned))
    worst = max(x.error_ratio(n) for x in (plain, poisoned) for n in UPSTREAM_TENSORS)
    return (
        holds,
        f"{r.upstream_dtype}; non-finite: {_counts(plain, UPSTREAM_TENSORS)}; poisoned: {_counts(poisoned, UPSTREAM_TENSORS)}; worst {worst:.2f} x bound",
    )


@claims(
    "fully masked rows on 1.2.2: NaN output on those rows only, but NaN in every dK and dV row of the batch item",
    evidence=UPSTREAM_CPU,
)
def _affected(r: Results):
    parts, good = [], 0
    for name in _AFFECTED:
        run_ = r.upstream[name]
        rows_ok = torch.equal(observed_upstream_nan_rows(run_), predict_upstream_nan_rows(run_.case))
        item = 1 if run_.case.pattern in PADDED_PATTERNS else 0
        grads_ok = _item_rows_nan(run_, "dk", item) and _item_rows_nan(run_, "dv", item)
        good += rows_ok and grads_ok
        parts.append(f"{name}: out NaN rows {run_.nan_rows('out')}, dK/dV NaN rows {run_.nan_rows('dk')}/{run_.nan_rows('dv')}")
    return good == len(_AFFECTED), "; ".join(parts)


@claims(
    "at a length that is not a multiple of 64, even with no mask, 1.2.2 NaN-fills every dK and dV row while out and dQ stay finite",
    evidence=UPSTREAM_CPU,
)
def _ragged(r: Results):
    parts, good = [], 0
    for name in _RAGGED:
        x = r.upstream[name]
        ok = (
            x.finite("out") and x.finite("dq") and all(_item_rows_nan(x, g, i) for g in ("dk", "dv") for i in range(x.case.batch))
        )
        good += ok
        parts.append(f"{name}: non-finite {_counts(x, UPSTREAM_TENSORS)}")
    return good == len(_RAGGED), "; ".join(parts)


@claims("dV is never NaN without dK on 1.2.2 (the report has dK clean): every case and random mask", evidence=UPSTREAM_CPU)
def _dv_with_dk(r: Results):
    runs = list(r.upstream.values())
    alone = sum(x.nonfinite("dv") > 0 and x.finite("dk") for x in runs)
    alone += sum(p["dv_nonfinite_fraction"] > 0 and p["dk_nonfinite_fraction"] == 0 for p in r.sweep.records)
    with_dv = sum(x.nonfinite("dv") > 0 for x in runs) + sum(p["dv_nonfinite_fraction"] > 0 for p in r.sweep.records)
    return alone == 0 and with_dv > 0, f"{with_dv} runs with NaN dV (cases + sweep), {alone} of them with a finite dK"


@claims(
    "a loss mask does not help: left-padded batch with dO = 0 on padding rows, 1.2.2 still NaN in every dK/dV row of the item",
    evidence=UPSTREAM_CPU,
)
def _loss_mask(r: Results):
    masked = r.upstream["left-padded, loss mask on padding"]
    holds = _item_rows_nan(masked, "dk", 1) and _item_rows_nan(masked, "dv", 1)
    return holds, f"non-finite: {_counts(masked, UPSTREAM_TENSORS)}"


@claims(
    "workarounds on 1.2.2 (pad on the right; let each padding row see itself): finite and within the oracle's bound",
    evidence=UPSTREAM_CPU,
)
def _workarounds(r: Results):
    runs = [r.upstream[n] for n in _WORKAROUNDS]
    good = sum(x.all_finite and x.all_within for x in runs)
    worst = max(x.error_ratio(n) for x in runs for n in UPSTREAM_TENSORS)
    return good == len(runs), f"{good}/{len(runs)}; worst error {worst:.2f} x bound"


@claims(
    "the two rules predict 1.2.2 exactly: NaN output rows (no visible key among keys 0-63) and NaN-filled dK/dV items (such a row, or a length not a multiple of 64)",
    evidence=UPSTREAM_CPU,
)
def _prediction(r: Results):
    cases = sum(
        torch.equal(predict_upstream_nan_rows(x.case), observed_upstream_nan_rows(x))
        and torch.equal(predict_upstream_nan_grad_items(x.case), observed_upstream_nan_grad_items(x))
        for x in r.upstream.values()
    )
    points = sum(bool(p.get("prediction_exact")) and bool(p.get("grad_items_exact")) for p in r.sweep.records)
    total = len(r.upstream) + len(r.sweep.records)
    return cases + points == total, f"{cases + points}/{total} (cases + random-mask sweep)"


@claims(
    "1.2.2's backward writes every dK/dV row: NaN-filled fresh memory changes no bit of finite gradients, so empty_like -> zeros_like changes nothing",
    evidence=UPSTREAM_CPU,
)
def _coverage(r: Results):
    good = sum(c.identical and c.finite for c in r.coverage)
    return good == len(
        r.coverage
    ), f"{good}/{len(r.coverage)} configurations bit-identical ({', '.join(c.case for c in r.coverage)})"


@claims("tl.isfinite does not exist in Triton: the patch as written cannot compile", evidence=REPLICA)
def _isfinite_missing(r: Results):
    return not r.isfinite_in_triton and "isfinite" in r.isfinite_error, r.isfinite_error


@claims("patch-equivalent on the failing cases: dV and dK become finite", evidence=REPLICA)
def _patch_finite(r: Results):
    failing = r.failing()
    finite = sum(r.get(c, "patch").finite("dv") and r.get(c, "patch").finite("dk") for c in failing)
    return finite == len(failing) > 0, f"{finite}/{len(failing)} failing cases"


@claims("patch-equivalent leaves out, lse and dq exactly as non-finite as before", evidence=REPLICA)
def _patch_untouched(r: Results):
    failing = r.failing()
    same = sum(
        all(r.get(c, "patch").nonfinite(n) == r.get(c, "replica").nonfinite(n) for n in ("out", "lse", "dq")) for c in failing
    )
    still = sum(r.get(c, "patch").nonfinite("dq") > 0 for c in failing)
    return same == len(failing), f"{same}/{len(failing)} failing cases unchanged; dq still non-finite in {still}"


def patch_error_ratios(r: Results) -> dict[str, float]:
    """Failing case -> the smaller of the patch's dK and dV error, in units of the oracle's bound."""
    return {c.name: min(r.get(c, "patch").error_ratio(g) for g in ("dk", "dv")) for c in r.failing()}


@claims("patch-equivalent's now-finite dV/dK are silently wrong: error more than 10x the bound", evidence=REPLICA)
def _patch_wrong(r: Results):
    ratios = patch_error_ratios(r)
    return min(ratios.values()) > 10, "dV/dK error / bound: " + ", ".join(f"{x:.0f}x" for x in ratios.values())


@claims(
    "on the report's symptom (replica, all-True mask, Q=K=100: dK/dV NaN, out finite) the patch leaves no sign: every tensor finite, dK/dV more than 10x off",
    evidence=REPLICA,
)
def _patch_silent(r: Results):
    case = REPLICA_CASES[1]
    buggy, patched = r.get(case, "replica"), r.get(case, "patch")
    holds = buggy.finite("out") and not buggy.finite("dv") and patched.all_finite
    worst = min(patched.error_ratio(g) for g in ("dk", "dv"))
    return (
        holds and worst > 10,
        f"replica non-finite: {_counts(buggy, TENSORS)}; patch: all finite, dK/dV error {worst:.0f}x the bound or more",
    )


@claims("patch-equivalent swallows NaN arriving through dO: dV finite where autograd gives NaN", evidence=REPLICA)
def _patch_swallows(r: Results):
    oracle_nan = r.nan_do_oracle_nonfinite["dv"]
    buggy, patched = r.nan_do["replica"], r.nan_do["patch"]
    holds = oracle_nan > 0 and buggy.nonfinite("dv") > 0 and patched.finite("dv")
    return (
        holds,
        f"non-finite dV: oracle {oracle_nan}, replica {buggy.nonfinite('dv')}, patch 0 of {patched.tensors['dv'].numel()}",
    )


@claims(
    "a guard for rows with no visible key (output 0, gradient 0): every replica case finite and within the oracle's bound",
    evidence=REPLICA,
)
def _guard(r: Results):
    fixed = [r.get(c, "guard") for c in REPLICA_CASES]
    good = sum(f.all_finite and f.all_within for f in fixed)
    worst = max(f.error_ratio(n) for f in fixed for n in TENSORS)
    return good == len(fixed), f"{good}/{len(fixed)} cases; worst error {worst:.2f} x bound"


@claims("our varlen_attention on the same left-padded batch packed: padding exactly zero, real rows within bound", evidence=OURS)
def _ours(r: Results):
    fixed = r.ours
    holds = fixed.padding_exactly_zero and fixed.real_within_bound and fixed.real_finite
    return (
        holds,
        f"padding zero {fixed.padding_exactly_zero}, real rows finite {fixed.real_finite}, within bound {fixed.real_within_bound}",
    )


@claims(
    "tiny model, left padding 24 of 64: 1.2.2 and the patch NaN in every parameter's gradient at step 0; sanitizing gives finite, wrong gradients; the workaround finite",
    evidence=TOY,
)
def _training_claim(r: Results):
    t = r.training["variants"]
    buggy, patched, sanitized, fixed = (t[v] for v in TRAIN_VARIANTS)
    holds = all(x["nonfinite_at_step0"] == x["params"] for x in (buggy, patched))
    holds = holds and sanitized["first_nonfinite_step"] is None and fixed["first_nonfinite_step"] is None
    holds = holds and r.training["deviation"] > 0.05
    return holds, (
        f"parameters with a non-finite gradient at step 0: 1.2.2 {buggy['nonfinite_at_step0']}/{buggy['params']}, "
        f"patch {patched['nonfinite_at_step0']}/{patched['params']}; sanitized and workaround never; "
        f"sanitized gradient norms up to {r.training['deviation']:.0%} off the workaround's"
    )


@claims(
    "flash-sparse-attn 2.0.6 (the successor) cannot be imported: it needs `triton_kernels`, which it does not declare",
    evidence=UPSTREAM_CPU,
)
def _successor_import(r: Results):
    return "triton_kernels" in r.successor_import, r.successor_import


def _gpu_probes(r: Results) -> dict:
    if r.gpu is None:
        raise LookupError(
            "no GPU record: run workbench repro flash-dmattn-121 --device cuda --record data/gpu/flash-dmattn-121-h200.json"
        )
    return r.gpu["probes"]


@claims(
    "on the GPU in bf16, the seed configuration over 8 seeds, with and without NaN-filled memory: no NaN, within the oracle's bound",
    evidence=UPSTREAM_GPU,
)
def _gpu_seed(r: Results):
    seeds = _gpu_probes(r)["seed_config_seeds"]
    holds = all(
        s["runs"] == len(GPU_SEEDS) and not s["errors"] and s["nonfinite_runs"] == 0 and s["worst_error_over_bound"] <= 1
        for s in seeds.values()
    )
    return holds, "; ".join(
        f"{k}: {s['nonfinite_runs']}/{s['runs']} runs with NaN, worst {s['worst_error_over_bound']:.2f} x bound"
        for k, s in seeds.items()
    )


@claims(
    "on the GPU in bf16: fully masked rows and lengths not a multiple of 64 give the CPU's NaN pattern, the workarounds are finite and within bound",
    evidence=UPSTREAM_GPU,
)
def _gpu_cases(r: Results):
    cases = _gpu_probes(r)["cases"]
    parts, good = [], 0
    for name in _AFFECTED:
        c = cases[name]
        item_rows = r.upstream[name].case.seqlen
        ok = (
            c["ok"]
            and c["nan_rows"]["dk"] == c["nan_rows"]["dv"] == item_rows
            and c["nan_rows"]["out"] == r.upstream[name].nan_rows("out")
        )
        good += ok
        parts.append(
            f"{name}: out NaN rows {c['nan_rows']['out'] if c['ok'] else c['error']}, dV NaN rows {c['nan_rows']['dv'] if c['ok'] else '-'}"
        )
    for name in _RAGGED:
        c = cases[name]
        ok = (
            c["ok"]
            and c["nonfinite"]["out"] == c["nonfinite"]["dq"] == 0
            and c["nan_rows"]["dv"] == c["nan_rows"]["dk"] == r.upstream[name].nan_rows("dv")
        )
        good += ok
        parts.append(
            f"{name}: dK/dV NaN rows {c['nan_rows']['dk'] if c['ok'] else c['error']}, out finite {c['ok'] and c['nonfinite']['out'] == 0}"
        )
    for name in _WORKAROUNDS:
        c = cases[name]
        ok = c["ok"] and not any(c["nonfinite"].values()) and max(c["error_over_bound"].values()) <= 1
        good += ok
        parts.append(f"{name}: finite and within {ok}")
    return good == len(_AFFECTED) + len(_RAGGED) + len(_WORKAROUNDS), "; ".join(parts)


@claims(
    "flash-sparse-attn 2.0.6's dense kernel (triton_kernels stubbed), on the GPU in bf16: finite and within bound on the seed config and at 200 tokens",
    evidence=UPSTREAM_GPU,
)
def _gpu_successor(r: Results):
    successor = _gpu_probes(r)["successor"]
    runs = [successor.get(c.name, {"ok": False, "error": "not run"}) for c in (SEED, UPSTREAM_CASES[1])]
    good = sum(x["ok"] and not any(x["nonfinite"].values()) and max(x["error_over_bound"].values()) <= 1 for x in runs)
    return good == 2, "; ".join(
        f"{c.name}: " + (f"worst {max(x['error_over_bound'].values()):.2f} x bound" if x["ok"] else x["error"])
        for c, x in zip((SEED, UPSTREAM_CASES[1]), runs)
    )
