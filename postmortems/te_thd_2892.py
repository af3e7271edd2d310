"""Post-mortem te-thd-2892: real vs padded cu_seqlens in THD, FP8 alignment padding,
sequence-parallel sizing (NVIDIA/TransformerEngine#2892).

The report (seed 004) claimed a SIGSEGV in FP8-blockwise fused attention when
`cu_seqlens_q != cu_seqlens_q_padded`, an unpadded output with FP8 delayed scaling, and a
training collapse (ppl 3.7 -> 3055) from VERL's workaround of passing identical boundaries.
Upstream established: the reporter withdrew the SIGSEGV (a side effect of their own
workarounds), TE 2.12 had no FP8 THD attention at all (THD ran in BF16, FP8 touched only the
GEMMs), and the remaining corruption came from extending `cu_seqlens_padded[-1]` for FP8
alignment (follow-up PR #2911).

This module studies the whole contract the report is about, one part per function:

1. `layout_contract` / `te_recipe` — TE's docstring example and TE's own test recipe through
   the fixed kernel and the fp64 oracle;
2. `workaround_error` / `train_three_ways` — what `cu_seqlens = cu_seqlens_padded` does to
   real rows, and to a tiny causal LM trained on packed data;
3. `fp8_study` — blockwise FP8 scales from real rows only vs from every row;
4. `seqpar_study` — sequence-parallel all-gather / scatter sized from real vs padded boundaries;
5. `rope_study` — RoPE positions from the padded layout vs from real boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import varlen_attention
from kernels.fp8 import quantize_fp8_blockwise, quantize_reference, varlen_attention_fp8
from workbench.bounds import ErrorCheck, error_check
from workbench.health import GradientHealth
from workbench.layout import Case, Fill, Region, pack, real_rows, unpad_thd
from workbench.postmortem import Claims, Link, Meta
from workbench.poison import poisoned_memory
from workbench.probe import ProbeRecord, grad_output, probe
from workbench.reference import reference_attention
from workbench.tinylm import LMConfig, SyntheticTask, TrainingRun, dense_attention, train

META = Meta(
    id="te-thd-2892",
    title="Real vs padded cu_seqlens in THD attention: FP8 alignment padding, VERL's workaround, sequence-parallel sizing",
    component="TransformerEngine / DotProductAttention (THD) + Megatron-Core sequence parallelism",
    upstream_status="withdrawn",
    status_note="SIGSEGV withdrawn by the reporter; tail-padding corruption followed up in PR #2911",
    detection="training perplexity collapse and exploding gradient norm with packed, FP8-aligned sequences",
    fix_type="contract: mask by real boundaries, lay out and communicate by padded ones; FP8 scales from real rows",
    tags=("thd", "cu_seqlens_padded", "fp8", "sequence-parallel", "rope", "training"),
    reported="2026-04-16",
    published="2026-05-01",
    links=(
        Link("TE#2892", "https://github.com/NVIDIA/TransformerEngine/issues/2892"),
        Link("TE PR #2911", "https://github.com/NVIDIA/TransformerEngine/pull/2911"),
        Link("TE#3331", "https://github.com/NVIDIA/TransformerEngine/issues/3331"),
        Link("TE#2391", "https://github.com/NVIDIA/TransformerEngine/issues/2391"),
        Link("TE PR #3205", "https://github.com/NVIDIA/TransformerEngine/pull/3205"),
    ),
    seed="004_c27650584a0de2fe.txt",
)

# TE's DotProductAttention docstring: [a a a 1 b b 2 2 c c c c 3] (digits are padding), i.e.
# cu_seqlens_q = [0, 3, 5, 9] and cu_seqlens_q_padded = [0, 4, 8, 13].
TE_DOCSTRING = Case(seqlens_q=(3, 2, 4), padded_q=(4, 4, 5), heads=2, head_dim=16, dtype="float16", causal=True, fill=Fill.NAN)

# TE's test tolerances for its THD-with-padding tests (atol = rtol), by dtype.
TE_TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 1.5e-2}


def layout_contract(case: Case = TE_DOCSTRING, impl=varlen_attention, device=None) -> ProbeRecord:
    """The fixed kernel on a padded layout, forward and backward, NaN in every padding row and
    NaN-poisoned memory: the probe records shape, padding rows and REAL-row error vs the oracle."""
    return probe(impl, pack(case, device), name=getattr(impl, "__name__", "impl"), poisoned=True)


@dataclass(frozen=True)
class RecipeResult:
    """TE's THD-padding test recipe applied to one implementation."""

    case: Case
    pads: tuple[int, ...]  # padding rows appended to each sequence
    te_tolerance: float
    te_error: dict[str, float]  # tensor -> max(|x - ref| - rtol |ref|): <= atol passes TE's allclose
    checks: dict[str, ErrorCheck]  # tensor -> our relative bound (FlashAttention style)
    padding_max_abs: float  # largest |x| on padding rows of out, dq, dk, dv

    @property
    def te_passes(self) -> bool:
        return all(e <= self.te_tolerance for e in self.te_error.values())

    @property
    def within_bound(self) -> bool:
        return all(c.within for c in self.checks.values())


