"""The audit's `context-parallel` check: the padding contract on every rank of a context-parallel run.

A context-parallel (CP) attention holds a zig-zag shard of every sequence on each rank
(`varlen_workbench.workbench.instruments.context_parallel`). The check runs one on `cp_size` spawned processes (gloo and the
Triton interpreter on CPU, NCCL on GPUs) under NaN-poisoned memory, forward and backward, and
compares each rank's shard of out, dq, dk, dv with the same shard of the single-device fp64
oracle (`varlen_workbench.workbench.reference`): REAL rows within FlashAttention's bound (`varlen_workbench.workbench.bounds`,
against PyTorch in the case's dtype), GAP and TAIL rows exactly 0, the rows the 2 x cp_size
padding rule adds included. Layouts are the audit's (`Case`), fixed ones and fuzzed ones
(`varlen_workbench.workbench.strategies`), laid out for CP by `cp_case`.

    result = context_parallel_check()                  # our implementation, 2 ranks: a CheckResult
    study = padding_rule_study()                        # the 2 x cp_size rule kept and broken

The check is registered with the audit's (`varlen_workbench.workbench.audit.checks.CHECKS`, which imports this
module when the check runs): `varlen-workbench audit
mypkg.attn:my_cp_attention` runs it on a function with `context_parallel_attention`'s call (the
`context-parallel` adapter recognises one by its cu_seqlens, cu_seqlens_padded and group
parameters), and it is n/a for any single-process attention.

`python -m varlen_workbench.workbench.audit.context_parallel --cp-size 2 --record FILE` runs the check and the
study and writes a record (`varlen_workbench.workbench.records`). It spawns its ranks itself (not under torchrun):
NCCL with one GPU each where there are that many GPUs (NVLink multicast off unless
NCCL_NVLS_ENABLE says otherwise), gloo on a CPU-only machine; on two H200s, `GPU_COMMAND`:

    python -m varlen_workbench.workbench.audit.context_parallel --cp-size 2 --record data/gpu/context-parallel-h200x2.json
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from varlen_workbench.workbench.audit.results import CONTEXT_PARALLEL, CheckResult, Finding, Verdict
from varlen_workbench.workbench.bounds import error_check
from varlen_workbench.workbench.instruments.context_parallel import (
    LayoutError,
    RankResult,
    check_cp_layout,
    context_parallel_attention,
    cp_backend,
    run_context_parallel,
    shard_thd,
)
from varlen_workbench.workbench.layout import Case, Fill, PackedBatch, Region, pack
from varlen_workbench.workbench.probes import grad_output
from varlen_workbench.workbench.records import write_record
from varlen_workbench.workbench.reference import reference_attention
from varlen_workbench.workbench.strategies import LayoutSpace

NAME = CONTEXT_PARALLEL
# The run on two GPUs over NCCL, recorded under data/gpu/ (varlen_workbench.workbench.records) by:
GPU_RECORD = "context-parallel-h200x2.json"
GPU_COMMAND = f"python -m varlen_workbench.workbench.audit.context_parallel --cp-size 2 --record data/gpu/{GPU_RECORD}"
TENSORS = ("out", "dq", "dk", "dv")
# What CP self-attention cannot take from a fuzzed layout: q and k share one layout, no windows.
FUZZ_SPACE = LayoutSpace(max_batch=3, longest=10, without=frozenset({"unequal", "window"}))


def cp_case(case: Case, cp_size: int) -> Case:
    """`case` as a context-parallel layout: self-attention (k keeps q's lengths), each padded
    length rounded up to a multiple of 2 x cp_size, the same TAIL rows for q and k, no window."""
    multiple = 2 * cp_size
    padded = tuple(-(-n // multiple) * multiple for n in case.padded_lengths("q"))
    return case.with_(seqlens_k=None, padded_q=padded, padded_k=padded, align=None, tail_k=case.tail_q, window=(-1, -1))


def fixed_cases(cp_size: int, dtype: str = "float32", head_dim: int = 16) -> list[Case]:
    """GAP rows from the rule and from the layout, TAIL rows on the last rank, an empty
    sequence, GQA, causal and not; garbage and NaN padding."""
    cases = [
        Case((5, 3, 7), padded_q=(6, 4, 9), tail_q=3, fill=Fill.GARBAGE),
        Case((9, 0, 4), tail_q=2, heads=4, kv_heads=2, causal=True, fill=Fill.NAN, seed=1),
    ]
    return [cp_case(c.with_(dtype=dtype, head_dim=head_dim), cp_size) for c in cases]


def fuzzed_cases(count: int, cp_size: int, seed: int = 0) -> list[Case]:
    """`count` layouts from the audit's fuzzing space, laid out for CP."""
    rng = random.Random(seed)
    return [cp_case(FUZZ_SPACE.sample(rng), cp_size) for _ in range(count)]


@dataclass(frozen=True)
class Oracle:
    """Single-device results on the global layout: fp64 oracle, PyTorch in the case's dtype."""

    oracle: dict[str, torch.Tensor]
    baseline: dict[str, torch.Tensor]

    @classmethod
    def of(cls, batch: PackedBatch, d_out: torch.Tensor) -> Oracle:
        runs = []
        for dtype in (torch.float64, batch.q.dtype):
            leaves = [x.detach().clone().requires_grad_() for x in (batch.q, batch.k, batch.v)]
            out = reference_attention(*leaves, *batch.args()[3:], **batch.kwargs(), compute_dtype=dtype)
            out.backward(d_out.to(dtype))
            runs.append({"out": out.detach(), **{f"d{n}": x.grad for n, x in zip("qkv", leaves)}})
        return cls(*runs)


def rank_findings(
    batch: PackedBatch, oracle: Oracle, result: RankResult, cp_size: int, *, validate: bool = True
) -> list[Finding]:
    """What one rank's shard breaks: a raise, REAL rows off the bound, non-zero GAP or TAIL rows.
    (`validate=False`: a layout breaking the 2 x cp_size rule, judged on the rows the rank holds.)"""
    where = f"rank {result.rank} of {cp_size}"
    if result.tensors is None:
        return [Finding("raises-on-valid-layout", f"{where}: {result.error}")]
    cu, cu_padded = batch.cu_seqlens_q.cpu(), batch.cu_seqlens_q_padded.cpu()

    def local(x: torch.Tensor) -> torch.Tensor:
        return shard_thd(x.cpu(), cu, cu_padded, result.rank, cp_size, validate=validate)

    findings = []
    for name in TENSORS:
        value, regions = result.tensors[name], local(batch.regions(name))
        real = regions == Region.REAL
        oracle_rows, baseline_rows = local(oracle.oracle[name]), local(oracle.baseline[name])
        check = error_check(name, value[real], oracle_rows[real], baseline_rows[real], batch.q.dtype, **batch.reduction_lengths())
        if not check.within:
            findings.append(Finding("real-accuracy", f"{where}: {check}"))
        for region, label in ((Region.GAP, "gap-rows"), (Region.TAIL, "tail-rows")):
            rows = value[regions == region]
            if rows.numel() and not bool((rows == 0).all()):
                bad = int((~torch.isfinite(rows)).sum())
                what = f"{bad} non-finite values" if bad else f"max |x| {float(rows.abs().max()):.3g}"
                findings.append(Finding(label, f"{where}: {name}: {what} in {int((regions == region).sum())} {region.name} rows"))
    return findings


def judge(
    cases: Sequence[Case],
    *,
    cp_size: int = 2,
    impl: Callable = context_parallel_attention,
    on_cpu: bool = False,
    timeout_s: float = 300.0,
) -> tuple[str, list[tuple[Case, list[Finding]]]]:
    """Runs `impl` context-parallel on every case (one spawn) and judges every rank; returns the
    backend and each case's findings. `on_cpu`: gloo ranks through the Triton interpreter on any
    machine (`run_context_parallel`)."""
    batches = [pack(case, "cpu") for case in cases]
    pairs = [(batch, grad_output(batch)) for batch in batches]
    backend, results = run_context_parallel(pairs, cp_size=cp_size, impl=impl, on_cpu=on_cpu, timeout_s=timeout_s)
    judged = []
    for (batch, d_out), ranks in zip(pairs, results):
        oracle = Oracle.of(batch, d_out)
        judged.append((batch.case, [f for r in ranks for f in rank_findings(batch, oracle, r, cp_size)]))
    return backend, judged


def context_parallel_check(
    impl: Callable = context_parallel_attention,
    *,
    cp_size: int = 2,
    fuzzed: int = 2,
    seed: int = 0,
    dtype: str = "float32",
    head_dim: int = 16,
    on_cpu: bool = False,
    timeout_s: float = 300.0,
) -> CheckResult:
    """The `context-parallel` check: `impl` (context_parallel_attention's signature, importable by
    name) on the fixed cases and `fuzzed` fuzzed layouts, every rank judged; FAIL names the first
    failing case, rank and tensor. `on_cpu`: the ranks on gloo and the CPU even where GPUs are."""
    start = time.perf_counter()
    cases = fixed_cases(cp_size, dtype, head_dim) + fuzzed_cases(fuzzed, cp_size, seed)
    backend, judged = judge(cases, cp_size=cp_size, impl=impl, on_cpu=on_cpu, timeout_s=timeout_s)
    seconds = time.perf_counter() - start
    failing = [(case, findings) for case, findings in judged if findings]
    if failing:
        case, findings = failing[0]
        evidence = f"{backend}, {cp_size} ranks, {case.label()} ({case.fill.value} padding): " + "; ".join(map(str, findings[:3]))
        return CheckResult(NAME, Verdict.FAIL, evidence, (case, *[c for c in cases if c is not case]), seconds=seconds)
    evidence = (
        f"{backend}, {cp_size} ranks, {len(cases)} layouts ({fuzzed} fuzzed): on every rank REAL rows of "
        f"{', '.join(TENSORS)} within the bound, GAP and TAIL rows exactly 0 (poisoned memory)"
    )
    return CheckResult(NAME, Verdict.PASS, evidence, tuple(cases), seconds=seconds)


# -- te-thd-2892's rule: each sequence padded to a multiple of 2 x cp_size ----------------------


@dataclass(frozen=True)
class PaddingRuleStudy:
    """One layout kept to the 2 x cp_size rule, one breaking it, on our CP implementation."""

    cp_size: int
    backend: str
    kept: Case
    broken: Case
    kept_findings: tuple[Finding, ...]  # with the rule: none expected
    refusal: str  # what our check says about the broken layout
    unchecked_findings: tuple[Finding, ...]  # the broken layout run with the check off
    rows_on_no_rank: int  # real rows the floor-sized chunks leave on no rank

    @property
    def rule_needed(self) -> bool:
        return not self.kept_findings and bool(self.unchecked_findings)

    @property
    def lost_tensors(self) -> list[str]:
        """The tensors whose REAL rows the unchecked run got wrong on some rank (out, dq, dk, dv)."""
        return sorted({f.evidence.split(": ")[1] for f in self.unchecked_findings if f.check == "real-accuracy"})

    def summary(self) -> dict:
        return {
            "cp_size": self.cp_size,
            "backend": self.backend,
            "kept": self.kept.label(),
            "broken": self.broken.label(),
            "kept_findings": [str(f) for f in self.kept_findings],
            "refusal": self.refusal,
            "unchecked_findings": [str(f) for f in self.unchecked_findings],
            "rows_on_no_rank": self.rows_on_no_rank,
            "lost_tensors": self.lost_tensors,
        }


def padding_rule_study(cp_size: int = 2, *, on_cpu: bool = False, timeout_s: float = 300.0) -> PaddingRuleStudy:
    """The same sequences padded to a multiple of 2 x cp_size (TE's THD CP requirement) and
    packed without it: ours keeps the contract on the first; refuses the second with the fix;
    and, told not to check, drops the rows past the last whole chunk of every sequence.
    `on_cpu`: gloo ranks through the Triton interpreter on any machine (`run_context_parallel`)."""
    broken = Case((7, 5, 10), causal=True, head_dim=16, fill=Fill.NAN)
    kept = cp_case(broken, cp_size)
    batch = pack(broken, "cpu")
    try:
        check_cp_layout(batch.cu_seqlens_q_padded, cp_size)
        refusal = "accepted"
    except LayoutError as exc:
        refusal = str(exc)
    # One spawn for both: on a layout that keeps the rule, the unchecked path is the checked one.
    pairs = [(b, grad_output(b)) for b in (pack(kept, "cpu"), batch)]
    backend, results = run_context_parallel(pairs, cp_size=cp_size, validate=False, on_cpu=on_cpu, timeout_s=timeout_s)
    kept_findings, unchecked = (
        [f for r in ranks for f in rank_findings(b, Oracle.of(b, d_out), r, cp_size, validate=checked)]
        for (b, d_out), ranks, checked in zip(pairs, results, (True, False))
    )
    multiple = 2 * cp_size
    lost = sum(n - (n // multiple) * multiple for n in broken.seqlens_q)
    return PaddingRuleStudy(cp_size, backend, kept, broken, tuple(kept_findings), refusal, tuple(unchecked), lost)


def _argument_problem(args: argparse.Namespace) -> str | None:
    """Why the command cannot run as asked on this machine, or None."""
    if "LOCAL_RANK" in os.environ:  # set by torchrun in every process it starts
        return (
            "run it as `python -m varlen_workbench.workbench.audit.context_parallel`, not under torchrun: it spawns its --cp-size "
            "ranks itself (NCCL, one GPU each, when there are that many GPUs; gloo on a CPU-only machine)"
        )
    if args.cp_size < 2:
        return f"--cp-size {args.cp_size}: context parallelism splits sequences over at least 2 ranks; pass --cp-size 2"
    try:
        cp_backend(args.cp_size)
    except ValueError as exc:
        return f"--cp-size {args.cp_size}: {exc}"
    if args.fuzzed < 0:
        return f"--fuzzed {args.fuzzed}: the number of fuzzed layouts is 0 or more"
    if args.record and Path(args.record).is_dir():
        return f"--record {args.record} is a folder; name the JSON file, e.g. data/gpu/context-parallel-h200x2.json"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m varlen_workbench.workbench.audit.context_parallel", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--cp-size", type=int, default=2, help="ranks (NCCL when this many GPUs exist, gloo on CPU otherwise)")
    parser.add_argument("--fuzzed", type=int, default=8, help="fuzzed layouts on top of the fixed ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--record", help="write the result and the padding-rule study as a record (JSON) here")
    args = parser.parse_args(argv)
    problem = _argument_problem(args)
    if problem:
        parser.error(problem)  # exit 2, before any rank starts
    result = context_parallel_check(cp_size=args.cp_size, fuzzed=args.fuzzed, seed=args.seed, dtype=args.dtype, head_dim=64)
    study = padding_rule_study(args.cp_size)
    print(f"{result.name}: {result.verdict.value} ({result.seconds:.1f} s): {result.evidence}")
    print(f"padding rule (2 x cp_size): kept -> {len(study.kept_findings)} findings; broken -> {study.refusal.split(':')[0]}")
    if args.record:
        command = shlex.join(
            ["python", "-m", "varlen_workbench.workbench.audit.context_parallel", *(sys.argv[1:] if argv is None else argv)]
        )
        write_record(args.record, {"check": result.to_dict(), "padding_rule": study.summary()}, command=command)
    return 0 if result.verdict is Verdict.PASS and study.rule_needed else 1


if __name__ == "__main__":
    raise SystemExit(main())
