"""Post-mortem triton-interpreter-bf16-dot: the CPU interpreter multiplies raw bfloat16 bits.

Our own find while building the workbench. Under `TRITON_INTERPRET=1` numpy holds every tensor
and has no bfloat16, so the interpreter keeps bf16 as uint16 bit patterns; `create_dot` converts
only 8-bit floats before `np.matmul`, so a bf16 `tl.dot` multiplies the bit patterns. Every CPU
reproduction of a bf16 attention bug is wrong by ~1e9 and finite: a silent bug inside the tool
people use to study silent bugs.

The study (`study()`) runs in one mode, the interpreter or native, and returns plain JSON-ready
data; `reproduce()` always includes the interpreter's answer (a child process on a GPU box) and,
on a GPU, the native one. Tables and plots for the notebook are built here from those results.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import torch

from kernels import DEVICE, INTERPRETED, varlen_attention
from kernels.interpreter import (
    DOT_DTYPES,
    native_dots,
    report,
    run_interpreted,
    single_block_attention,
)
from workbench import Case, Fill, pack, probe
from workbench.postmortem import Claims, Link, Meta
from workbench.provenance import GPU_DATA

META = Meta(
    id="triton-interpreter-bf16-dot",
    title="The Triton CPU interpreter multiplies raw bfloat16 bits in tl.dot",
    component="Triton / CPU interpreter (TRITON_INTERPRET=1), tl.dot",
    upstream_status="closed (not fixed)",
    status_note='#11584 closed; fix PR #11585 closed with "No, we just don\'t support it yet"; bf16 documented as unsupported in the interpreter',
    detection="finite results ~1e9 too large; probe: REAL rows finite but error far beyond the bound",
    fix_type="upstream: none; ours: interpreter-only fp32 upcast of tl.dot operands (a constexpr), with a runtime detector of the bug",
    tags=("triton", "interpreter", "bfloat16", "tl.dot", "cpu", "silent"),
    reported="2026-09-04",
    published="2026-11-29",
    links=(
        Link("triton#11584", "https://github.com/triton-lang/triton/issues/11584"),
        Link("PR #11585 (closed)", "https://github.com/triton-lang/triton/pull/11585"),
        Link("PR #10945 (closed)", "https://github.com/triton-lang/triton/pull/10945"),
        Link("triton#4972", "https://github.com/triton-lang/triton/issues/4972"),
        Link("triton#5424", "https://github.com/triton-lang/triton/issues/5424"),
        Link("interpreter limitations", "https://triton-lang.org/main/programming-guide/chapter-3/debugging.html"),
    ),
)

# A padded, causal GQA batch with NaN in its padding (every region present), small enough for
# the interpreter; one per dtype. The flash-dmattn seed's configuration (bf16, causal, 256
# tokens, d=64) meets the same bug: any bf16 tl.dot does.
BASE = Case(seqlens_q=(21, 40, 3), padded_q=(24, 40, 8), tail_q=3, heads=2, kv_heads=1, head_dim=32, causal=True, fill=Fill.NAN)
CASES = tuple(BASE.with_(dtype=dtype) for dtype in DOT_DTYPES)
BF16 = CASES[-1]

REPRODUCTION = "reproduction"  # single_block_attention as a user's kernel would be: no workaround
WORKAROUND = "reproduction + upcast"
FIXED = "fixed kernel"
TIMING_REPEATS = 2
RECORD_COMMAND = (
    "workbench repro triton-interpreter-bf16-dot --device cuda --record data/gpu/triton-interpreter-bf16-dot-<gpu>.json"
)


def _attention_row(impl: str, record) -> dict[str, Any]:
    return {
        "impl": impl,
        "dtype": record.case.dtype,
        "real_finite": record.real_finite,
        "real_within_bound": record.real_within_bound,
        "padding_exactly_zero": record.padding_exactly_zero,
        "errors": {name: {"error": e.error, "bound": e.bound, "ratio": e.ratio} for name, e in record.errors.items()},
    }


def attention_study() -> list[dict[str, Any]]:
    """A user's bf16 reproduction (no workaround) next to fp32/fp16, the workaround, and our
    fixed kernel forward and backward, each probed against the fp64 oracle."""
    rows = [_attention_row(REPRODUCTION, probe(single_block_attention, pack(case), backward=False)) for case in CASES]
    bf16 = pack(BF16)
    rows.append(_attention_row(WORKAROUND, probe(partial(single_block_attention, upcast=True), bf16, backward=False)))
    rows.append(_attention_row(FIXED, probe(varlen_attention, bf16)))
    return rows


def forward_seconds(impl: Callable = varlen_attention, repeats: int = TIMING_REPEATS) -> dict[str, float]:
    """Best-of-`repeats` forward time of `impl` per dtype, after one warm-up call.

    Under the interpreter the clock is this process's CPU time: the interpreter is single-threaded
    Python and numpy, and CPU time ignores other jobs on a shared CI machine. Natively it is wall
    time with the GPU synchronised.
    """
    clock = time.process_time if INTERPRETED else time.perf_counter
    seconds = {}
    for case in CASES:
        batch = pack(case, requires_grad=False)
        batch.call(impl)
        best = float("inf")
        for _ in range(repeats):
            if batch.device.type == "cuda":
                torch.cuda.synchronize(batch.device)
            start = clock()
            batch.call(impl)
            if batch.device.type == "cuda":
                torch.cuda.synchronize(batch.device)
            best = min(best, clock() - start)
        seconds[case.dtype] = best
    return seconds


def study() -> dict[str, Any]:
    """Everything this post-mortem measures, in this process's mode. JSON-ready."""
    return {"detector": report(), "attention": attention_study(), "forward_seconds": forward_seconds()}