def te_case(seqlens: tuple[int, ...], *, dtype: str = "float16", causal: bool = True, heads: int = 2, head_dim: int = 32, seed: int = 0) -> tuple[Case, tuple[int, ...]]:
    """TE's layout: 0-3 padding rows appended to each sequence (drawn from `seed`), padding zeroed."""
    generator = torch.Generator().manual_seed(seed)
    pads = tuple(int(p) for p in torch.randint(0, 4, (len(seqlens),), generator=generator))
    case = Case(
        seqlens_q=seqlens, padded_q=tuple(n + p for n, p in zip(seqlens, pads)),
        heads=heads, head_dim=head_dim, dtype=dtype, causal=causal, seed=seed, fill=Fill.ZEROS,
    )
    return case, pads


def _unpadded_attention(batch, dtype: torch.dtype, d_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference of TE's recipe: the same attention on unpadded copies (no padding exists)."""
    cu_q, cu_k = batch.cu_seqlens_q, batch.cu_seqlens_k
    leaves = [
        unpad_thd(t.detach(), cu, pad).to(dtype).requires_grad_()
        for t, cu, pad in ((batch.q, cu_q, batch.cu_seqlens_q_padded), (batch.k, cu_k, batch.cu_seqlens_k_padded), (batch.v, cu_k, batch.cu_seqlens_k_padded))
    ]
    out = reference_attention(*leaves, cu_q, cu_k, batch.max_seqlen_q, batch.max_seqlen_k, causal=batch.case.causal, compute_dtype=dtype)
    out.backward(unpad_thd(d_out, cu_q, batch.cu_seqlens_q_padded).to(dtype))
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def te_recipe(impl, seqlens: tuple[int, ...], *, dtype: str = "float16", causal: bool = True, heads: int = 2, head_dim: int = 32, seed: int = 0, device=None) -> RecipeResult:
    """TE's own test of THD with padding between sequences, run on `impl`.

    Append 0-3 padding rows per sequence, zero padding rows of q, k, v and of the output
    gradient, run `impl` on the padded layout, run the reference on unpadded copies, and
    compare valid rows only: TE's allclose (atol = rtol = `TE_TOLERANCE[dtype]`) and our
    relative bound (error <= FlashAttention factor x PyTorch's own error in `dtype`).
    """
    case, pads = te_case(seqlens, dtype=dtype, causal=causal, heads=heads, head_dim=head_dim, seed=seed)
    batch = pack(case, device)
    torch_dtype = case.torch_dtype
    if torch_dtype not in TE_TOLERANCE:
        raise ValueError(f"dtype = {dtype!r}: TE's recipe states tolerances for {sorted(str(d) for d in TE_TOLERANCE)} only.")
    d_out = grad_output(batch).masked_fill((batch.regions_q != Region.REAL).to(batch.device)[:, None, None], 0.0)
    out = batch.call(impl)
    out.backward(d_out)
    got = {"out": out.detach(), "dq": batch.q.grad, "dk": batch.k.grad, "dv": batch.v.grad}
    oracle = _unpadded_attention(batch, torch.float64, d_out)
    baseline = _unpadded_attention(batch, torch_dtype, d_out)
    tol = TE_TOLERANCE[torch_dtype]
    te_error, checks, padding = {}, {}, 0.0
    for name, value in got.items():
        side = "q" if name in ("out", "dq") else "k"
        cu, cu_padded = getattr(batch, f"cu_seqlens_{side}"), getattr(batch, f"cu_seqlens_{side}_padded")
        valid = unpad_thd(value, cu, cu_padded).double().cpu()
        ref = oracle[name].cpu()
        te_error[name] = float(((valid - ref).abs() - tol * ref.abs()).max())
        checks[name] = error_check(name, valid, ref, baseline[name].cpu(), torch_dtype)
        rows = batch.regions(name) != Region.REAL
        if rows.any():
            padding = max(padding, float(value.detach().cpu()[rows].abs().max()))
    return RecipeResult(case, pads, tol, te_error, checks, padding)


# -- 2. VERL's workaround: cu_seqlens = cu_seqlens_padded ------------------------------------


def workaround_call(batch, impl=varlen_attention):
    """What VERL does: the padded boundaries passed as the real ones, so padding rows count as tokens."""
    longest_q = int(batch.cu_seqlens_q_padded.diff().max())
    longest_k = int(batch.cu_seqlens_k_padded.diff().max())
    return impl(
        batch.q, batch.k, batch.v, batch.cu_seqlens_q_padded, batch.cu_seqlens_k_padded, longest_q, longest_k,
        cu_seqlens_q_padded=batch.cu_seqlens_q_padded, cu_seqlens_k_padded=batch.cu_seqlens_k_padded, causal=batch.case.causal,
    )


def workaround_error(case: Case, impl=varlen_attention, device=None) -> ErrorCheck:
    """REAL-row output error of the workaround against the fp64 oracle of the correct contract."""
    batch = pack(case, device, requires_grad=False)
    real = (batch.regions_q == Region.REAL)
    oracle = batch.call(reference_attention).cpu()[real]
    baseline = batch.call(reference_attention, compute_dtype=case.torch_dtype).cpu()[real]
    return error_check("out", workaround_call(batch, impl).cpu()[real], oracle, baseline, case.torch_dtype)


SWEEP_SEQLENS = (24, 40, 17, 31)
PADDING_FRACTIONS = (0.0, 0.1, 0.2, 0.35, 0.5)


def padding_case(fraction: float, *, causal: bool, seqlens: tuple[int, ...] = SWEEP_SEQLENS, fill: Fill = Fill.ZEROS, **case_fields) -> Case:
    """Sequences padded so that about `fraction` of every sequence's rows are padding.

    Padding holds zeros by default (TE's recipe zeroes it; VERL pads token ids, whose q/k/v
    are finite vectors): a zero key scores 0 and steals softmax mass, a visible damage.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction = {fraction} must be in [0, 1): the share of padding rows.")
    padded = tuple(n + round(fraction * n / (1.0 - fraction)) for n in seqlens)
    return Case(seqlens_q=seqlens, padded_q=padded, padded_k=padded, causal=causal, fill=fill, **{"heads": 2, "head_dim": 16, **case_fields})


def workaround_sweep(impl, fractions=PADDING_FRACTIONS, **case_fields) -> dict[bool, list[tuple[float, ErrorCheck]]]:
    """Workaround error on REAL rows vs padding fraction, non-causal and causal."""
    return {
        causal: [(f, workaround_error(padding_case(f, causal=causal, **case_fields), impl)) for f in fractions]
        for causal in (False, True)
    }


# -- 2b. Training a tiny causal LM three ways (and the tail mechanism of PR #2911) ------------

TRAIN_STEPS = 80
TRAIN_SEQS = 8  # sequences per packed batch
ALIGN = 16  # FP8 alignment: every padded length (or the total) a multiple of 16 rows
EVAL_SEQLENS = (20, 33, 12, 27, 9, 40, 11, 30)


class _Truncate(torch.autograd.Function):
    """x[:end] whose backward leaves rows >= end of the gradient uninitialised (`torch.empty`)."""

    @staticmethod
    def forward(ctx, x, end):
        ctx.shape, ctx.end = x.shape, end
        return x[:end].clone()

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_empty(ctx.shape)
        full[: ctx.end] = grad
        return full, None


class _Extend(torch.autograd.Function):
    """x extended to `total` rows whose rows >= len(x) are left uninitialised (`torch.empty`)."""

    @staticmethod
    def forward(ctx, x, total):
        ctx.rows = x.shape[0]
        full = x.new_empty((total, *x.shape[1:]))
        full[: x.shape[0]] = x
        return full

    @staticmethod
    def backward(ctx, grad):
        return grad[: ctx.rows], None


def tail_blind(attention):
    """TE 2.12's path for padding only at the end, built on a correct `attention`.

    TE decides `pad_between_seqs` by comparing `cu_seqlens_padded[:-1]` with `cu_seqlens[:-1]`
    (TE#3331), blind to tail padding, so it hands the batch to a backend that knows only
    `cu_seqlens`: rows from `cu_seqlens[-1]` on are never written in the output nor in
    dq/dk/dv (FA3 leaves garbage there; TE's CP tests note it, PR #3205 makes zeros a
    requirement). Real rows stay exact: the damage is only what is not written.
    """

    def tail_blind_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, **kwargs):
        total, end_q, end_k = q.shape[0], int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
        q, k, v = _Truncate.apply(q, end_q), _Truncate.apply(k, end_k), _Truncate.apply(v, end_k)
        out = attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
        return _Extend.apply(out, total)

    return tail_blind_attention


TRAINING_RUNS = ("correct", "workaround", "padding at the end", "padding at the end, tail-blind backend")


def train_three_ways(steps: int = TRAIN_STEPS, seed: int = 0) -> dict[str, tuple[TrainingRun, GradientHealth]]:
    """The tiny LM trained on the same packed sequences with each layout / metadata choice.

    * correct — every sequence padded to a multiple of `ALIGN`, masked by real boundaries;
    * workaround — same layout, `cu_seqlens = cu_seqlens_padded` (VERL);
    * padding at the end — sequences back to back, only `cu_seqlens_padded[-1]` extended;
    * padding at the end, tail-blind backend — the same through `tail_blind` (TE#3331's
      backend choice), under `poisoned_memory()` so unwritten rows hold NaN on every run.

    Attention is `workbench.tinylm.dense_attention` (the contract as one masked matmul,
    tested against the fp64 oracle): the interpreted Triton kernel costs seconds per step.
    Every run is evaluated with the correct contract on the same held-out batch.
    """
    generator = torch.Generator().manual_seed(seed)
    seqlens = [tuple(torch.randint(6, 40, (TRAIN_SEQS,), generator=generator).tolist()) for _ in range(steps)]

    def batches(**layout):
        task = SyntheticTask(seed=seed)  # same sequences for every run
        return [task.batch(lengths, **layout) for lengths in seqlens]

    eval_batch = SyntheticTask(seed=seed + 1).batch(EVAL_SEQLENS, align=ALIGN)
    common = dict(eval_batch=eval_batch, config=LMConfig(seed=seed), monitor_factory=GradientHealth)
    correct, workaround, end, blind = TRAINING_RUNS
    runs = {
        correct: train(correct, batches(align=ALIGN), **common),
        workaround: train(workaround, batches(align=ALIGN), workaround=True, **common),
        end: train(end, batches(tail_align=ALIGN), **common),
    }
    with poisoned_memory():
        runs[blind] = train(blind, batches(tail_align=ALIGN), attention=tail_blind(dense_attention), **common)
    return runs


# -- 3. FP8 blockwise: scales from REAL rows vs from every row ----------------------------------

FP8_CASE = Case(seqlens_q=(20, 13, 30), align=16, heads=2, head_dim=32, dtype="bfloat16", causal=True, seed=3)
FP8_FILLS = (Fill.GARBAGE, Fill.HUGE, Fill.NAN)


def _quantized(batch, scales_from: str, quantize=quantize_fp8_blockwise):
    return [
        quantize(x, cu, cu_padded, scales_from=scales_from)
        for x, cu, cu_padded in (
            (batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded),
            (batch.k, batch.cu_seqlens_k, batch.cu_seqlens_k_padded),
            (batch.v, batch.cu_seqlens_k, batch.cu_seqlens_k_padded),
        )
    ]


def fp8_error(case: Case, scales_from: str, device=None) -> ErrorCheck:
    """REAL-row error of the FP8 forward against the fp64 oracle on the unquantized inputs.

    The bound follows FlashAttention's rule with FP8 as the precision: at most 2x the error of
    PyTorch doing the same FP8 computation (torch's own e4m3 cast with per-(block, head) scales
    from real rows, then exact attention), plus one ulp of the output dtype. e4m3 keeps 3
    mantissa bits (2^-4 relative rounding), so that baseline is large: the bound is about
    what FP8 costs, not about the kernel.
    """
    batch = pack(case, device, requires_grad=False)
    real = batch.regions_q == Region.REAL
    oracle = batch.call(reference_attention).cpu()[real]
    emulated = [x.dequantize() for x in _quantized(batch, "real", quantize_reference)]
    baseline = reference_attention(*emulated, *batch.args()[3:], **batch.kwargs()).cpu()[real]
    out = varlen_attention_fp8(*_quantized(batch, scales_from), *batch.args()[3:], **batch.kwargs(), out_dtype=case.torch_dtype)
    return error_check("out", out.cpu()[real], oracle, baseline, case.torch_dtype)


def fp8_study(case: Case = FP8_CASE, fills=FP8_FILLS, device=None) -> dict[tuple[str, str], ErrorCheck]:
    """(padding fill, scales_from) -> REAL-row error check of the FP8 forward."""
    return {(fill.value, mode): fp8_error(case.with_(fill=fill), mode, device) for fill in fills for mode in ("real", "all")}
