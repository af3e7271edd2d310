"""Post-mortem te-thd-2892: real vs padded cu_seqlens in TransformerEngine's THD attention, FP8
alignment padding and VERL's identical-boundaries workaround (NVIDIA/TransformerEngine#2892).

TransformerEngine needs compiled CUDA extensions that cannot be built here (nor on the GPU
image), so nothing on this page runs TE itself. Every claim says what produced its evidence:
a reading of TE's source at a named commit, our replica of a mechanism (the contract as one
masked matmul, `workbench.tinylm.dense_attention`; our FP8 quantizer and kernel), a toy model
(`workbench.tinylm`), or our own kernel (`kernels.varlen_attention`).

The study, one function per part:

1. `workaround_error` / `contract_error` / `workaround_sweep`: what `cu_seqlens = cu_seqlens_padded`
   (VERL's workaround) does to real rows of attention, causal and not;
2. `train_three_ways` / `bidirectional_seeds` / `health_runs`: the same on a tiny model's training
   (causal: nothing; bidirectional: several seeds; per-parameter gradient norms by padding share);
3. `fp8_study`: blockwise FP8 scales from real rows, from every row, and from every row with the
   padding zeroed;
4. `tail_blind` / `zero_tail`: a backend that never writes the rows after `cu_seqlens[-1]`, and
   the workaround of zeroing them;
5. `auto_detect_table`: TE's `pad_between_seqs` auto-detect, transcribed from two commits;
6. appendix: `rope_study`, `seqpar_study` (a sizing lesson), `te_recipe` (TE's THD padding test
   on our kernel), `cast_study` (the Triton interpreter's e4m3 cast).

`reproduce()` runs them all and returns `TeResults`; `claims` checks them.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import matplotlib
import torch

from kernels import INTERPRETED, default_device, varlen_attention
from kernels.fp8 import FP8, FP8_MAX, plain_cast_e4m3, quantize_fp8_blockwise, quantize_reference, varlen_attention_fp8
from workbench.bounds import ErrorCheck, error_check
from workbench.health import GradientHealth
from workbench.layout import Case, Fill, Region, cumulative, pack, unpad_thd
from workbench.plots import INK, REGION_COLORS, SERIES, STYLE, attention_mask, plot_health
from workbench.poison import poisoned_memory
from workbench.postmortem import (
    OURS,
    REPLICA,
    TOY,
    Claims,
    Link,
    Meta,
    Results,
    figure,
    source_at,
    table,
)
from workbench.probe import ProbeRecord, grad_output, probe
from workbench.reference import reference_attention
from workbench.seqpar import BOUNDARIES, SeqParStudy, run_sequence_parallel
from workbench.tinylm import (
    IGNORE,
    PAD_TOKEN,
    LMConfig,
    PackedTokens,
    SyntheticTask,
    TinyLM,
    TrainingRun,
    apply_rope,
    dense_attention,
    mask_tokens,
    rope_positions,
    train,
)

ISSUE = "https://github.com/NVIDIA/TransformerEngine/issues/2892"
TE = "https://github.com/NVIDIA/TransformerEngine"
# The upstream commits read for the source-reading claims (the v2.12 tag, and main as fetched).
TE_V2_12 = "NVIDIA/TransformerEngine@5671fd3675906cda1ade26c24a65d3dedd88eb89"
TE_MAIN = "NVIDIA/TransformerEngine@d0067d0da6cb01811b8072a7d304f0e00344ce2b"

META = Meta(
    id="te-thd-2892",
    title="TransformerEngine THD: real vs padded cu_seqlens, FP8 alignment padding and VERL's identical-boundaries workaround",
    component="TransformerEngine / DotProductAttention (THD) and FP8 GEMMs; VERL sequence packing",
    category="training bug",
    impact=(
        "a reported run collapsed (ppl 3.7 -> 3055) after FP8 alignment padding entered packed THD batches (the "
        "reporter's attribution; TE itself not run here); VERL's identical cu_seqlens workaround shows padding to "
        "non-causal attention"
    ),
    upstream_status="open",
    status_note=(
        "the issue is open; its SIGSEGV was withdrawn by the reporter on 2026-04-17; the reporter's PR #2911 "
        "(pad FP8 GEMMs inside cublas_gemm) is open, not merged"
    ),
    our_verdict=(
        "crash not reproduced by anyone (withdrawn); the workaround is harmless for causal attention with padding "
        "at each sequence's end and harmful without a causal mask; the FP8-scale mechanism holds in our replica only"
    ),
    detection="loss and gradient-norm blow-up when FP8 alignment padding is enabled for packed sequences",
    fix_type="pass real cu_seqlens with cu_seqlens_padded; keep padding rows zero before FP8 quantization; zero tail rows",
    tags=("thd", "cu_seqlens_padded", "fp8", "training"),
    reported="2026-04-16",
    published="2026-11-29",
    revised="2026-12-01",
    links=(
        Link(
            "Dao-AILab/flash-attention#1228: rows after cu_seqlens[-1] may be uninitialised",
            "https://github.com/Dao-AILab/flash-attention/issues/1228",
            "2024-09-14",
            "issue",
            "open",
        ),
        Link("TE#2391: FlashAttention with pad_between_seqs=True", f"{TE}/issues/2391", "2025-11-17", "issue", "open when read"),
        Link(
            "verl#5440: FP8 block-quantization padding for the Megatron EngineWorker",
            "https://github.com/verl-project/verl/pull/5440",
            "2026-02-28",
            "PR",
            "merged",
        ),
        Link("TE#2892: the report (SIGSEGV, VERL workaround, ppl 3.7 -> 3055)", ISSUE, "2026-04-16", "issue", "open"),
        Link(
            "TE#2892: the reporter withdraws the SIGSEGV; corruption from extending cu_seqlens_padded[-1]",
            ISSUE,
            "2026-04-17",
            "thread",
            "comment",
        ),
        Link("TE PR #2911: auto-pad FP8 GEMM m/k inside cublas_gemm", f"{TE}/pull/2911", "2026-04-21", "PR", "open, not merged"),
        Link("TE PR #2596: pad_between_seqs with FlashAttention 3", f"{TE}/pull/2596", "2026-05-22", "PR", "merged, in v2.17"),
        Link(
            "TE PR #2898: CUDA graphs with THD; rewrites the pad_between_seqs auto-detect",
            f"{TE}/pull/2898",
            "2026-07-01",
            "PR",
            "merged, in v2.18",
        ),
        Link(
            "TE PR #2994: Plumb FP8+THD (FP8 fused attention for THD; its release not established here)",
            f"{TE}/pull/2994",
            "2026-08-11",
            "PR",
            "merged",
        ),
        Link(
            "TE PR #3205: FA3/FA4 with pad_between_seqs, exact zeros on padding rows",
            f"{TE}/pull/3205",
            "2026-07-13",
            "PR",
            "open",
        ),
        Link(
            "TE#3331: THD + context parallelism, auto-detect blind to tail padding",
            f"{TE}/issues/3331",
            "2026-08-08",
            "issue",
            "closed by its reporter (worked around)",
        ),
    ),
    seed="004_c27650584a0de2fe.txt",
)

# TE's DotProductAttention docstring: [a a a 1 b b 2 2 c c c c 3] (digits are padding), i.e.
# cu_seqlens_q = [0, 3, 5, 9] and cu_seqlens_q_padded = [0, 4, 8, 13].
TE_DOCSTRING = Case(
    seqlens_q=(3, 2, 4), padded_q=(4, 4, 5), padded_k=(4, 4, 5), heads=2, head_dim=16, dtype="float16", causal=True, fill=Fill.NAN
)

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


def te_case(
    seqlens: tuple[int, ...], *, dtype: str = "float16", causal: bool = True, heads: int = 2, head_dim: int = 32, seed: int = 0
) -> tuple[Case, tuple[int, ...]]:
    """TE's layout: 0-3 padding rows appended to each sequence (drawn from `seed`), padding zeroed."""
    generator = torch.Generator().manual_seed(seed)
    pads = tuple(int(p) for p in torch.randint(0, 4, (len(seqlens),), generator=generator))
    case = Case(
        seqlens_q=seqlens,
        padded_q=tuple(n + p for n, p in zip(seqlens, pads)),
        heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        causal=causal,
        seed=seed,
        fill=Fill.ZEROS,
    )
    return case, pads


