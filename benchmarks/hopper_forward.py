"""The forward kernel's Hopper switches (`ForwardConfig`) against the shipped default and FlashAttention-4.

    python -m benchmarks.hopper_forward --record data/gpu/hopper-forward-h200.json   # CUDA
    python -m benchmarks.hopper_forward --quick                                        # CPU smoke run

For the d128 bf16 workloads of `varlen_workbench.workbench.bench.kernels` named in WORKLOADS, side by side in one
process: our kernel as shipped (its tile tuned as always), each switch alone and all together
(forward tile pinned to the one the default picked, so a ratio measures the switch and not a
tile; backward is the shipped one), and FlashAttention-4's `flash_attn_varlen_func` where it
imports. Each is timed by `varlen_workbench.workbench.bench.kernels.measure` (forward and forward+backward, median and
min of >= 20 calls). Before timing, every variant's output on the workload with NaN in TAIL
rows is checked against the default kernel's: REAL rows within `varlen_workbench.workbench.bounds`' bf16 floor
(the two kernels differ by at most their output's rounding), TAIL rows exactly 0. A variant
that fails to compile, raises or is wrong is a row with its error, never a crash, and is not
timed. `--quick` runs the checks only, under the interpreter on a tiny case: no timing claims.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import asdict, dataclass, field

import torch

from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.kernels.varlen.hopper import DEFAULT_FORWARD, ForwardConfig, forward_config
from varlen_workbench.kernels.varlen.launch import candidate_tiles, tuner
from varlen_workbench.kernels.varlen.tuner import shape_class
from varlen_workbench.workbench.bench.hopper_report import CURRENT, FA4
from varlen_workbench.workbench.bench.kernel_record import ratio
from varlen_workbench.workbench.bench.kernels import _fa4, measure, precompile
from varlen_workbench.workbench.bench.workloads import Workload, workloads
from varlen_workbench.workbench.bounds import error_check
from varlen_workbench.workbench.layout import Case, Fill, Region, pack
from varlen_workbench.workbench.records import write_record
from varlen_workbench.workbench.timing import MIN_ITERS

# `varlen_workbench.workbench.bench.kernels` names; the log-uniform mix's name ends with its document count.
WORKLOADS = ("8x2048 d128", "8x2048 d128 causal", "32k log-uniform 32-8192", "4x16384 d128 causal")
VARIANTS = {
    CURRENT: DEFAULT_FORWARD,
    "descriptors": ForwardConfig(descriptors=True),
    "warp_specialize": ForwardConfig(warp_specialize=True),
    "persistent": ForwardConfig(persistent=True),
    "all three": ForwardConfig(descriptors=True, warp_specialize=True, persistent=True),
}
TAIL = 64  # poisoned rows past the last sequence in the check


def chosen_workloads(quick: bool) -> list[Workload]:
    if quick:
        return [Workload("tiny causal (interpreter)", Case((70, 33), heads=2, head_dim=32, causal=True, dtype="bfloat16"))]
    found = [w for w in workloads() if w.name in WORKLOADS or w.name.startswith(WORKLOADS[2])]
    if len(found) != len(WORKLOADS):
        raise RuntimeError(f"varlen_workbench.workbench.bench.kernels lacks some of {WORKLOADS}: found {[w.name for w in found]}")
    return found


@dataclass
class Result:
    workload: str
    variant: str
    config: str
    tile: str | None = None
    check: str | None = None
    error: str | None = None
    forward_ms: float | None = None
    forward_min_ms: float | None = None
    forward_backward_ms: float | None = None
    forward_backward_min_ms: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)


def _default_tile(workload: Workload, batch):
    """The forward tile the tuner chose for the default config on this batch (its first candidate if untimed)."""
    c = workload.case
    key = shape_class(
        "forward",
        c.torch_dtype,
        c.heads,
        c.head_dim,
        batch.q.shape[0],
        c.batch,
        c.causal or workload.window[1] >= 0,
        c.heads // (c.kv_heads or c.heads),
        workload.sliding,
    )
    return tuner().chosen.get(key, candidate_tiles("forward", c.head_dim, c.torch_dtype, batch.q.device)[0])


def _ours(batch, window):
    """Our kernel as `varlen_workbench.workbench.bench.kernels` times it, pinned to the Triton backend."""
    return lambda: batch.call(varlen_attention, validate=False, window_size=window, backend="triton")


def check(workload: Workload, config: ForwardConfig, device: str) -> str:
    """'ok', or what is wrong: `config`'s output against the default's with NaN in TAIL rows
    (both with the forward tile pinned by the caller)."""
    batch = pack(workload.case.with_(tail_q=TAIL, tail_k=TAIL, fill=Fill.NAN), device=device)
    with torch.no_grad():
        expected = _ours(batch, workload.window)()
        with forward_config(config):
            got = _ours(batch, workload.window)()
    real = (batch.regions_q == Region.REAL).to(got.device)
    bound = error_check("out", got[real], expected[real], expected[real], workload.case.torch_dtype, **batch.reduction_lengths())
    padding = got[~real]
    problems = [] if bound.within else [str(bound)]
    if padding.numel() and not bool((padding == 0).all()):
        problems.append(f"TAIL rows not 0 (max |x| {padding.abs().nan_to_num(float('inf')).max().item():.3g})")
    return "; ".join(problems) or "ok"


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def run(quick: bool, iters: int, compile_jobs: int) -> list[Result]:
    device = "cpu" if quick else "cuda"
    chosen = chosen_workloads(quick)
    if not quick and compile_jobs:
        precompile(chosen, compile_jobs)  # the default's candidate tiles, in parallel processes
    results: list[Result] = []
    for workload in chosen:
        batch = pack(workload.case, device=device)
        with torch.no_grad():
            _ours(batch, workload.window)()  # the tuner picks the default's forward tile here
        tile = _default_tile(workload, batch)
        rows: dict[str, Result] = {}
        for name, config in VARIANTS.items():
            row = rows[name] = Result(workload.name, name, str(config), tile=str(tile))
            try:
                with tuner().pinned(forward=tile):
                    row.check = check(workload, config, device)
                    if row.check != "ok" or quick:
                        continue
                    with forward_config(config):
                        _copy_timing(row, measure(_ours, batch, iters=iters, window=workload.window))
            except Exception as exc:  # a variant that cannot compile or run is a result
                row.error = _error(exc)
        if not quick:
            rows[FA4] = Result(workload.name, FA4, "bare")
            _copy_timing(rows[FA4], measure(_fa4, batch, iters=iters, window=workload.window))
            torch.cuda.empty_cache()
        _ratios(rows)
        results.extend(rows.values())
    return results


def _copy_timing(row: Result, timing) -> None:
    if timing is None:
        row.error = "not importable, or not for this layout"
        return
    row.error = row.error or timing.error
    row.forward_ms, row.forward_min_ms = timing.forward_ms, timing.forward_min_ms
    row.forward_backward_ms, row.forward_backward_min_ms = timing.forward_backward_ms, timing.forward_backward_min_ms


def _ratios(rows: dict[str, Result]) -> None:
    """Per variant: its time / FA4's (below 1: faster than FA4) and current / its time (above 1: the switch pays)."""
    fa4, current = rows.get(FA4), rows[CURRENT]
    for name, row in rows.items():
        if name == FA4 or row.forward_ms is None:
            continue
        for what in ("forward_ms", "forward_backward_ms"):
            mine = getattr(row, what)
            if fa4 is not None and getattr(fa4, what):
                row.ratios[f"{what[:-3]} / FA4"] = round(ratio(mine, getattr(fa4, what)), 3)
            if getattr(current, what):
                row.ratios[f"current / {what[:-3]}"] = round(ratio(getattr(current, what), mine), 3)


