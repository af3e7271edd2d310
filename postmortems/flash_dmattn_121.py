"""Post-mortem flash-dmattn-121: NaN in dV, a patch that cannot compile, and the real culprit.

The seed is a Copilot PR presented as the fix for flash-dmattn#121: `zeros_like` dk/dv buffers and
`tl.where(tl.isfinite(x), x, 0.0)` sprinkled over the Triton backward. The issue was filed against
the CUDA backend; the PR edits the Triton one, where every dk/dv row is written anyway, calls a
function Triton does not have, and — made to compile — hides NaN instead of removing its cause.

The cause in the Triton path is the forward's online softmax: a query row whose first visited key
block is fully masked for it gets `m_ij = -inf` and `exp(-inf - (-inf)) = NaN`. We study it through
a replica of that path (`kernels.replicas.dmattn`) against a float64 dense oracle (`dense_reference`
below: flash-dmattn's semantics, a row with no visible key has output 0 and gradient 0).

`reproduce()` returns a `Results`; `claims` checks it; the notebook shows it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import matplotlib
import matplotlib.colors
import numpy as np
import torch
from matplotlib.figure import Figure

from kernels import default_device, varlen_attention
from kernels.replicas.dmattn import dmattn_backward, isfinite_exists, launch_patch_as_written, triton_dmattn_func
from workbench import Case, Fill, pack, poisoned_memory, probe
from workbench.bounds import ErrorCheck, error_check, lse_error
from workbench.plots import FACE, STYLE, plot_nan_map  # importing plots also lets a cell ending with a Figure show it
from workbench.postmortem import Claims, Link, Meta
from workbench.sweep import SweepResult, sweep

META = Meta(
    id="flash-dmattn-121",
    title="flash-dmattn: NaN in dV, a patch that cannot compile, and the real culprit",
    component="flash-dmattn (flash-sparse-attention) / Triton backend, dynamic mask",
    upstream_status="partially fixed",
    status_note="Triton path later guarded for all -inf rows; CUDA path sanitised with nan_to_num_; the Copilot PR never merged",
    detection="NaN in dV (and dK, dQ, lse, output) after backward with a dynamic mask",
    fix_type="proposed: zeros_like + isfinite masking (cannot compile, hides NaN); ours: guard rows with no visible key",
    tags=("dynamic mask", "fully masked rows", "online softmax", "NaN", "backward", "unsound fix"),
    reported="2025-08-24",
    published="2026-11-29",
    links=(
        Link("flash-sparse-attention#121", "https://github.com/HKUSTDial/flash-sparse-attention/issues/121"),
        Link(
            "flash_attn_triton.py (Tri Dao)",
            "https://github.com/Dao-AILab/flash-attention/blob/main/flash_attn/flash_attn_triton.py",
        ),
        Link("triton#11584 (interpreter bf16 dot)", "https://github.com/triton-lang/triton/issues/11584"),
    ),
    seed="001_90a18acb6ed00fca.txt",
)

VARIANTS = {"replica": {}, "patch": {"patch": True}, "guard": {"guard": True}}
TENSORS = ("out", "lse", "dq", "dk", "dv")
GRADS = ("dq", "dk", "dv")
PATTERNS = ("none", "all", "rows", "leading", "left_pad", "random")


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
    (HF's 4-D mask); random: each (query, key) kept with probability `amount`.
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

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"MaskCase.pattern = {self.pattern!r} must be one of {PATTERNS}.")
        if self.pattern == "left_pad" and self.batch < 2:
            raise ValueError("MaskCase(pattern='left_pad') pads batch item 1: give batch >= 2.")
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
        elif self.pattern == "left_pad":
            mask[1, :, :, :amount] = False
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
        mask = self.mask()
        return tensors | {"mask": None if mask is None else mask.to(device)}


# The seed's configuration: 1 x 256 x 1 x 64, causal, bf16, no mask, torch.manual_seed(42).
SEED = MaskCase("seed config (no mask)", "none", seqlen=256, head_dim=64, causal=True, seed=42)
MASK_CASES = (
    SEED,
    MaskCase("8 fully masked rows", "rows", amount=8),
    MaskCase("leading block masked, 16 rows", "leading", amount=16),
    MaskCase("leading block masked, whole tile", "leading", amount=64),
    MaskCase("all-True mask, Q=K=100", "all", seqlen=100),
    MaskCase("left-padded batch (40), causal", "left_pad", amount=40, batch=2, causal=True),
)
# A case "fails" when the replica returns a non-finite tensor; these are the ones the patch is judged on.
LEADING = MASK_CASES[2]
RAGGED = MASK_CASES[4]
PADDED = MASK_CASES[5]
# PADDED packed for varlen_attention: item 1's 40 padding tokens become an empty sequence whose
# padded segment holds them (GAP rows), so no query sees them. The registry's CASES: the one
# packed (THD) layout this post-mortem studies; the dense cases are MASK_CASES.
_N, _PAD = PADDED.seqlen, int(PADDED.amount)
PACKED = Case(
    seqlens_q=(_N, 0, _N - _PAD),
    padded_q=(_N, _PAD, _N - _PAD),
    padded_k=(_N, _PAD, _N - _PAD),
    heads=PADDED.heads,
    head_dim=PADDED.head_dim,
    dtype=PADDED.dtype,
    causal=PADDED.causal,
    fill=Fill.ZEROS,
)
CASES = (PACKED,)


# -- running one variant on one case ----------------------------------------------------------


def _quiet():
    """The interpreter's numpy warns where exp(-inf - (-inf)) is born (and at the guard's log(0));
    we count NaN ourselves."""
    return np.errstate(invalid="ignore", divide="ignore")


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


# -- the mechanism, predicted --------------------------------------------------------------------


def predict_nan_rows(case: MaskCase) -> dict[str, torch.Tensor]:
    """Which query rows the unguarded forward turns NaN, from the mask alone: the diagnosis as code.

    The kernel walks key blocks per tile of `block_m` query rows and skips a block whose mask is
    all False over the tile (rows past Q load as False). In the first block a row does visit,
    all -inf scores give m_ij = -inf and NaN lse ('lse'); a row that visits no block keeps
    lse = -inf but its output scale exp(-inf - (-inf)) is NaN ('out' holds both kinds).
    Returns bool tensors (B, H_kv, Q).
    """
    mask = case.mask()
    n, bm, bn = case.seqlen, case.block_m, case.block_n
    tiles = -(-n // bm)
    rows = tiles * bm  # the last tile's rows past Q exist in the kernel, fully masked
    visible = torch.zeros(case.batch, 1, rows, n, dtype=torch.bool)
    visible[:, :, :n] = True if mask is None else mask
    if case.causal:
        visible &= torch.ones(rows, n, dtype=torch.bool).tril()
    tile_mask = torch.zeros_like(visible)
    tile_mask[:, :, :n] = True if mask is None else mask  # what any_active reads: the mask only
    lse_nan = torch.zeros(case.batch, 1, rows, dtype=torch.bool)
    visited_any = torch.zeros_like(lse_nan)
    for t in range(tiles):
        r = slice(t * bm, (t + 1) * bm)
        end = n if not case.causal else min((t + 1) * bm, n)
        first = torch.zeros(case.batch, 1, bm, dtype=torch.bool)  # rows whose first visited block is behind them
        for start in range(0, end, bn):
            c = slice(start, start + bn)
            if mask is not None:
                active = tile_mask[:, :, r, c].flatten(2).any(-1)  # (B, 1): skip per batch x head
            else:
                active = torch.ones(case.batch, 1, dtype=torch.bool)
            active = active[..., None]
            sees = visible[:, :, r, c].any(-1)
            lse_nan[:, :, r] |= active & ~first & ~sees
            first |= active
        visited_any[:, :, r] = first
    lse_nan, visited_any = lse_nan[..., :n], visited_any[..., :n]
    return {"lse": lse_nan, "out": lse_nan | ~visited_any}


def observed_nan_rows(result: Run) -> dict[str, torch.Tensor]:
    """The rows (B, H, Q) where the replica's lse / output hold NaN."""
    return {
        "lse": torch.isnan(result.tensors["lse"]).cpu(),
        "out": torch.isnan(result.tensors["out"]).any(-1).transpose(1, 2).cpu(),
    }