def _unpadded_attention(batch, dtype: torch.dtype, d_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference of TE's recipe: the same attention on unpadded copies (no padding exists)."""
    cu_q, cu_k = batch.cu_seqlens_q, batch.cu_seqlens_k
    leaves = [
        unpad_thd(t.detach(), cu, pad).to(dtype).requires_grad_()
        for t, cu, pad in (
            (batch.q, cu_q, batch.cu_seqlens_q_padded),
            (batch.k, cu_k, batch.cu_seqlens_k_padded),
            (batch.v, cu_k, batch.cu_seqlens_k_padded),
        )
    ]
    out = reference_attention(
        *leaves, cu_q, cu_k, batch.max_seqlen_q, batch.max_seqlen_k, causal=batch.case.causal, compute_dtype=dtype
    )
    out.backward(unpad_thd(d_out, cu_q, batch.cu_seqlens_q_padded).to(dtype))
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def te_recipe(
    impl,
    seqlens: tuple[int, ...],
    *,
    dtype: str = "float16",
    causal: bool = True,
    heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
    device=None,
) -> RecipeResult:
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
        batch.q,
        batch.k,
        batch.v,
        batch.cu_seqlens_q_padded,
        batch.cu_seqlens_k_padded,
        longest_q,
        longest_k,
        cu_seqlens_q_padded=batch.cu_seqlens_q_padded,
        cu_seqlens_k_padded=batch.cu_seqlens_k_padded,
        causal=batch.case.causal,
    )


def workaround_error(case: Case, impl=varlen_attention, device=None) -> ErrorCheck:
    """REAL-row output error of the workaround against the fp64 oracle of the correct contract."""
    batch = pack(case, device, requires_grad=False)
    real = batch.regions_q == Region.REAL
    oracle = batch.call(reference_attention).cpu()[real]
    baseline = batch.call(reference_attention, compute_dtype=case.torch_dtype).cpu()[real]
    return error_check("out", workaround_call(batch, impl).cpu()[real], oracle, baseline, case.torch_dtype)


def contract_error(case: Case, impl=dense_attention, device=None) -> ErrorCheck:
    """REAL-row output error of the correct call (real `cu_seqlens`, padded `cu_seqlens_padded`)."""
    batch = pack(case, device, requires_grad=False)
    real = batch.regions_q == Region.REAL
    oracle = batch.call(reference_attention).cpu()[real]
    baseline = batch.call(reference_attention, compute_dtype=case.torch_dtype).cpu()[real]
    return error_check("out", batch.call(impl).cpu()[real], oracle, baseline, case.torch_dtype)


SWEEP_SEQLENS = (24, 40, 17, 31)
PADDING_FRACTIONS = (0.0, 0.1, 0.2, 0.35, 0.5)