def format_table(results: list[Result]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    header = f"{'workload':<34} {'variant':<24} {'fwd med/min ms':>16} {'f+b med/min ms':>16}  ratios / check / error"
    lines = [header, "-" * len(header)]
    for r in results:
        note = ", ".join(f"{k} {v:.2f}" for k, v in r.ratios.items()) or ""
        extra = r.error or ("" if r.check in (None, "ok") else f"check: {r.check}")
        if r.check == "ok" and r.forward_ms is None and not r.error:
            extra = "check ok (not timed)"
        lines.append(
            f"{r.workload[:34]:<34} {r.variant:<24} {ms(r.forward_ms) + '/' + ms(r.forward_min_ms):>16} "
            f"{ms(r.forward_backward_ms) + '/' + ms(r.forward_backward_min_ms):>16}  {' | '.join(x for x in (note, extra) if x)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hopper_forward", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: the checks on a tiny case, no timing")
    parser.add_argument("--iters", type=int, default=MIN_ITERS, help=f"timed calls per measurement (at least {MIN_ITERS})")
    parser.add_argument("--record", metavar="FILE", help="write the results with provenance as JSON")
    parser.add_argument("--compile-jobs", type=int, default=8, metavar="N", help="processes precompiling the default's tiles")
    args = parser.parse_args(argv)
    if args.iters < MIN_ITERS:
        parser.error(f"--iters {args.iters}: time at least {MIN_ITERS} calls per measurement")
    if not args.quick and not torch.cuda.is_available():
        print("hopper_forward: no CUDA device; time it on a GPU, or run --quick for the CPU smoke run", file=sys.stderr)
        return 2
    results = run(args.quick, args.iters, args.compile_jobs)
    print(format_table(results))
    if args.record:
        command = shlex.join(["python", "-m", "benchmarks.hopper_forward", *(argv if argv is not None else sys.argv[1:])])
        write_record(args.record, {"rows": [asdict(r) for r in results], "tiles": tuner().report()}, command=command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
