"""Tiny training runs with and without the bug: the three ways of handling the tail, bidirectional seeds, gradient health."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from varlen_workbench.postmortems.te_thd_2892.cases import (
    ALIGN,
    BIDIRECTIONAL_SEEDS,
    BIDIRECTIONAL_STEPS,
    EVAL_SEQLENS,
    HEALTH_FRACTIONS,
    HEALTH_PARAMS,
    HEALTH_STEPS,
    MASK_RATE,
    TRAIN_SEQS,
    TRAIN_STEPS,
    TRAINING_RUNS,
)
from varlen_workbench.workbench.instruments.health import GradientHealth
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.instruments.tinylm import (
    IGNORE,
    PAD_TOKEN,
    LMConfig,
    PackedTokens,
    SyntheticTask,
    TrainingRun,
    dense_attention,
    mask_tokens,
    train,
)
from varlen_workbench.workbench.layout import cumulative


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


def _width(dim: int | None) -> dict[str, int]:
    return {} if dim is None else {"dim": dim}


def causal_batches(steps: int, seed: int, **layout) -> tuple[list[PackedTokens], PackedTokens]:
    """The causal toy's training batches (the same sequences in every run) and its held-out batch,
    both packed in `layout` (`SyntheticTask.batch`'s align= or tail_align=)."""
    task = SyntheticTask(seed=seed)
    batches = [task.batch(lengths, **layout) for lengths in _training_seqlens(steps, seed)]
    return batches, SyntheticTask(seed=seed + 1).batch(EVAL_SEQLENS, **layout)


def boundary_runs(
    attention=dense_attention, steps: int = TRAIN_STEPS, seed: int = 0, *, dim: int | None = None
) -> dict[str, tuple[TrainingRun, GradientHealth]]:
    """The tiny causal LM trained through `attention` on packed batches whose sequences are each
    padded to a multiple of `ALIGN` (FP8 alignment), with the boundaries kept apart ("correct":
    real cu_seqlens, padded cu_seqlens_padded) and made identical ("workaround": cu_seqlens =
    cu_seqlens_padded, VERL's). Same model seed, data and optimizer: the runs differ only in the
    boundaries attention is given, and a run through another `attention` only in the attention.
    `dim`: the model's width (None: LMConfig's; its 2 heads each get dim / 2 channels)."""
    batches, held_out = causal_batches(steps, seed, align=ALIGN)
    common = dict(config=LMConfig(seed=seed, **_width(dim)), attention=attention, monitor_factory=GradientHealth)
    correct, workaround = TRAINING_RUNS[:2]
    return {
        correct: train(correct, batches, held_out, **common),
        workaround: train(workaround, batches, held_out, workaround=True, **common),
    }


def train_three_ways(steps: int = TRAIN_STEPS, seed: int = 0) -> dict[str, tuple[TrainingRun, GradientHealth]]:
    """The tiny causal LM trained on the same packed sequences with each layout / metadata choice.

    * correct: every sequence padded to a multiple of `ALIGN`, masked by real boundaries;
    * workaround: same layout, `cu_seqlens = cu_seqlens_padded` (VERL);
    * padding at the end: sequences back to back, only `cu_seqlens_padded[-1]` extended;
    * the same through `tail_blind` under `poisoned_memory()` (unwritten rows hold NaN), and
      through `zero_tail(tail_blind(...))`, the workaround.

    Attention is `dense_attention` (the contract as one masked matmul, tested against the fp64
    oracle). Every run is evaluated on the same held-out sequences, packed in its own layout
    (a tail-only backend cannot read padding between sequences).
    """
    runs = boundary_runs(dense_attention, steps, seed)
    batches, held_out = causal_batches(steps, seed, tail_align=ALIGN)
    common = dict(config=LMConfig(seed=seed), monitor_factory=GradientHealth)
    _, _, end, blind, zeroed = TRAINING_RUNS
    runs[end] = train(end, batches, held_out, **common)
    with poisoned_memory():
        runs[blind] = train(blind, batches, held_out, attention=tail_blind(dense_attention), **common)
        runs[zeroed] = train(zeroed, batches, held_out, attention=zero_tail(tail_blind(dense_attention)), **common)
    return runs


def on_device(attention, device, dtype: torch.dtype):
    """`attention` (the contract's call) run on `device` in `dtype`, the rest of the model where it is:
    q, k, v and the boundaries go over, the output comes back in q's dtype and device (both moves
    differentiable), so that a model trained on the CPU can attend through a GPU library."""
    device = torch.device(device)

    def moved(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        there = [x.to(device, dtype).contiguous() for x in (q, k, v)]
        bounds = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
        out = attention(*there, cu_seqlens_q.to(device), cu_seqlens_k.to(device), max_seqlen_q, max_seqlen_k, **bounds)
        return out.to(q.device, q.dtype)

    return moved


def global_grad_norms(monitor: GradientHealth) -> list[float]:
    """The norm of all parameters' gradients together, step by step (what trainers log as grad_norm)."""
    names = list(monitor.names.values())
    steps = len(monitor.norms(names[0]))
    return [math.sqrt(sum(monitor.norms(name)[i] ** 2 for name in names)) for i in range(steps)]


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
    steps: int = BIDIRECTIONAL_STEPS,
    seed: int = 0,
    *,
    fraction: float | None = None,
    monitor: bool = False,
    attention=dense_attention,
    dim: int | None = None,
) -> dict[str, tuple[TrainingRun, GradientHealth | None]]:
    """A bidirectional (non-causal) tiny model trained on masked tokens, correct vs workaround.

    Every real token is hidden with probability `MASK_RATE` (the mask token is one past the
    task's vocabulary) and predicted from the rest of its sequence. Layout: each sequence
    padded to a multiple of `ALIGN` (fraction None) or by `fraction` of its rows. Without a
    causal mask, the workaround shows a sequence's padding keys to all of its real queries.
    `attention` and `dim` as in `boundary_runs`.
    """
    seqlens = _training_seqlens(steps, seed)
    mask_token = SyntheticTask().vocab
    config = LMConfig(vocab=mask_token + 1, seed=seed, causal=False, **_width(dim))

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
        name: train(
            name,
            batches(),
            eval_batch,
            config=config,
            attention=attention,
            workaround=name == "workaround",
            monitor_factory=factory,
        )
        for name in ("correct", "workaround")
    }


def bidirectional_seeds(seeds=BIDIRECTIONAL_SEEDS, steps: int = BIDIRECTIONAL_STEPS) -> tuple[SeedRun, ...]:
    """The bidirectional toy, correct vs workaround, once per seed (weights, data, masks)."""
    runs = []
    for seed in seeds:
        pair = train_bidirectional(steps, seed)
        runs.append(SeedRun(seed, pair["correct"][0], pair["workaround"][0]))
    return tuple(runs)


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
