"""Our two backwards (`deterministic=True`: a dQ pass of its own; False: dQ fused into dK/dV with
fp32 atomics) side by side with FlashAttention-4 and torch's `varlen_attn`.

    python -m benchmarks.backward_modes --record data/gpu/backward-modes-h200.json   # CUDA
    python -m benchmarks.backward_modes --quick                                        # CPU smoke run

For the d128 bf16 workloads of `workbench.bench` named in WORKLOADS, in one process: forward,
forward+backward (`workbench.bench.measure`) and backward alone (`torch.autograd.grad` on a kept
graph), each the median and min of >= 20 calls, and the ratios FA4 / ours (below 1: FA4 is
faster). FA4 runs bare (`flash_attn.cute.flash_attn_varlen_func`, its own default backward), where
it imports. Before timing, the fused backward's gradients are checked against the deterministic
ones on each workload: within 3x `workbench.bounds`' bf16 floor (both sum dQ in fp32 and round it
once to bf16; only the order of the sums differs). A workload whose check fails is not timed.
`--quick` runs the checks only, under the interpreter on a tiny case: no timing claims.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import asdict, dataclass, field

import torch

from kernels import varlen_attention
from kernels.varlen.launch import TUNER
from workbench.bench import _fa4, _torch_varlen, grad_like, measure, precompile, ratio
from workbench.bounds import error_check
from workbench.layout import Case, pack
from workbench.records import write_record
from workbench.timing import MIN_ITERS, time_call
from workbench.workloads import Workload, workloads

# `workbench.bench` names, or the start of one (the mixes' names end with their document count).
WORKLOADS = (
    "8x2048 d128",
    "8x2048 d128 causal",
    "4x16384 d128 causal",
    "32k log-uniform 32-8192",
    "16k long-tail GQA 32/8",
)
DETERMINISTIC, FUSED, FA4, TORCH = (
    "ours deterministic=True",
    "ours deterministic=False",
    "FlashAttention-4 varlen",
    "torch varlen_attn",
)


def _ours(deterministic: bool):
    def make(batch, window):
        return lambda: batch.call(
            varlen_attention, validate=False, window_size=window, backend="triton", deterministic=deterministic
        )

    return make


IMPLEMENTATIONS = {DETERMINISTIC: _ours(True), FUSED: _ours(False), FA4: _fa4, TORCH: _torch_varlen}


def chosen_workloads(quick: bool) -> list[Workload]:
    if quick:
        case = Case((70, 33), heads=4, kv_heads=2, head_dim=32, causal=True, dtype="bfloat16")
        return [Workload("tiny GQA causal (interpreter)", case)]
    found = [w for w in workloads() if any(w.name == n or w.name.startswith(n + " (") for n in WORKLOADS)]
    if len(found) != len(WORKLOADS):
        raise RuntimeError(f"workbench.bench lacks some of {WORKLOADS}: found {[w.name for w in found]}")
    return found


@dataclass
class Result:
    workload: str
    impl: str
    error: str | None = None
    forward_ms: float | None = None
    forward_min_ms: float | None = None
    forward_backward_ms: float | None = None
    forward_backward_min_ms: float | None = None
    backward_ms: float | None = None
    backward_min_ms: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)


def _gradients(batch, make, window) -> tuple[torch.Tensor, ...]:
    fresh = batch.fresh()
    out = make(fresh, window)()
    return torch.autograd.grad(out, (fresh.q, fresh.k, fresh.v), grad_like(out))


def check(batch, window) -> str:
    """'ok', or which gradients of the fused backward differ from the deterministic one's by
    more than 3x the rounding floor of the dtype (`error_check` with no baseline error)."""
    expected = _gradients(batch, _ours(True), window)
    got = _gradients(batch, _ours(False), window)
    problems = []
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        bound = error_check(name, g, e, e, batch.q.dtype)
        if not bound.within:
            problems.append(str(bound))
    return "; ".join(problems) or "ok"


def backward_alone(make, batch, window, iters: int):
    """Median and min of `torch.autograd.grad` through one kept forward graph; None where `make` cannot run."""
    run = make(batch, window)
    if run is None:
        return None
    out = run()
    grad = grad_like(out)
    inputs = (batch.q, batch.k, batch.v)
    return time_call(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), iters=iters)


def run(quick: bool, iters: int, compile_jobs: int) -> tuple[list[Result], dict[str, str]]:
    device = "cpu" if quick else "cuda"
    chosen = chosen_workloads(quick)
    if not quick and compile_jobs:
        precompile(chosen, compile_jobs)  # every kernel's candidate tiles, both backwards, in parallel processes
    results: list[Result] = []
    checks: dict[str, str] = {}
    for workload in chosen:
        batch = pack(workload.case, device=device)
        checks[workload.name] = check(batch, workload.window)  # also tunes both backwards' tiles
        print(f"{workload.name}: fused vs deterministic gradients {checks[workload.name]}", flush=True)
        if quick or checks[workload.name] != "ok":
            continue
        rows = {}
        for name, make in IMPLEMENTATIONS.items():
            row = rows[name] = Result(workload.name, name)
            timing = measure(make, batch, iters=iters, window=workload.window)
            if timing is None:
                row.error = "not importable, or not for this layout"
                continue
            row.error = timing.error
            row.forward_ms, row.forward_min_ms = timing.forward_ms, timing.forward_min_ms
            row.forward_backward_ms, row.forward_backward_min_ms = timing.forward_backward_ms, timing.forward_backward_min_ms
            if row.error is None:
                alone = backward_alone(make, batch.fresh(), workload.window, iters)
                if alone is not None:
                    row.backward_ms, row.backward_min_ms = alone.median_ms, alone.min_ms
            torch.cuda.empty_cache()
        _ratios(rows)
        results.extend(rows.values())
    return results, checks


def _ratios(rows: dict[str, Result]) -> None:
    """Per implementation: FA4's time / its time (below 1: FA4 is faster), and for the fused
    backward, deterministic's time / its time (above 1: fusing pays)."""
    fa4, deterministic = rows.get(FA4), rows[DETERMINISTIC]
    for name, row in rows.items():
        if name == FA4:
            continue
        for what in ("forward_backward_ms", "backward_ms"):
            mine = getattr(row, what)
            if mine is None:
                continue
            if fa4 is not None and getattr(fa4, what):
                row.ratios[f"FA4 / {what[:-3]}"] = round(ratio(getattr(fa4, what), mine), 3)
            if name == FUSED:
                row.ratios[f"deterministic / {what[:-3]}"] = round(ratio(getattr(deterministic, what), mine), 3)


