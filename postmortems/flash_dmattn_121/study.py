"""The study: the upstream kernel and the replica run on the cases, the two rules that predict the NaN, the sweep, the
coverage probe, the tiny training run, and reproduce()."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import warnings
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.replicas.dmattn import isfinite_exists, launch_patch_as_written, triton_dmattn_func
from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.flash_dmattn_121.cases import (
    COVERAGE_CASES,
    GRADS,
    META,
    NAN_DO_ROW,
    PACKED,
    PADDED,
    REPLICA_CASES,
    SEED,
    SWEEP_DENSITIES,
    SWEEP_SEQLENS,
    TENSORS,
    TRAIN_HEAD_DIM,
    TRAIN_HEADS,
    TRAIN_PAD,
    TRAIN_SEQLEN,
    TRAIN_STEPS,
    TRAIN_VARIANTS,
    TRAIN_VOCAB,
    UPSTREAM_CASES,
    UPSTREAM_TENSORS,
    VARIANTS,
    MaskCase,
)
from varlen_workbench.postmortems.flash_dmattn_121.upstream import upstream_dtype, upstream_triton_func, upstream_version
from varlen_workbench.workbench.bounds import ErrorCheck, error_check
from varlen_workbench.workbench.instruments.health import GradientHealth
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.layout import pack
from varlen_workbench.workbench.postmortem import Results as PostmortemResults
from varlen_workbench.workbench.postmortem import latest_gpu_record
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.sweeps import SweepResult, sweep


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


@contextlib.contextmanager
def _quiet():
    """The interpreter's numpy warns where exp(-inf - (-inf)) is born (and at the guard's log(0)),
    and at reductions over all-NaN rows; we count NaN ourselves."""
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="All-NaN slice encountered", category=RuntimeWarning)
        yield


def upstream_call_errors(device=None) -> dict[str, str]:
    """What the report's own snippet and its nearest working spelling raise on 1.2.2 (the report's configuration, no mask)."""
    func = upstream_triton_func(device)
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

    # the original report's line: `scale=` is not a parameter of 1.2.2 (it is `softmax_scale`)
    attempt("the report's snippet as written", lambda q, k, v: func(q, k, v, None, None, is_causal=True, scale=None))
    # the same with softmax_scale: the forward makes a zero bias, the backward returns dbias for a None input
    attempt("softmax_scale, attn_bias=None", lambda q, k, v: func(q, k, v, None, None, is_causal=True, softmax_scale=None))
    return found


def _d_out(d_out: torch.Tensor, nan_row: int | None) -> torch.Tensor:
    """dO, with NaN on one query row when studying NaN that arrives from the loss."""
    if nan_row is None:
        return d_out
    d_out = d_out.clone()
    d_out[:, nan_row] = float("nan")
    return d_out


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


def upstream_run(case: MaskCase, device=None, *, poisoned: bool = False) -> UpstreamRun:
    """1.2.2's `triton_dmattn_func` on `case` (in `case.dtype`): mask expanded to (B, H, Q, K) as it
    asserts, an explicit zero bias (None breaks its backward), dO as the case draws it (zero on padding
    query rows when `case.loss_mask`). `poisoned` runs it with NaN-filled fresh memory."""
    func = upstream_triton_func(device)
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
    checks = {"out": tensor_check("out", tensors["out"], ref, case, rows)}
    checks |= {g: tensor_check(g, tensors[g], ref, case) for g in GRADS}
    return UpstreamRun(case, tensors, checks, poisoned)


def tensor_check(
    name: str, value: torch.Tensor, ref: dict[str, dict[str, torch.Tensor]], case: MaskCase, rows: torch.Tensor | None = None
) -> ErrorCheck:
    """`name`'s error against `ref` (`oracle(case)`), on the (B, S) `rows` only when given."""
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])
    oracle, baseline = pick(ref["oracle"][name]), pick(ref["baseline"][name])
    return error_check(name, pick(value), oracle, baseline, case.torch_dtype, head_dim=case.head_dim, **case.reduction_lengths())


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
    checks = {n: tensor_check(n, tensors[n], ref, case) for n in ("out", "lse") + GRADS}
    return Run(case, variant, tensors, checks)


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
    """`sweep_point` over densities x lengths (varlen_workbench.workbench.sweeps.sweep(): a failing point is a record, not a crash)."""
    return sweep(functools.partial(sweep_point, device=device), density=list(densities), seqlen=list(seqlens), progress=False)


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


def patch_as_written_error(device=None) -> str:
    """The one line that matters of launching the PR's masking (natively a CompilationError
    wrapping the AttributeError the interpreter raises directly)."""
    try:
        launch_patch_as_written(default_device() if device is None else torch.device(device))
    except Exception as exc:  # whatever the mode raises is the finding
        message = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {next((m for m in message if 'isfinite' in m), message[-1] if message else '')}"
    return "no error"


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
    return probe(varlen_attention_triton, batch, name="varlen_attention", grad_out=d_out)


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


def _attention(variant: str, pad: int, device):
    """The attention a variant trains with, in the upstream dtype of `device`, on the left-padded batch's mask."""
    dtype = getattr(torch, upstream_dtype(device))
    case = _train_mask(pad, see_self=variant == TRAIN_VARIANTS[3])
    mask = case.mask().to(device)
    if variant == TRAIN_VARIANTS[1]:
        return lambda q, k, v: triton_dmattn_func(q.to(dtype), k.to(dtype), v.to(dtype), mask, None, True, patch=True)
    func = upstream_triton_func(device)
    full = mask.expand(2, TRAIN_HEADS, TRAIN_SEQLEN, TRAIN_SEQLEN).contiguous()
    bias = torch.zeros(full.shape, dtype=dtype, device=device)
    if variant == TRAIN_VARIANTS[2]:
        return lambda q, k, v: _Sanitized.apply(func, q.to(dtype), k.to(dtype), v.to(dtype), full, bias)
    return lambda q, k, v: func(q.to(dtype), k.to(dtype), v.to(dtype), full, bias, True, None)


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


@dataclass
class Results(PostmortemResults):
    device: str | None
    upstream_version: str | None
    upstream_dtype: str
    call_errors: dict[str, str]  # the original report's snippet and its nearest spelling, on 1.2.2
    upstream: dict[str, UpstreamRun]  # case name -> 1.2.2's kernel on it
    seed_poisoned: UpstreamRun  # the original report's configuration with NaN-filled fresh memory
    sweep: SweepResult  # 1.2.2 on random masks: NaN rows observed vs predicted
    coverage: list[Coverage]  # 1.2.2 under NaN-filled memory: every dk/dv row written?
    replica: dict[tuple[str, str], Run]  # (case name, variant) -> the replica
    nan_do: dict[str, Run]  # the original report's configuration with NaN in one row of dO, replica and patch
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


def successor_import_error() -> str:
    """`import flash_sparse_attn` in a fresh interpreter: 'ok', or the exception's first line."""
    code = "import flash_sparse_attn"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return "ok"
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


def _training(device) -> dict:
    runs = train_health(TRAIN_PAD, None if device is None else str(device))
    return {"pad": TRAIN_PAD, "variants": training_summary(runs), "deviation": training_deviation(runs)}


def upstream_cases(dtype: str) -> tuple[MaskCase, ...]:
    """The cases the upstream kernel is run on, in `dtype` (fp16 on CPU, bf16 on the GPU)."""
    return tuple(replace(c, dtype=dtype) for c in UPSTREAM_CASES)


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
        gpu=latest_gpu_record(META),
    )