# -- the patch as written --------------------------------------------------------------------------


def patch_as_written_error(device=None) -> str:
    """`ExceptionType: message` of launching the PR's masking (natively a CompilationError
    wrapping the AttributeError the interpreter raises directly)."""
    try:
        launch_patch_as_written(default_device() if device is None else torch.device(device))
    except Exception as exc:  # whatever the mode raises is the finding
        message = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {next((m for m in message if 'isfinite' in m), message[-1] if message else '')}"
    return "no error"


# -- empty_like -> zeros_like ---------------------------------------------------------------------

# (Q, K, causal, block_m, block_n): even and ragged lengths, causal with K > Q (the early exit).
COVERAGE_CONFIGS = ((128, 128, False, 64, 64), (100, 100, True, 64, 64), (64, 160, True, 32, 64), (96, 80, False, 32, 16))


@dataclass(frozen=True)
class Coverage:
    config: tuple
    all_rows_written: bool
    identical: bool  # dk, dv from a NaN-poisoned empty buffer == from a zeroed one, bit for bit


def write_coverage(device=None) -> list[Coverage]:
    """For each config: does the dk/dv store cover every key row, and does zeros_like change anything?"""
    device = default_device() if device is None else torch.device(device)
    found = []
    for seqlen_q, seqlen_k, causal, bm, bn in COVERAGE_CONFIGS:
        generator = torch.Generator().manual_seed(seqlen_q * 1000 + seqlen_k)
        q, do = (torch.randn(1, seqlen_q, 1, 32, generator=generator).to(torch.bfloat16).to(device) for _ in range(2))
        k, v = (torch.randn(1, seqlen_k, 1, 32, generator=generator).to(torch.bfloat16).to(device) for _ in range(2))
        options = dict(is_causal=causal, block_m=bm, block_n=bn)
        with poisoned_memory():  # torch.empty hands out NaN: an unwritten row would show
            empty = dmattn_backward(q, k, v, do, zero_init=False, **options)
        zeros = dmattn_backward(q, k, v, do, zero_init=True, record_writes=False, **options)
        same = all(torch.equal(getattr(empty, g), getattr(zeros, g)) for g in ("dk", "dv"))
        found.append(Coverage((seqlen_q, seqlen_k, causal, bm, bn), bool(empty.rows_written.all()), same))
    return found