def format_table(results: list[Result]) -> str:
    def ms(median: float | None, least: float | None) -> str:
        return "-" if median is None else f"{median:.3f}/{least:.3f}"

    header = f"{'workload':<34} {'impl':<26} {'fwd med/min ms':>16} {'f+b med/min ms':>16} {'bwd med/min ms':>16}  ratios / error"
    lines = [header, "-" * len(header)]
    for r in results:
        note = ", ".join(f"{k} {v:.2f}" for k, v in r.ratios.items())
        lines.append(
            f"{r.workload[:34]:<34} {r.impl:<26} {ms(r.forward_ms, r.forward_min_ms):>16} "
            f"{ms(r.forward_backward_ms, r.forward_backward_min_ms):>16} {ms(r.backward_ms, r.backward_min_ms):>16}  "
            + " | ".join(x for x in (note, r.error) if x)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.backward_modes", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: the checks on a tiny case, no timing")
    parser.add_argument("--iters", type=int, default=MIN_ITERS, help=f"timed calls per measurement (at least {MIN_ITERS})")
    parser.add_argument("--record", metavar="FILE", help="write the results with provenance as JSON")
    parser.add_argument("--compile-jobs", type=int, default=8, metavar="N", help="processes precompiling the candidate tiles")
    args = parser.parse_args(argv)
    if args.iters < MIN_ITERS:
        parser.error(f"--iters {args.iters}: time at least {MIN_ITERS} calls per measurement")
    if not args.quick and not torch.cuda.is_available():
        print("backward_modes: no CUDA device; time it on a GPU, or run --quick for the CPU smoke run", file=sys.stderr)
        return 2
    results, checks = run(args.quick, args.iters, args.compile_jobs)
    print(format_table(results))
    if any(c != "ok" for c in checks.values()):
        print("backward_modes: the fused backward disagrees with the deterministic one (not timed there)", file=sys.stderr)
    if args.record:
        command = shlex.join(["python", "-m", "benchmarks.backward_modes", *(argv if argv is not None else sys.argv[1:])])
        payload = {"checks": checks, "rows": [asdict(r) for r in results], "tiles": TUNER.report()}
        write_record(args.record, payload, command=command)
    return 0 if all(c == "ok" for c in checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