def padding_case(
    fraction: float,
    *,
    causal: bool,
    seqlens: tuple[int, ...] = SWEEP_SEQLENS,
    align: int = 1,
    fill: Fill = Fill.ZEROS,
    **case_fields,
) -> Case:
    """Sequences padded so that about `fraction` of every sequence's rows are padding, then
    each padded length rounded up to a multiple of `align` (FP8 alignment adds more).

    Padding holds zeros by default (TE's recipe zeroes it; VERL pads token ids, whose q/k/v
    are finite vectors): a zero key scores 0 and steals softmax mass, a visible damage.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction = {fraction} must be in [0, 1): the share of padding rows.")
    if align < 1:
        raise ValueError(f"align = {align} must be >= 1 (rows per alignment unit; 1 = no alignment).")
    padded = tuple(-(-(n + round(fraction * n / (1.0 - fraction))) // align) * align for n in seqlens)
    return Case(
        seqlens_q=seqlens,
        padded_q=padded,
        padded_k=padded,
        causal=causal,
        fill=fill,
        **{"heads": 2, "head_dim": 16, **case_fields},
    )


def workaround_sweep(impl, fractions=PADDING_FRACTIONS, **case_fields) -> dict[bool, list[tuple[float, ErrorCheck]]]:
    """Workaround error on REAL rows vs padding fraction, non-causal and causal."""
    return {
        causal: [(f, workaround_error(padding_case(f, causal=causal, **case_fields), impl)) for f in fractions]
        for causal in (False, True)
    }


# -- 2. Training a tiny model with the workaround, and a backend that leaves the tail unwritten -----

TRAIN_STEPS = 60
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
    """A backend that knows only `cu_seqlens`, built on a correct `attention`: rows from
    `cu_seqlens[-1]` on are never written in the output nor in dq/dk/dv (`torch.empty`).

    FlashAttention-2's varlen kernels leave those rows unwritten (Dao-AILab/flash-attention#1228).
    TE 2.12 to 2.17.1 keep FlashAttention eligible for a batch padded only at its end, since
    their `pad_between_seqs` auto-detect ignores the last boundary (`pad_between_seqs_v2_12`);
    on Hopper and newer TE prefers its fused backend, which zeroes those rows. Real rows stay
    exact: the damage is only what is not written.
    """

    def tail_blind_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        cu_seqlens_q_padded=None,
        cu_seqlens_k_padded=None,
        **kwargs,
    ):
        total, end_q, end_k = q.shape[0], int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
        q, k, v = _Truncate.apply(q, end_q), _Truncate.apply(k, end_k), _Truncate.apply(v, end_k)
        out = attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
        return _Extend.apply(out, total)

    return tail_blind_attention


class _ZeroTailGrad(torch.autograd.Function):
    """Identity whose backward replaces gradient rows >= `end` by exact zeros (NaN included)."""

    @staticmethod
    def forward(ctx, x, end):
        ctx.end = end
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        rows = torch.arange(grad.shape[0], device=grad.device)[:, None, None]
        return torch.where(rows < ctx.end, grad, torch.zeros_like(grad)), None


def zero_tail(attention):
    """The workaround for a tail-blind backend: zero rows >= `cu_seqlens[-1]` of the output and
    of dq/dk/dv (with `torch.where`, so that NaN left there is replaced, not multiplied)."""

    def zero_tail_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
        end_q, end_k = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
        q, k, v = _ZeroTailGrad.apply(q, end_q), _ZeroTailGrad.apply(k, end_k), _ZeroTailGrad.apply(v, end_k)
        out = attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs)
        rows = torch.arange(out.shape[0], device=out.device)[:, None, None]
        return torch.where(rows < end_q, out, torch.zeros_like(out))

    return zero_tail_attention


def _training_seqlens(steps: int, seed: int) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(6, 40, (TRAIN_SEQS,), generator=generator).tolist()) for _ in range(steps)]


TRAINING_RUNS = (
    "correct",
    "workaround",
    "padding at the end",
    "padding at the end, tail-blind backend",
    "padding at the end, tail-blind backend, tail zeroed",
)


def train_three_ways(steps: int = TRAIN_STEPS, seed: int = 0) -> dict[str, tuple[TrainingRun, GradientHealth]]:
    """The tiny causal LM trained on the same packed sequences with each layout / metadata choice.

    * correct: every sequence padded to a multiple of `ALIGN`, masked by real boundaries;
    * workaround: same layout, `cu_seqlens = cu_seqlens_padded` (VERL);
    * padding at the end: sequences back to back, only `cu_seqlens_padded[-1]` extended;
    * the same through `tail_blind` under `poisoned_memory()` (unwritten rows hold NaN), and
      through `zero_tail(tail_blind(...))`, the workaround.

    Attention is `dense_attention` (the contract as one masked matmul, tested against the fp64
    oracle). Every run is evaluated on the same held-out sequences, packed in its own layout.
    """
    seqlens = _training_seqlens(steps, seed)

    def batches(**layout):
        task = SyntheticTask(seed=seed)  # same sequences for every run
        return [task.batch(lengths, **layout) for lengths in seqlens]

    # Held out: the same sequences in each run's own layout (a tail-only backend cannot read padding between sequences).
    between = dict(eval_batch=SyntheticTask(seed=seed + 1).batch(EVAL_SEQLENS, align=ALIGN))
    at_end = dict(eval_batch=SyntheticTask(seed=seed + 1).batch(EVAL_SEQLENS, tail_align=ALIGN))
    common = dict(config=LMConfig(seed=seed), monitor_factory=GradientHealth)
    correct, workaround, end, blind, zeroed = TRAINING_RUNS
    runs = {
        correct: train(correct, batches(align=ALIGN), **between, **common),
        workaround: train(workaround, batches(align=ALIGN), workaround=True, **between, **common),
        end: train(end, batches(tail_align=ALIGN), **at_end, **common),
    }
    with poisoned_memory():
        runs[blind] = train(blind, batches(tail_align=ALIGN), attention=tail_blind(dense_attention), **at_end, **common)
        runs[zeroed] = train(
            zeroed, batches(tail_align=ALIGN), attention=zero_tail(tail_blind(dense_attention)), **at_end, **common
        )
    return runs


MASK_RATE = 0.25  # share of real tokens the masked-token objective hides
BIDIRECTIONAL_SEEDS = (0, 1, 2, 3, 4)
BIDIRECTIONAL_STEPS = 50


@dataclass(frozen=True)
class SeedRun:
    """The bidirectional toy trained with one seed, correct and with the workaround."""

    seed: int
    correct: TrainingRun
    workaround: TrainingRun

    @property
    def train_gap(self) -> float:
        """Workaround minus correct: final training loss (mean of the last 10% of steps)."""
        return self.workaround.final_loss - self.correct.final_loss

    @property
    def heldout_gap(self) -> float:
        """Workaround minus correct: held-out loss, both judged with the correct contract."""
        return self.workaround.eval_loss - self.correct.eval_loss


def padded_batch(task: SyntheticTask, seqlens, fraction: float) -> PackedTokens:
    """`task`'s sequences with about `fraction` of every sequence's rows as padding at its end."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction = {fraction} must be in [0, 1): the share of padding rows.")
    padded = [n + round(fraction * n / (1.0 - fraction)) for n in seqlens]
    cu, cu_padded = cumulative(seqlens), cumulative(padded)
    tokens = torch.full((int(cu_padded[-1]),), PAD_TOKEN, dtype=torch.int64)
    targets = torch.full_like(tokens, IGNORE)
    for n, start in zip(seqlens, cu_padded.tolist()):
        sequence = task.sequence(n)
        tokens[start : start + n] = sequence
        targets[start : start + n - 1] = sequence[1:]
    return PackedTokens(tokens, targets, cu, cu_padded, max(seqlens))


def train_bidirectional(
    steps: int = BIDIRECTIONAL_STEPS, seed: int = 0, *, fraction: float | None = None, monitor: bool = False
) -> dict[str, tuple[TrainingRun, GradientHealth | None]]:
    """A bidirectional (non-causal) tiny model trained on masked tokens, correct vs workaround.

    Every real token is hidden with probability `MASK_RATE` (the mask token is one past the
    task's vocabulary) and predicted from the rest of its sequence. Layout: each sequence
    padded to a multiple of `ALIGN` (fraction None) or by `fraction` of its rows. Without a
    causal mask, the workaround shows a sequence's padding keys to all of its real queries.
    """
    seqlens = _training_seqlens(steps, seed)
    mask_token = SyntheticTask().vocab
    config = LMConfig(vocab=mask_token + 1, seed=seed, causal=False)

    def layout(task, lengths):
        return task.batch(lengths, align=ALIGN) if fraction is None else padded_batch(task, lengths, fraction)

    def batches():
        task, generator = SyntheticTask(seed=seed), torch.Generator().manual_seed(seed)
        return [mask_tokens(layout(task, lengths), mask_token, MASK_RATE, generator) for lengths in seqlens]

    eval_batch = mask_tokens(
        SyntheticTask(seed=seed + 1).batch(EVAL_SEQLENS, align=ALIGN),
        mask_token,
        MASK_RATE,
        torch.Generator().manual_seed(seed + 1),
    )
    factory = GradientHealth if monitor else None
    return {
        name: train(name, batches(), eval_batch, config=config, workaround=name == "workaround", monitor_factory=factory)
        for name in ("correct", "workaround")
    }