# -- the padding lesson: the same batch, packed --------------------------------------------------


def packed_equivalent(case: MaskCase = PADDED, device=None):
    """`case`'s left-padded dense batch as the packed batch `PACKED` (same q/k/v values), and dO packed likewise."""
    if case != PADDED:
        raise ValueError("packed_equivalent takes PADDED, the left_pad MaskCase that PACKED lays out.")
    x = case.inputs(device)
    batch = pack(PACKED, x["q"].device)
    flat = {name: x[name].reshape(-1, case.heads, case.head_dim).detach().clone().requires_grad_() for name in ("q", "k", "v")}
    return replace(batch, **flat), x["d_out"].reshape(-1, case.heads, case.head_dim)


def padded_lesson(device=None) -> dict:
    """The left-padded batch through the replica (dense + mask) and the fixed kernel (packed)."""
    batch, d_out = packed_equivalent(PADDED, device)
    fixed = probe(varlen_attention, batch, name="varlen_attention", grad_out=d_out)
    dense = run(PADDED, "replica", device)
    pad = int(PADDED.amount)
    real_keys = torch.ones(PADDED.batch, PADDED.seqlen, dtype=torch.bool)
    real_keys[1, :pad] = False
    dv_real = dense.tensors["dv"].cpu()[real_keys]
    return {
        "fixed": fixed,
        "replica": dense,
        "replica_dv_real_nan": int(torch.isnan(dv_real).any(-1).sum()),
        "real_keys": int(real_keys.sum()),
    }


# -- verification sweep ------------------------------------------------------------------------

SWEEP_DENSITIES = (0.02, 0.1, 0.3)  # fraction of (query, key) pairs the random mask keeps
SWEEP_BLOCKS = (16, 32, 64)  # block_m = block_n


def random_case(density: float, block: int, seqlen: int = 64, head_dim: int = 16) -> MaskCase:
    """A random-mask case (small: every point runs the interpreter), its seed fixed by the point."""
    return MaskCase(
        f"random {density:g}, block {block}, Q=K={seqlen}",
        "random",
        amount=density,
        seqlen=seqlen,
        head_dim=head_dim,
        block_m=block,
        block_n=block,
        seed=round(density * 1000) + block + seqlen,
    )