def compiled() -> dict[str, dict[str, Any]]:
    """The 16x16 dot kernel compiled for sm_90 with the upcast flag off and on (no GPU needed)."""
    return {
        "on" if flag else "off": asdict(native) | {"mma": list(native.mma), "operand_type": native.operand_type}
        for flag, native in native_dots().items()
    }


def reproduce(device: str | torch.device | None = None) -> dict[str, Any]:
    """The interpreter's study (here, or in a child process when this one is native), the native
    study when this process runs on a GPU, and the native compilation of the dot kernel."""
    device = DEVICE if device is None else torch.device(device).type
    if device != DEVICE:
        raise ValueError(
            f"reproduce(device={device!r}) but kernels chose {DEVICE!r} at import; run "
            f"`workbench repro {META.id} --device {device}` (or set WORKBENCH_DEVICE={device})."
        )
    here = study()
    return {
        "interpreter": here if INTERPRETED else run_interpreted(__name__),
        "native": None if INTERPRETED else here,
        "compiled": compiled(),
    }


# ---- tables and plots for the notebook (built from results only) ---------------------------


def dot_table(results: dict[str, Any]) -> str:
    """One 16x16 tl.dot per dtype: max error over max |exact product|, per mode."""
    lines = [f"{'mode':<12} {'dtype':<22} {'max |err| / max |exact|':>24}  correct"]
    for mode in ("interpreter", "native"):
        run = results[mode]
        if run is None:
            continue
        checks = list(run["detector"]["checks"].values()) + [run["detector"]["workaround"]]
        for check in checks:
            label = check["dtype"] + (" + upcast" if check["upcast"] else "")
            lines.append(f"{mode:<12} {label:<22} {check['relative']:>24.1e}  {check['correct']}")
    return "\n".join(lines)


def attention_table(results: dict[str, Any], mode: str = "interpreter") -> str:
    """What `probe` recorded for each attention run: finiteness, error vs bound, per tensor."""
    lines = [f"{'impl':<22} {'dtype':<9} {'finite':<7} {'within':<7} errors (error / bound)"]
    for row in results[mode]["attention"]:
        errors = ", ".join(f"{n} {e['error']:.1e}/{e['bound']:.1e}" for n, e in row["errors"].items())
        lines.append(f"{row['impl']:<22} {row['dtype']:<9} {row['real_finite']!s:<7} {row['real_within_bound']!s:<7} {errors}")
    return "\n".join(lines)