def bidirectional_seeds(seeds=BIDIRECTIONAL_SEEDS, steps: int = BIDIRECTIONAL_STEPS) -> tuple[SeedRun, ...]:
    """The bidirectional toy, correct vs workaround, once per seed (weights, data, masks)."""
    runs = []
    for seed in seeds:
        pair = train_bidirectional(steps, seed)
        runs.append(SeedRun(seed, pair["correct"][0], pair["workaround"][0]))
    return tuple(runs)


HEALTH_FRACTIONS = (0.75, 0.5, 0.25, 0.0)  # the explorer opens on the first: the damage shows
HEALTH_STEPS = 30
HEALTH_PARAMS = ("blocks.0.qkv.weight", "blocks.1.qkv.weight", "embed.weight")


@functools.lru_cache(maxsize=len(HEALTH_FRACTIONS))
def health_runs(fraction: float, steps: int = HEALTH_STEPS) -> dict[str, GradientHealth]:
    """Per-parameter gradient norms of the bidirectional toy, workaround and correct contract,
    with `fraction` of every sequence's rows as padding (cached: the explorer reuses them)."""
    runs = train_bidirectional(steps, 0, fraction=fraction, monitor=True)
    return {"VERL workaround": runs["workaround"][1], "correct contract": runs["correct"][1]}


def qkv_norm_ratio(monitors: dict[str, GradientHealth], last: int = 10) -> float:
    """Mean gradient norm of the qkv projections over the last `last` steps, workaround / correct."""

    def mean(monitor):
        values = [x for name in HEALTH_PARAMS if "qkv" in name for x in monitor.norms(name)[-last:]]
        return sum(values) / len(values)

    return mean(monitors["VERL workaround"]) / mean(monitors["correct contract"])


def plot_gradient_health(fraction: float):
    """The explorer's frame: per-parameter gradient norms over training, workaround beside correct."""
    monitors = health_runs(fraction)
    fig = plot_health(monitors, list(HEALTH_PARAMS))
    finite = [x for m in monitors.values() for name in HEALTH_PARAMS for x in m.norms(name) if math.isfinite(x) and x > 0]
    fig.axes[0].set_ylim(min(finite) / 4, max(finite) * 4)  # zoom past the threshold bands: the runs' own range
    fig.suptitle(
        f"bidirectional toy, {fraction:.0%} of rows are padding: qkv gradient norm, workaround / correct = "
        f"{qkv_norm_ratio(monitors):.2f}",
        x=0.01,
        ha="left",
        fontsize=10,
    )
    return fig


# -- 5. TE's pad_between_seqs auto-detect, transcribed ---------------------------------------------