def sweep_point(density: float, block: int, seqlen: int = 64, device=None) -> dict:
    """Replica vs guard vs the oracle on one random mask; the prediction checked against the replica."""
    case = random_case(density, block, seqlen)
    buggy, fixed = run(case, "replica", device), run(case, "guard", device)
    predicted, observed = predict_nan_rows(case)["lse"], observed_nan_rows(buggy)["lse"]
    return {
        "replica_nan_rows": int(observed.sum()),
        "predicted_nan_rows": int(predicted.sum()),
        "prediction_exact": bool(torch.equal(predicted, observed)),
        "replica_nonfinite_dv": buggy.nonfinite("dv"),
        "guard_finite": fixed.all_finite,
        "guard_within": fixed.all_within,
        "guard_worst_ratio": max(fixed.error_ratio(n) for n in TENSORS),
    }


def verification_sweep(device=None, densities=SWEEP_DENSITIES, blocks=SWEEP_BLOCKS) -> SweepResult:
    """`sweep_point` over densities x block sizes (workbench.sweep: a failing point is a record, not a crash)."""
    return sweep(functools.partial(sweep_point, device=device), density=list(densities), block=list(blocks), progress=False)


# -- tables ------------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [header, *rows])


def case_table(results: Results) -> str:
    """Per case and variant: non-finite entries of each tensor, and the worst error in units of the bound."""
    rows = []
    for case in MASK_CASES:
        for variant in VARIANTS:
            r = results.get(case, variant)
            worst = max(r.error_ratio(n) for n in TENSORS)
            rows.append(
                [case.name, variant, *(str(r.nonfinite(n)) for n in TENSORS), "NaN" if worst != worst else f"{worst:.2f}"]
            )
    return _table(["case", "variant", *(f"bad {n}" for n in TENSORS), "err/bound"], rows)


def diagnosis_table(results: Results) -> str:
    """Per case: NaN rows predicted by the first-visited-block rule vs observed in the replica."""
    rows = []
    for case in MASK_CASES:
        predicted, observed = predict_nan_rows(case), observed_nan_rows(results.get(case, "replica"))
        rows.append(
            [
                case.name,
                str(int(predicted["lse"].sum())),
                str(int(observed["lse"].sum())),
                str(int(predicted["out"].sum())),
                str(int(observed["out"].sum())),
                str(results.predictions[case.name]),
            ]
        )
    return _table(["case", "lse NaN predicted", "observed", "out NaN predicted", "observed", "exact"], rows)


def patch_table(results: Results) -> str:
    """The patch on each failing case: what it made finite, what it left, and how wrong the finite ones are."""
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
    return _table(["failing case", "made finite", "still non-finite", "dK err/bound", "dV err/bound"], rows)


def coverage_table(results: Results) -> str:
    rows = [
        [str(c.config[:2]), str(c.config[2]), str(c.config[3:]), str(c.all_rows_written), str(c.identical)]
        for c in results.coverage
    ]
    return _table(["(Q, K)", "causal", "(block_m, block_n)", "every dk/dv row written", "empty == zeros"], rows)


def nan_do_table(results: Results) -> str:
    """NaN in one row of dO: non-finite gradient entries from autograd (oracle), the replica and the patch."""
    rows = [["fp64 oracle (autograd)", *(str(results.nan_do_oracle_nonfinite[g]) for g in GRADS)]]
    rows += [[v, *(str(r.nonfinite(g)) for g in GRADS)] for v, r in results.nan_do.items()]
    return _table(["", *(f"bad {g}" for g in GRADS)], rows)


def padded_summary(results: Results) -> str:
    fixed = results.padded["fixed"]
    return (
        f"replica (dense + mask): {results.padded['replica_dv_real_nan']} of {results.padded['real_keys']} real keys have NaN dV\n"
        f"varlen_attention (packed): non-finite {sum(sum(v.values()) for v in fixed.nonfinite.values())}, "
        f"padding exactly 0: {fixed.padding_exactly_zero}, real rows within bound: {fixed.real_within_bound}\n"
        + "\n".join(f"  {check}" for check in fixed.errors.values())
    )