def cost_table(results: dict[str, Any]) -> str:
    """The fixed kernel's forward per dtype: bf16 carries the upcast under the interpreter only."""
    lines = [f"{'mode':<12} {'dtype':<9} {'forward':>10}  {'vs fp16':>7}  upcast"]
    for mode in ("interpreter", "native"):
        run = results[mode]
        if run is None:
            continue
        seconds = run["forward_seconds"]
        upcast = run["detector"]["bf16_dot_is_broken"]
        for dtype, s in seconds.items():
            lines.append(
                f"{mode:<12} {dtype:<9} {s * 1e3:>8.1f} ms  {s / seconds['float16']:>6.2f}x  {dtype == 'bfloat16' and upcast}"
            )
    return "\n".join(lines)


def compiled_table(results: dict[str, Any]) -> str:
    lines = []
    for flag, c in results["compiled"].items():
        lines.append(f"upcast {flag:<3} sm_{c['arch']}: {c['dot']}")
        lines.append(
            f"           widening conversions {c['conversions']}, tensor-core ops {c['mma'] or 'none'}, scalar fp32 FMAs per thread {c['fma']}"
        )
    return "\n".join(lines)


def plot_dot_errors(results: dict[str, Any], mode: str = "interpreter"):
    """Bar chart, log scale: relative error of one 16x16 tl.dot per dtype, with the tolerance."""
    import matplotlib.pyplot as plt

    from kernels.interpreter import RELATIVE_TOLERANCE

    run = results[mode]["detector"]
    checks = list(run["checks"].values()) + [run["workaround"]]
    labels = [c["dtype"] + ("\n+ upcast" if c["upcast"] else "") for c in checks]
    values = [max(c["relative"], 1e-12) for c in checks]  # an exact result still gets a bar
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.bar(labels, values, color=["#4c72b0" if c["correct"] else "#c44e52" for c in checks])
    ax.axhline(RELATIVE_TOLERANCE, color="black", linestyle="--", linewidth=1, label=f"detector tolerance {RELATIVE_TOLERANCE:g}")
    ax.set_yscale("log")
    ax.set_ylabel("max |tl.dot - exact| / max |exact|")
    ax.set_title(f"16x16 tl.dot under the {mode} (triton {run['triton']})")
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig


def interpreter_dot_source() -> str:
    """The installed interpreter's `create_dot` and its bf16 storage rule, verbatim."""
    from triton.runtime import interpreter

    storage = [line for line in inspect.getsource(interpreter._get_np_dtype).splitlines() if "bfloat16" in line]
    return "\n".join(storage) + "\n\n" + inspect.getsource(interpreter.InterpreterBuilder.create_dot)


def workaround_source() -> str:
    """Where our fixed kernel applies the workaround, verbatim."""
    from kernels.varlen import triton_kernels

    return inspect.getsource(getattr(triton_kernels._dot, "fn", triton_kernels._dot))


def upcast_decision_source() -> str:
    """How the fixed kernel's launcher decides the upcast flag: its deciding function(s) and the
    launch arguments that pass it, verbatim."""
    from kernels.varlen import launch

    deciders = [inspect.getsource(f) for name, f in vars(launch).items() if "upcast" in name.lower() and inspect.isfunction(f)]
    passes = [line.strip() for line in inspect.getsource(launch).splitlines() if "DOT_UPCAST=" in line]
    return "\n".join(deciders + ["# passed as:"] + passes)


def gpu_records() -> list[dict[str, Any]]:
    """Runs recorded on GPU machines with `RECORD_COMMAND` (data/gpu/), newest layout first."""
    return [json.loads(p.read_text()) for p in sorted(GPU_DATA.glob(f"{META.id}-*.json"))]


# ---- claims --------------------------------------------------------------------------------

claims = Claims()