def pad_between_seqs_v2_12(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> bool:
    """TE 2.12 to 2.17.1 (`DotProductAttention.forward`, qkv_format "thd", argument None): padding
    between sequences iff the boundaries differ anywhere but in their last entry."""
    return not torch.equal(cu_seqlens_padded[:-1], cu_seqlens[:-1])


def pad_between_seqs_main(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> bool:
    """TE main after PR #2898 (v2.18): padding between sequences iff a padded tensor was passed
    that is not the same object as the real one (sync-free, so values are not compared)."""
    return cu_seqlens_padded is not cu_seqlens


def auto_detect_layouts() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(cu_seqlens, cu_seqlens_padded) of four layouts of the sequences 3, 2, 4."""
    cu = cumulative([3, 2, 4])
    return {
        "padding between sequences (TE's docstring)": (cu, cumulative([4, 4, 5])),
        "padding at the end only": (cu, cumulative([3, 2, 11])),
        "VERL: equal values, two tensors": (cumulative([4, 4, 5]), cumulative([4, 4, 5])),
        "no padding, one tensor passed twice": (cu, cu),
    }


def auto_detect() -> dict[str, tuple[bool, bool]]:
    """Layout -> (TE 2.12 detects padding between sequences, TE main detects it)."""
    return {name: (pad_between_seqs_v2_12(*pair), pad_between_seqs_main(*pair)) for name, pair in auto_detect_layouts().items()}


# -- 3. FP8 blockwise: scales from REAL rows vs from every row ----------------------------------

FP8_CASE = Case(seqlens_q=(20, 13, 30), align=16, heads=2, head_dim=32, dtype="bfloat16", causal=True, seed=3)
FP8_FILLS = (Fill.GARBAGE, Fill.HUGE, Fill.NAN, Fill.ZEROS)


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


def cast_study(device=None) -> dict:
    """Triton's own fp32 -> e4m3 cast vs torch's, and our quantizer vs torch's cast of the same scaled values.

    `values` are hand-picked: a carry (124.3 rounds up into the next binade), ties (17, 200,
    1.0625: torch rounds to even) and plain values, with 448 so that their block's scale is 1;
    `sample` is 4096 N(0, 3^2) values.
    """
    generator = torch.Generator().manual_seed(0)
    values = torch.tensor(CAST_VALUES + (FP8_MAX,) + (0.0,) * (15 - len(CAST_VALUES)))
    found = {}
    for name, x in (("values", values), ("sample", torch.randn(4096, generator=generator) * 3)):
        x = x.to(device or default_device())
        torch_cast, triton_cast = x.to(FP8).float().cpu(), plain_cast_e4m3(x).float().cpu()
        rows = x.view(-1, 1, 16)  # one head of dim 16; a scale per 16 rows
        cu = cumulative([rows.shape[0]], x.device)
        ours, torchs = quantize_fp8_blockwise(rows, cu), quantize_reference(rows, cu)
        found[name] = {
            "x": x.cpu(),
            "torch": torch_cast,
            "triton": triton_cast,
            "quantizer": ours.data.float().cpu().flatten(),
            "triton_differs": float((triton_cast != torch_cast).float().mean()),
            "quantizer_matches": bool(
                torch.equal(ours.data.float(), torchs.data.float()) and torch.equal(ours.scale, torchs.scale)
            ),
        }
    return found


CAST_VALUES = (124.3, -124.3, 17.0, 200.0, 1.0625, 0.3, 3.0)


# -- appendix: sequence-parallel sizing (a lesson, on our own all-gather) ----------------------------

SEQPAR_SEQLENS = (20, 13, 27, 9)  # 69 real tokens; aligned to 16 rows: 96 rows, 48 per rank


def seqpar_study(device=None, world_size: int = 2) -> SeqParStudy:
    """One layer of the tiny LM run sequence-parallel on `world_size` processes with our own
    all-gather (`workbench.seqpar`), sized from padded boundaries, from real ones (our check),
    and from real ones unchecked (what torch.distributed itself says)."""
    model = TinyLM(LMConfig(seed=1))
    batch = SyntheticTask(seed=2).batch(SEQPAR_SEQLENS, align=ALIGN)
    with torch.no_grad():
        x = model.embed(batch.tokens)
    return run_sequence_parallel(
        model.blocks[0], x, batch.cu_seqlens, batch.cu_seqlens_padded, world_size=world_size, device=device
    )


# -- appendix: RoPE positions: padded layout vs real boundaries --------------------------------------------

ROPE_CASE = Case(seqlens_q=(24, 40, 17, 31), align=16, heads=2, head_dim=32, dtype="bfloat16", causal=True, seed=5)


@dataclass(frozen=True)
class RopeSequence:
    index: int
    length: int
    offset: int  # real boundaries: position of the sequence's first real token (0 is right)
    kind: str  # "exact", "shifted" (a constant offset) or "restarted" (a jump inside the sequence)
    check: ErrorCheck  # REAL-row error of attention with real-boundary positions


@dataclass(frozen=True)
class RopeStudy:
    case: Case
    from_padded: torch.Tensor  # positions of every row, Megatron-Core MLA style
    from_real: torch.Tensor  # positions with the real boundaries taken as the layout
    consistent: bool  # from_padded gives every sequence's real tokens 0..len-1
    sequences: tuple[RopeSequence, ...]
    check: ErrorCheck  # all REAL rows


def rope_study(case: Case = ROPE_CASE, device=None) -> RopeStudy:
    """Attention after RoPE with positions from the padded layout (the oracle's choice) vs from
    real boundaries applied to the same padded layout, per sequence against the fp64 oracle.

    The oracle and PyTorch's baseline rotate with padded-layout positions (in float64 and in
    the case's dtype); the candidate is the same computation in the case's dtype with the
    real-boundary positions. RoPE scores depend on relative positions only, so a constant
    offset within a sequence costs nothing beyond rounding; a restart inside one does.
    """
    batch = pack(case, device, requires_grad=False)
    rows = batch.q.shape[0]
    from_padded = rope_positions(batch.cu_seqlens_q.cpu(), batch.cu_seqlens_q_padded.cpu(), rows)
    from_real = rope_positions(batch.cu_seqlens_q.cpu(), None, rows)

    def attention(positions, dtype):
        q, k = (apply_rope(x.to(dtype), positions) for x in (batch.q, batch.k))
        return reference_attention(q, k, batch.v.to(dtype), *batch.args()[3:], **batch.kwargs(), compute_dtype=dtype).cpu()

    oracle, baseline = attention(from_padded, torch.float64), attention(from_padded, case.torch_dtype)
    candidate = attention(from_real, case.torch_dtype)
    starts, bounds = batch.cu_seqlens_q_padded.tolist(), batch.cu_seqlens_q.tolist()
    sequences, consistent = [], True
    for i, (start, begin, end) in enumerate(zip(starts, bounds, bounds[1:])):
        real = slice(start, start + end - begin)
        consistent &= torch.equal(from_padded[real], torch.arange(end - begin))
        got = from_real[real]
        kind = (
            "exact"
            if torch.equal(got, from_padded[real])
            else "shifted"
            if torch.equal(got - got[0], torch.arange(end - begin))
            else "restarted"
        )
        check = error_check("out", candidate[real], oracle[real], baseline[real], case.torch_dtype)
        sequences.append(RopeSequence(i, end - begin, int(got[0]), kind, check))
    real = batch.regions_q == Region.REAL
    return RopeStudy(
        case,
        from_padded,
        from_real,
        consistent,
        tuple(sequences),
        error_check("out", candidate[real], oracle[real], baseline[real], case.torch_dtype),
    )


# -- the study as a whole ------------------------------------------------------------------------------

RECIPE_SEQLENS = (5, 9, 3, 12)
WORKAROUND_FRACTION = 0.2  # the padding share of the kernel-level workaround cases
CASES = (
    TE_DOCSTRING,
    padding_case(WORKAROUND_FRACTION, causal=False),
    padding_case(WORKAROUND_FRACTION, causal=True),
    FP8_CASE,
    ROPE_CASE,
)


@dataclass
class TeResults(Results):
    """Everything `reproduce()` measured."""

    layout: ProbeRecord  # our kernel on TE's docstring layout
    recipe: RecipeResult  # TE's THD padding test applied to our kernel
    workaround_kernel: dict[bool, ErrorCheck]  # causal -> our kernel called the VERL way
    contract: dict[bool, ErrorCheck]  # causal -> the replica called the right way
    workaround_sweep: dict[bool, list[tuple[float, ErrorCheck]]]
    training: dict[str, tuple[TrainingRun, GradientHealth]]
    seeds: tuple[SeedRun, ...]
    health: dict[str, GradientHealth]  # the explorer's opening frame
    auto_detect: dict[str, tuple[bool, bool]]
    fp8: dict[tuple[str, str], ErrorCheck]
    fp8_zero_scales_equal: bool  # zero padding: scales over all rows == scales over real rows
    cast: dict
    seqpar: SeqParStudy
    rope: RopeStudy


def fp8_zero_padding_scales_equal(case: Case = FP8_CASE, device=None) -> bool:
    """With padding rows zeroed, block scales over every row equal those over real rows (and so do the codes)."""
    batch = pack(case.with_(fill=Fill.ZEROS), device, requires_grad=False)
    real, every = _quantized(batch, "real"), _quantized(batch, "all")
    return all(torch.equal(a.scale, b.scale) and torch.equal(a.data.float(), b.data.float()) for a, b in zip(real, every))


def reproduce(device=None) -> TeResults:
    """Every part of the study. The fixed and FP8 Triton kernels run on one small case each;
    sweeps and training use `dense_attention` (the same contract, tested against the oracle)."""
    with warnings.catch_warnings():
        # numpy inside the interpreter, on the NaN-poisoned blocks the FP8 study poisons on purpose
        warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
        fp8 = fp8_study(device=device)
    return TeResults(
        layout=layout_contract(device=device),
        recipe=te_recipe(varlen_attention, RECIPE_SEQLENS, device=device),
        workaround_kernel={causal: workaround_error(CASES[1 + causal], varlen_attention, device) for causal in (False, True)},
        contract={causal: contract_error(CASES[1 + causal]) for causal in (False, True)},
        workaround_sweep=workaround_sweep(dense_attention),
        training=train_three_ways(),
        seeds=bidirectional_seeds(),
        health=health_runs(HEALTH_FRACTIONS[0]),
        auto_detect=auto_detect(),
        fp8=fp8,
        fp8_zero_scales_equal=fp8_zero_padding_scales_equal(device=device),
        cast=cast_study(device),
        seqpar=seqpar_study(device),
        rope=rope_study(device=device),
    )


# -- tables -----------------------------------------------------------------------------------------


def _ratio(check: ErrorCheck) -> str:
    return f"{check.error:.3g} ({check.ratio:.3g} x PyTorch)" if check.error == check.error else "NaN"


def _within(check: ErrorCheck) -> str:
    return "yes" if check.within else "NO"


def workaround_table(results: TeResults):
    """REAL-row error: VERL's call vs the right call, at `WORKAROUND_FRACTION` padding."""
    sweep = {causal: dict(points)[WORKAROUND_FRACTION] for causal, points in results.workaround_sweep.items()}
    rows = [
        (
            "causal" if causal else "non-causal",
            _ratio(sweep[causal]),
            _within(sweep[causal]),
            _ratio(results.contract[causal]),
            _within(results.contract[causal]),
        )
        for causal in (True, False)
    ]
    return table(
        ("attention", "cu_seqlens = cu_seqlens_padded", "within", "real cu_seqlens + cu_seqlens_padded", "within"),
        rows,
        title=f"REAL-row error against the fp64 oracle, {WORKAROUND_FRACTION:.0%} padding at each sequence's end (replica)",
    )


def auto_detect_table(results: TeResults):
    return table(
        ("layout", "TE 2.12-2.17.1", "TE main (v2.18)"),
        [(name, str(old), str(new)) for name, (old, new) in results.auto_detect.items()],
        title="pad_between_seqs when left None (source reading, transcribed)",
    )


def training_table(results: TeResults):
    rows = [
        (
            name,
            f"{run.losses[0]:.3f}",
            f"{run.final_loss:.3f}",
            f"{run.eval_loss:.3f}",
        )
        for name, (run, _) in results.training.items()
    ]
    return table(("causal toy, run", "first loss", "final loss", "held-out loss"), rows)


def seeds_table(results: TeResults):
    rows = [(str(s.seed), f"{s.train_gap:+.3f}", f"{s.heldout_gap:+.3f}") for s in results.seeds]
    return table(
        ("seed", "training loss, workaround - correct", "held-out loss, workaround - correct"),
        rows,
        title=f"bidirectional toy, {BIDIRECTIONAL_STEPS} steps, padding to multiples of {ALIGN} rows",
    )


def fp8_table(results: TeResults):
    rows = [(fill, scales, f"{c.error:.3g}", f"{c.bound:.3g}", _within(c)) for (fill, scales), c in results.fp8.items()]
    return table(("padding holds", "scales from", "REAL-row error", "FP8 bound", "within"), rows)


def cast_table(results: TeResults):
    found = results.cast["values"]
    n = len(CAST_VALUES)
    rows = [
        (f"{x:g}", f"{t:g}", f"{tr:g}", f"{q:g}")
        for x, t, tr, q in zip(*(found[k][:n].tolist() for k in ("x", "torch", "triton", "quantizer")))
    ]
    return table(("fp32 value", "torch .to(e4m3)", "Triton x.to(tl.float8e4nv)", "our quantizer"), rows)


def seqpar_table(results: TeResults):
    rows = [
        (
            f"{BOUNDARIES[r.size_from]}[-1]",
            "ours" if r.validate else "none",
            str(r.rows),
            "-" if r.out is None else str(tuple(r.out.shape)),
            str(r.exact),
            (r.error or "").split(":")[0],
        )
        for r in results.seqpar.runs
    ]
    return table(("all-gather sized from", "size check", "rows", "output", "== one process", "error"), rows)


def rope_table(results: TeResults):
    rows = [
        (str(s.index), str(s.length), str(s.offset), s.kind, _ratio(s.check), _within(s.check)) for s in results.rope.sequences
    ]
    return table(("sequence", "real tokens", "first position", "real-boundary positions", "attention error", "within"), rows)


# -- plots ------------------------------------------------------------------------------------------------


def plot_workaround_sweep(results: TeResults):
    """REAL-row error of the workaround in units of the bound, vs padding fraction, causal or not."""
    fig, axes = figure(1, 1, width=6.0, height=3.0)
    ax = axes[0, 0]
    with matplotlib.rc_context(STYLE):
        for k, causal in enumerate((False, True)):
            points = results.workaround_sweep[causal]
            ax.plot(
                [f for f, _ in points],
                [c.error / c.bound for _, c in points],
                "o-",
                color=SERIES[k],
                label="causal" if causal else "non-causal",
            )
        ax.axhline(1.0, color=INK, ls="--", lw=1, label="bound")
        ax.set_yscale("log")
        ax.set_xlabel("padding fraction of every sequence")
        ax.set_ylabel("REAL-row error / bound")
        ax.set_title("cu_seqlens = cu_seqlens_padded, zero padding", loc="left")
        ax.legend()
    return fig


def plot_seeds(results: TeResults):
    """Per-seed gaps (workaround - correct) of the bidirectional toy: training and held-out loss."""
    fig, axes = figure(1, 1, width=6.0, height=2.8)
    ax = axes[0, 0]
    with matplotlib.rc_context(STYLE):
        for k, attr in enumerate(("train_gap", "heldout_gap")):
            gaps = [getattr(s, attr) for s in results.seeds]
            ax.plot(gaps, [k] * len(gaps), "o", color=SERIES[k], ms=7, alpha=0.8)
            ax.plot([sum(gaps) / len(gaps)], [k], "|", color=INK, ms=18, mew=2)
        ax.axvline(0.0, color=INK, lw=1, ls="--")
        ax.set_yticks([0, 1], ["training loss", "held-out loss"])
        ax.set_ylim(-0.6, 1.6)
        ax.set_xlabel(f"workaround - correct ({len(results.seeds)} seeds; bar: mean)")
        ax.set_title("bidirectional toy: the gap per seed", loc="left")
    return fig


def plot_fp8(results: TeResults):
    """REAL-row error of the FP8 forward per padding fill, scales from real rows vs all rows."""
    fig, axes = figure(1, 1, width=6.5, height=3.0)
    ax = axes[0, 0]
    fills = list(dict.fromkeys(fill for fill, _ in results.fp8))
    with matplotlib.rc_context(STYLE):
        for k, scales in enumerate(("real", "all")):
            for i, fill in enumerate(fills):
                check = results.fp8[(fill, scales)]
                x = i + (k - 0.5) * 0.38
                if math.isfinite(check.error):
                    ax.bar(x, check.error, 0.36, color=SERIES[k], label=f"scales from {scales} rows" if i == 0 else None)
                else:
                    ax.bar(x, 10.0, 0.36, color=REGION_COLORS[Region.TAIL], alpha=0.35, hatch="xx", label="NaN" if k else None)
                    ax.text(x, 11.0, "NaN", ha="center", va="bottom", fontsize=8)
            ax.hlines(
                [results.fp8[(f, "real")].bound for f in fills],
                [i - 0.45 for i in range(len(fills))],
                [i + 0.45 for i in range(len(fills))],
                colors=INK,
                linestyles="--",
                lw=1,
            )
        ax.set_yscale("log")
        ax.set_ylim(top=40.0)
        ax.set_xticks(range(len(fills)), fills)
        ax.set_xlabel("what the padding rows hold")
        ax.set_ylabel("max REAL-row error vs fp64")
        ax.set_title("blockwise FP8 forward (dashed: FP8 bound)", loc="left")
        ax.legend(loc="upper left")
    return fig


def plot_rope(results: TeResults):
    """Positions per row (padded layout vs real boundaries) and the attention error per sequence."""
    study = results.rope
    batch = pack(study.case, "cpu", requires_grad=False)
    fig, axes = figure(1, 2, width=10.5, height=3.0)
    left, right = axes[0]
    with matplotlib.rc_context(STYLE):
        real = torch.nonzero(batch.regions_q == Region.REAL).flatten()  # padding rows carry no token to rotate
        left.plot(real, study.from_padded[real], ".", ms=3, color=SERIES[0], label="from cu_seqlens_padded (Megatron-Core MLA)")
        left.plot(real, study.from_real[real], ".", ms=3, color=SERIES[1], label="from cu_seqlens on the padded layout")
        left.set_xlabel("row of a real token (gaps: padding)")
        left.set_ylabel("RoPE position")
        left.legend()
        ratios = [s.check.error / s.check.bound for s in study.sequences]
        right.bar(range(len(ratios)), ratios, color=[SERIES[2] if s.check.within else SERIES[1] for s in study.sequences])
        for s, r in zip(study.sequences, ratios):
            right.text(s.index, r, s.kind, ha="center", va="bottom", fontsize=8)
        right.axhline(1.0, color=INK, ls="--", lw=1)
        right.set_yscale("log")
        right.set_xticks(range(len(ratios)), [f"seq {s.index}" for s in study.sequences])
        right.set_ylabel("REAL-row error / bound")
        right.set_title("attention with real-boundary positions", loc="left")
    return fig


def plot_contract(case: Case = TE_DOCSTRING):
    """Which keys each query sees: with real cu_seqlens (left) and with cu_seqlens = cu_seqlens_padded (right, red: padding keys)."""
    batch = pack(case.with_(causal=False), "cpu", requires_grad=False)
    sees_all = pack(case.with_(seqlens_q=case.padded_q, causal=False), "cpu", requires_grad=False)
    right_call = attention_mask(batch).int()
    verl = attention_mask(sees_all).int() + (attention_mask(sees_all) & (batch.regions_k != Region.REAL)[None, :]).int()
    fig, axes = figure(1, 2, width=8.0, height=3.4)
    colors = matplotlib.colors.ListedColormap(["white", "#1f3b63", REGION_COLORS[Region.TAIL]])
    with matplotlib.rc_context(STYLE):
        for ax, mask, title in (
            (axes[0, 0], right_call, "real cu_seqlens + cu_seqlens_padded"),
            (axes[0, 1], verl, "cu_seqlens = cu_seqlens_padded (VERL)"),
        ):
            ax.grid(False)
            ax.imshow(mask.numpy(), cmap=colors, vmin=0, vmax=2, interpolation="nearest")
            ax.set_xlabel("key row")
            ax.set_ylabel("query row")
            ax.set_title(title, loc="left", fontsize=9)
        fig.suptitle("TE's docstring layout [a a a 1 b b 2 2 c c c c 3], no causal mask", x=0.01, ha="left", fontsize=10)
    return fig


# -- claims --------------------------------------------------------------------------------------------------

claims = Claims()


@claims(
    "TE's pad_between_seqs auto-detect, 2.12 to 2.17.1: a batch padded only at its end, or VERL's equal boundaries, "
    "reads as no padding between sequences",
    evidence=source_at(TE_V2_12),
)
def _auto_detect_old(r: TeResults):
    found = {name: old for name, (old, _) in r.auto_detect.items()}
    names = list(found)
    holds = found[names[0]] and not found[names[1]] and not found[names[2]] and not found[names[3]]
    return holds, "; ".join(f"{name}: {value}" for name, value in found.items())


@claims(
    "TE main (PR #2898, v2.18): any padded tensor that is not the very object passed as cu_seqlens counts as padding "
    "between sequences, VERL's equal values included",
    evidence=source_at(TE_MAIN),
)
def _auto_detect_new(r: TeResults):
    found = {name: new for name, (_, new) in r.auto_detect.items()}
    names = list(found)
    holds = found[names[0]] and found[names[1]] and found[names[2]] and not found[names[3]]
    return holds, "; ".join(f"{name}: {value}" for name, value in found.items())


@claims(
    "VERL's workaround, non-causal attention: REAL-row error above the bound at every padding fraction > 0, growing with it",
    evidence=REPLICA,
)
def _workaround_noncausal(r: TeResults):
    points = r.workaround_sweep[False]
    padded = [c for f, c in points if f > 0]
    errors = [c.error for c in padded]
    kernel, right = r.workaround_kernel[False], r.contract[False]
    holds = (
        points[0][1].within
        and not any(c.within for c in padded)
        and errors == sorted(errors)
        and not kernel.within
        and right.within
    )
    return holds, "errors " + ", ".join(f"{f:.2f}: {c.error:.3f}" for f, c in points) + (
        f"; our kernel at {WORKAROUND_FRACTION}: {kernel.error:.3f}; called right: {right.error:.2g}"
    )


@claims(
    "VERL's workaround, causal attention with padding at each sequence's end: REAL rows within the bound at every fraction",
    evidence=REPLICA,
)
def _workaround_causal(r: TeResults):
    points = r.workaround_sweep[True]
    kernel = r.workaround_kernel[True]
    worst = max(c.ratio for _, c in points)
    return all(
        c.within for _, c in points
    ) and kernel.within, f"worst {worst:.2f} x PyTorch over {len(points)} fractions; our kernel {kernel.ratio:.2f} x"


@claims("causal toy trained with the workaround: loss identical to the correct run at every step", evidence=TOY)
def _training_causal(r: TeResults):
    correct, workaround = (r.training[name][0] for name in TRAINING_RUNS[:2])
    return workaround.losses == correct.losses, f"{len(correct.losses)} steps, final loss {correct.final_loss:.4f} both"


@claims(
    "bidirectional toy, padding to multiples of 16: the workaround's training loss ends higher in most seeds, "
    "but its held-out loss does not (the sign changes with the seed)",
    evidence=TOY,
)
def _training_bidirectional(r: TeResults):
    train_gaps = [s.train_gap for s in r.seeds]
    held_gaps = [s.heldout_gap for s in r.seeds]
    higher = sum(g > 0 for g in train_gaps)
    holds = higher > len(train_gaps) / 2 and any(g > 0 for g in held_gaps) and any(g < 0 for g in held_gaps)
    return holds, (
        f"{len(train_gaps)} seeds; training gap {min(train_gaps):+.3f} to {max(train_gaps):+.3f} (higher in {higher}); "
        f"held-out gap {min(held_gaps):+.3f} to {max(held_gaps):+.3f}"
    )


@claims(
    f"bidirectional toy, {HEALTH_FRACTIONS[0]:.0%} padding: the workaround's qkv gradient norms fall below half the correct run's "
    "(padding keys dilute attention)",
    evidence=TOY,
)
def _health(r: TeResults):
    ratio = qkv_norm_ratio(r.health)
    return ratio < 0.5, f"mean qkv gradient norm over the last 10 of {HEALTH_STEPS} steps, workaround / correct = {ratio:.2f}"


@claims(
    "padding only at the end through a backend that never writes the tail, in poisoned memory: NaN gradients at the first step; "
    "zeroing the tail rows of out and dq/dk/dv restores the correct run",
    evidence=REPLICA,
)
def _tail_blind(r: TeResults):
    end, blind, zeroed = (r.training[name] for name in TRAINING_RUNS[2:])
    chain = blind[1].causal_chain()
    holds = (
        math.isfinite(blind[0].losses[0])
        and all(math.isnan(x) for x in blind[0].losses[1:])
        and chain.origin is not None
        and chain.origin.step == 0
        and max(abs(a - b) for a, b in zip(zeroed[0].losses, end[0].losses)) < 1e-5
    )
    return holds, (
        f"tail-blind: first non-finite gradient at step {chain.origin.step if chain else '-'} in {chain.first_parameter}; "
        f"tail zeroed: final loss {zeroed[0].final_loss:.4f}, correct backend {end[0].final_loss:.4f} (every step within 1e-5)"
    )


@claims("FP8 scales from REAL rows: REAL-row error within the FP8 bound whatever the padding holds", evidence=REPLICA)
def _fp8_real(r: TeResults):
    checks = {fill: c for (fill, scales), c in r.fp8.items() if scales == "real"}
    return all(c.within for c in checks.values()), ", ".join(
        f"{fill}: {c.error:.3f} <= {c.bound:.3f}" for fill, c in checks.items()
    )


@claims("FP8 scales from all rows: a huge padding row rounds real tokens to 0, a NaN row makes them NaN", evidence=REPLICA)
def _fp8_all(r: TeResults):
    huge, nan = r.fp8[("huge", "all")], r.fp8[("nan", "all")]
    return huge.ratio > 10 * huge.factor and math.isnan(
        nan.error
    ), f"huge: error {huge.error:.3g} ({huge.error / huge.bound:.0f} x bound); NaN: error {nan.error}"


@claims(
    "FP8 scales from all rows with the padding rows zeroed: scales and codes identical to scales from REAL rows", evidence=REPLICA
)
def _fp8_zeros(r: TeResults):
    zero = r.fp8[("zeros", "all")]
    return (
        r.fp8_zero_scales_equal and zero.within,
        f"scales and codes equal: {r.fp8_zero_scales_equal}; error {zero.error:.3f} <= {zero.bound:.3f}",
    )


@claims(
    "our kernel on TE's docstring layout: padded output shape, padding rows exactly 0 in out/dq/dk/dv, REAL rows within bound",
    evidence=OURS,
)
def _layout(r: TeResults):
    record = r.layout
    shape = tuple(record.tensors["out"].shape)
    holds = shape == (13, 2, 16) and record.padding_exactly_zero and record.real_finite and record.real_within_bound
    worst = max(c.ratio for c in record.errors.values())
    return (
        holds,
        f"out {shape} for cu_seqlens_q_padded[-1] = 13; padding zero {record.padding_exactly_zero} (NaN inputs, poisoned memory); worst {worst:.2f} x PyTorch",
    )


@claims(
    "TE's own THD padding test (0-3 padding rows per sequence, unpadded reference) passes on our kernel, TE's fp16 tolerance and our bound",
    evidence=OURS,
)
def _recipe(r: TeResults):
    result = r.recipe
    return (
        result.te_passes and result.within_bound and result.padding_max_abs == 0.0,
        f"pads {result.pads}; TE margin max {max(result.te_error.values()):.2g} <= {result.te_tolerance:g}; padding max |x| {result.padding_max_abs:g}",
    )


@claims(
    "RoPE positions from cu_seqlens_padded (Megatron-Core MLA's choice): every sequence's real tokens get 0..len-1",
    evidence=REPLICA,
)
def _rope_padded(r: TeResults):
    study = r.rope
    return study.consistent, f"{len(study.sequences)} sequences, {int(study.from_padded.numel())} rows"


@claims(
    "RoPE positions from cu_seqlens on a padded layout: a restart inside a sequence corrupts attention; a constant shift does not",
    evidence=REPLICA,
)
def _rope_real(r: TeResults):
    kinds = {kind: [s for s in r.rope.sequences if s.kind == kind] for kind in ("restarted", "shifted")}
    holds = (
        bool(kinds["restarted"])
        and not any(s.check.within for s in kinds["restarted"])
        and all(s.check.within for s in kinds["shifted"])
    )
    return holds, "; ".join(
        f"{kind}: " + ", ".join(f"seq {s.index} {s.check.ratio:.3g} x" for s in seqs) for kind, seqs in kinds.items()
    )


@claims(
    "sizing lesson, our all-gather on 2 processes: sized from cu_seqlens_padded[-1] it reproduces one process exactly",
    evidence=OURS,
)
def _seqpar_padded(r: TeResults):
    run = r.seqpar.run("padded")
    return run.exact, f"{r.seqpar.backend}: {run.rows} rows gathered, output torch.equal to one process: {run.exact}"


@claims(
    "sizing lesson: sized from cu_seqlens[-1] the buffer is too small; our check names the boundary and the fix", evidence=OURS
)
def _seqpar_real(r: TeResults):
    study = r.seqpar
    checked, raw = study.run("real"), study.run("real", validate=False)
    clear = all(
        e and e.startswith("SizingError") and "cu_seqlens[-1]" in e and "cu_seqlens_padded[-1]" in e for e in checked.errors
    )
    return clear and raw.out is None, (
        f"{checked.rows} real rows vs {study.layout_rows} in the layout; unchecked, torch says: {raw.error.split(':', 1)[0] if raw.error else 'nothing'}"
    )


@claims(
    "fp32 -> e4m3: Triton's own cast differs from torch's only under the interpreter; our quantizer's explicit rounding matches torch",
    evidence=OURS,
)
def _cast(r: TeResults):
    values, sample = r.cast["values"], r.cast["sample"]
    differs = values["triton_differs"] > 0 and sample["triton_differs"] > 0
    holds = differs == INTERPRETED and values["quantizer_matches"] and sample["quantizer_matches"]
    where = "interpreted" if INTERPRETED else "native"
    return holds, (
        f"{where}: 124.3 -> {values['triton'][0]:g} (torch {values['torch'][0]:g}); {sample['triton_differs']:.1%} of N(0, 9) values differ; "
        f"quantizer == torch: {values['quantizer_matches'] and sample['quantizer_matches']}"
    )