# -- plots -------------------------------------------------------------------------------------------


def _figure(ncols: int, width: float, height: float):
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(width, height), facecolor=FACE, layout="constrained")
        return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _draw_mask(ax, case: MaskCase, nan_rows: torch.Tensor, item: int = 0) -> None:
    """The mask of batch item `item` (dark = visible), tile / key-block grid, NaN rows in red."""
    n = case.seqlen
    mask = case.mask()
    visible = torch.ones(n, n, dtype=torch.bool) if mask is None else mask[item, 0].clone()
    if case.causal:
        visible &= torch.ones(n, n, dtype=torch.bool).tril()
    image = visible.float().numpy()
    ax.imshow(
        image,
        cmap=matplotlib.colors.ListedColormap(["#ffffff", "#8c959f"]),
        vmin=0,
        vmax=1,
        interpolation="nearest",
        extent=(-0.5, n - 0.5, n - 0.5, -0.5),
    )
    tile_end = -(-n // case.block_m) * case.block_m
    if mask is not None and tile_end > n:  # the kernel's last tile reaches past Q: those rows load the mask as False
        ax.axhspan(n - 0.5, tile_end - 0.5, facecolor="#f6d5da", hatch="///", edgecolor="#d1495b", lw=0)
        ax.text(n / 2, (n + tile_end) / 2, "rows past Q: mask loads False, lse NaN", ha="center", va="center", fontsize=8)
        ax.set_ylim(tile_end - 0.5, -0.5)
    rows = torch.nonzero(nan_rows).flatten().tolist()
    for r in rows:
        ax.axhspan(r - 0.5, r + 0.5, color="#d1495b", alpha=0.55, lw=0)
    for y in range(case.block_m, n, case.block_m):
        ax.axhline(y - 0.5, color="#2f6db5", lw=1)
    for x in range(case.block_n, n, case.block_n):
        ax.axvline(x - 0.5, color="#2f6db5", lw=1, ls="--")
    ax.grid(False)
    ax.set_xlabel(f"key (dashed: key blocks of {case.block_n})")
    ax.set_ylabel(f"query (solid: tiles of {case.block_m})")
    ax.set_title(f"mask (grey = visible); red: {len(rows)} NaN rows", fontsize=9)


def plot_mechanism(results: Results, case: MaskCase, item: int = 0):
    """Left: `case`'s mask with the replica's NaN rows. Right: per-key |dV| of the oracle, the guard and the patch."""
    fig, (left, right) = _figure(2, 10.5, 3.8)
    buggy = results.get(case, "replica")
    _draw_mask(left, case, observed_nan_rows(buggy)["lse"][item, 0], item)
    ref = oracle(case, results.device)["oracle"]
    keys = torch.arange(case.seqlen)
    right.plot(keys, ref["dv"][item].double().norm(dim=(-2, -1)).cpu(), color="#1f2328", lw=2.2, label="fp64 oracle")
    for variant, color, style in (("guard", "#2f6db5", "--"), ("patch", "#d1495b", "-")):
        dv = results.get(case, variant).tensors["dv"][item].double().norm(dim=(-2, -1)).cpu()
        right.plot(keys, dv, color=color, ls=style, lw=1.4, label=f"{variant} (finite: {bool(torch.isfinite(dv).all())})")
    right.set_xlabel("key")
    right.set_ylabel("|dV| per key")
    right.set_title(f"replica: {buggy.nonfinite('dv')} of {buggy.tensors['dv'].numel()} dV entries NaN", fontsize=9)
    right.legend(loc="upper right")
    fig.suptitle(case.name, x=0.01, ha="left", fontsize=10)
    return fig


def plot_sweep(result: SweepResult):
    """NaN rows in the replica over mask density x block size (the guard is finite everywhere)."""
    return plot_nan_map(
        result, rows="density", cols="block", value="replica_nan_rows", title="replica: query rows with NaN lse (Q = 64)"
    )


def plot_nan_rows(density: float, block: int, seqlen: int, device=None):
    """One explorer frame: a random mask, the replica's forward NaN rows, and the prediction."""
    case = random_case(density, block, seqlen)
    x = case.inputs(device)
    with _quiet(), torch.no_grad():
        _, lse = triton_dmattn_func(x["q"], x["k"], x["v"], x["mask"], None, return_lse=True, block_m=block, block_n=block)
    observed = torch.isnan(lse[0, 0]).cpu()
    predicted = predict_nan_rows(case)["lse"][0, 0]
    fig, (ax,) = _figure(1, 5.2, 5.0)
    _draw_mask(ax, case, observed)
    # P(a given row's first block is fully masked) = (1 - density) ** block_n, when the tile visits it
    ax.set_title(
        f"density {density:g}, block {block}, Q=K={seqlen}: {int(observed.sum())} NaN rows\n"
        f"predicted {int(predicted.sum())}; (1-d)^block x Q = {(1 - density) ** block * seqlen:.1f}",
        fontsize=9,
    )
    return fig


# -- the whole study -----------------------------------------------------------------------------

NAN_DO_ROW = 200  # a query row of the seed config where dO arrives as NaN (a NaN loss term)


@dataclass
class Results:
    runs: dict[tuple[str, str], Run]  # (case name, variant) -> Run
    nan_do: dict[str, Run]  # the seed config with NaN in one row of dO, per variant
    nan_do_oracle_nonfinite: dict[str, int]
    isfinite_error: str
    isfinite_in_triton: bool
    coverage: list[Coverage]
    predictions: dict[str, bool]  # case name -> predicted NaN rows == observed (lse and out)
    sweep: SweepResult
    padded: dict
    device: str | None = None

    def get(self, case: MaskCase, variant: str) -> Run:
        return self.runs[(case.name, variant)]

    def failing(self) -> list[MaskCase]:
        """Cases where the unpatched replica returns a non-finite tensor."""
        return [c for c in MASK_CASES if not self.get(c, "replica").all_finite]

    def summary(self) -> dict:
        return {
            "runs": [r.summary() for r in self.runs.values()],
            "isfinite_error": self.isfinite_error,
            "coverage": [vars(c) for c in self.coverage],
            "sweep": self.sweep.records,
        }


def reproduce(device=None) -> Results:
    """Every case x variant, NaN through dO, the patch as written, write coverage, the sweep, padding."""
    runs = {(c.name, v): run(c, v, device) for c in MASK_CASES for v in VARIANTS}
    nan_do = {v: run(SEED, v, device, d_out_nan_row=NAN_DO_ROW) for v in ("replica", "patch")}
    nan_oracle = oracle(SEED, None if device is None else str(device), NAN_DO_ROW)["oracle"]
    predictions = {}
    for case in MASK_CASES:
        predicted, observed = predict_nan_rows(case), observed_nan_rows(runs[(case.name, "replica")])
        predictions[case.name] = all(torch.equal(predicted[k], observed[k]) for k in ("lse", "out"))
    return Results(
        runs=runs,
        nan_do=nan_do,
        nan_do_oracle_nonfinite={g: int((~torch.isfinite(nan_oracle[g])).sum()) for g in GRADS},
        isfinite_error=patch_as_written_error(device),
        isfinite_in_triton=isfinite_exists(),
        coverage=write_coverage(device),
        predictions=predictions,
        sweep=verification_sweep(device),
        padded=padded_lesson(device),
        device=None if device is None else str(device),
    )


# -- claims ----------------------------------------------------------------------------------------

claims = Claims()


def _counts(result: Run, names=TENSORS) -> str:
    return ", ".join(f"{n} {result.nonfinite(n)}" for n in names)


@claims("replica, fully masked leading block (16 rows of a tile): NaN in lse and dV")
def _leading_block_nan(r: Results):
    buggy = r.get(LEADING, "replica")
    return buggy.nonfinite("lse") > 0 and buggy.nonfinite("dv") > 0, f"non-finite: {_counts(buggy)}"


@claims("guard (the maintainers' fix) on every case: all finite and within the oracle's bound")
def _guard_everywhere(r: Results):
    fixed = [r.get(c, "guard") for c in MASK_CASES]
    good = sum(f.all_finite and f.all_within for f in fixed)
    worst = max(f.error_ratio(n) for f in fixed for n in TENSORS)
    return good == len(fixed), f"{good}/{len(fixed)} cases; worst error {worst:.2f} x bound"


@claims("seed configuration (1x256x1x64, causal, bf16, no mask): replica finite and within bound")
def _seed_finite(r: Results):
    seed = r.get(SEED, "replica")
    return (
        seed.all_finite and seed.all_within,
        f"non-finite: {_counts(seed)}; worst {max(seed.error_ratio(n) for n in TENSORS):.2f} x bound",
    )


@claims("NaN rows are exactly those whose first visited key block is fully masked for them")
def _prediction(r: Results):
    exact = sum(r.predictions.values()) + sum(bool(p.get("prediction_exact")) for p in r.sweep.records)
    total = len(r.predictions) + len(r.sweep.records)
    return exact == total, f"{exact}/{total} cases (studied + sweep), rows of lse and out"


@claims("tl.isfinite does not exist: the patch as written cannot compile")
def _isfinite_missing(r: Results):
    return not r.isfinite_in_triton and "isfinite" in r.isfinite_error, r.isfinite_error


@claims("patch-equivalent on the failing cases: dV and dK become finite")
def _patch_finite(r: Results):
    failing = r.failing()
    finite = sum(r.get(c, "patch").finite("dv") and r.get(c, "patch").finite("dk") for c in failing)
    return finite == len(failing) > 0, f"{finite}/{len(failing)} failing cases"


@claims("patch-equivalent leaves out, lse and dq exactly as non-finite as the replica's")
def _patch_untouched(r: Results):
    same = sum(
        all(r.get(c, "patch").nonfinite(n) == r.get(c, "replica").nonfinite(n) for n in ("out", "lse", "dq")) for c in r.failing()
    )
    still = sum(r.get(c, "patch").nonfinite("dq") > 0 for c in r.failing())
    return same == len(r.failing()), f"{same}/{len(r.failing())} failing cases unchanged; dq still non-finite in {still}"


@claims("patch-equivalent's now-finite dV/dK are silently wrong: error > 10x the bound")
def _patch_wrong(r: Results):
    ratios = [min(r.get(c, "patch").error_ratio(g) for g in ("dk", "dv")) for c in r.failing()]
    return min(ratios) > 10, "dV/dK error / bound: " + ", ".join(f"{x:.0f}x" for x in ratios)


@claims("patch-equivalent swallows NaN arriving through dO: dV finite where autograd gives NaN")
def _patch_swallows(r: Results):
    oracle_nan = r.nan_do_oracle_nonfinite["dv"]
    buggy, patched = r.nan_do["replica"], r.nan_do["patch"]
    holds = oracle_nan > 0 and buggy.nonfinite("dv") > 0 and patched.finite("dv")
    return (
        holds,
        f"non-finite dV: oracle {oracle_nan}, replica {buggy.nonfinite('dv')}, patch 0 of {patched.tensors['dv'].numel()}; patch dq {patched.nonfinite('dq')}",
    )


@claims("every dk/dv row below seqlen_k is written: empty_like -> zeros_like changes nothing")
def _coverage(r: Results):
    good = sum(c.all_rows_written and c.identical for c in r.coverage)
    return good == len(
        r.coverage
    ), f"{good}/{len(r.coverage)} configs (causal, K > Q, ragged) bit-identical under NaN-poisoned memory"


@claims("sweep over mask density x block size: replica NaN somewhere, guard always finite and within bound")
def _sweep(r: Results):
    points = r.sweep.records
    nan = sum(p.get("replica_nonfinite_dv", 0) > 0 for p in points)
    good = sum(p["ok"] and p["guard_finite"] and p["guard_within"] for p in points)
    worst = max(p.get("guard_worst_ratio", math.inf) for p in points)
    return nan > 0 and good == len(
        points
    ), f"replica NaN dV in {nan}/{len(points)}; guard ok in {good}/{len(points)}, worst {worst:.2f} x bound"


@claims("left-padded batch: replica NaN on real keys' dV; varlen_attention on the packed layout exact-zero padding, within bound")
def _padded(r: Results):
    fixed = r.padded["fixed"]
    holds = r.padded["replica_dv_real_nan"] > 0 and fixed.padding_exactly_zero and fixed.real_within_bound and fixed.real_finite
    return (
        holds,
        f"replica: {r.padded['replica_dv_real_nan']}/{r.padded['real_keys']} real keys with NaN dV; fixed: padding zero {fixed.padding_exactly_zero}, within bound {fixed.real_within_bound}",
    )