def _decade(x: float) -> str:
    """An order of magnitude ('~1e+9'): evidence that reads the same on any CPU's rounding."""
    return f"~1e{round(math.log10(x)):+d}" if x > 0 else "0"


def _row(results: dict[str, Any], impl: str, dtype: str = "bfloat16") -> dict[str, Any]:
    return next(r for r in results["interpreter"]["attention"] if r["impl"] == impl and r["dtype"] == dtype)


@claims("bf16 tl.dot under the interpreter differs from the fp32 product by many orders of magnitude; fp16 does not")
def _orders_of_magnitude(results):
    run = results["interpreter"]["detector"]
    rel = {name: check["relative"] for name, check in run["checks"].items()}
    holds = rel["bfloat16"] > 1e6 and rel["float16"] < 1e-5 and rel["float32"] < 1e-5
    return holds, f"relative error bf16 {_decade(rel['bfloat16'])}; fp16 and fp32 below 1e-5 (triton {run['triton']})"


@claims("the interpreter's bf16 tl.dot is exactly numpy's matmul of the raw uint16 bit patterns")
def _mechanism(results):
    gap = results["interpreter"]["detector"]["bit_pattern_gap"]
    return gap == 0.0, f"max |tl.dot - np.matmul(bits, bits)| = {gap:g}"


@claims("a bf16 CPU reproduction without the workaround is finite but far off, and probe flags it")
def _probe_flags_it(results):
    raw = _row(results, REPRODUCTION)
    others = [_row(results, REPRODUCTION, dtype) for dtype in ("float32", "float16")]
    out = raw["errors"]["out"]
    holds = raw["real_finite"] and not raw["real_within_bound"] and all(r["real_within_bound"] for r in others)
    return (
        holds,
        f"bf16 REAL rows finite, out error {_decade(out['error'])} vs bound {_decade(out['bound'])}; fp32 and fp16 within bound",
    )


@claims("our kernels are within the bound of the oracle in bf16 under the interpreter")
def _ours_within_bound(results):
    fixed, workaround = _row(results, FIXED), _row(results, WORKAROUND)
    within = [name for name, e in fixed["errors"].items() if e["error"] <= e["bound"]]
    holds = fixed["real_within_bound"] and fixed["padding_exactly_zero"] and workaround["real_within_bound"]
    return holds, f"fixed kernel: {', '.join(within)} within bound, padding exactly 0; reproduction + upcast: out within bound"


@claims("the detector's answer matches the observed behaviour")
def _detector_matches(results):
    run = results["interpreter"]["detector"]
    observed = not run["checks"]["bfloat16"]["correct"] and not _row(results, REPRODUCTION)["real_within_bound"]
    holds = run["bf16_dot_is_broken"] == observed
    evidence = f"interpreter: detector says broken={run['bf16_dot_is_broken']}, dot and attention observed broken={observed}"
    native = results["native"]
    if native is not None:
        native_observed = not native["detector"]["checks"]["bfloat16"]["correct"]
        holds = holds and native["detector"]["bf16_dot_is_broken"] is False and not native_observed
        evidence += f"; native: detector says broken=False, observed broken={native_observed}"
    return holds, evidence


@claims("natively the workaround is compiled out: bf16 operands reach the tensor cores")
def _compiled_out(results):
    off, on = results["compiled"]["off"], results["compiled"]["on"]
    holds = off["operand_type"] == "bf16" and off["conversions"] == 0 and any("bf16" in op for op in off["mma"])
    holds = holds and on["conversions"] == 2 and not on["mma"]  # the contrast: the flag really changes code
    native = results["native"]
    if native is not None:
        holds = holds and native["detector"]["bf16_dot_is_broken"] is False
    return holds, f"sm_{off['arch']}, flag off: {' '.join(off['mma'])}, 0 conversions; flag on: {on['fma']} scalar FMAs, no mma"


if __name__ == "__main__":  # the child process of `run_interpreted`: the interpreter's study as JSON
    json.dump(study(), sys.stdout)
