"""Post-mortem triton-interpreter-bf16-dot: the CPU interpreter multiplies raw bfloat16 bits.

Our own find while building the workbench, a tooling bug. Under `TRITON_INTERPRET=1` numpy holds
every tensor and has no bfloat16, so the interpreter keeps bf16 as uint16 bit patterns;
`create_dot` converts only 8-bit floats before `np.matmul`, so a bf16 `tl.dot` multiplies the bit
patterns. Any kernel with a bf16 `tl.dot` run on the CPU interpreter returns results ~1e9 too
large and finite: a silent bug inside the tool people use to study silent bugs. Compiled runs on
a GPU are correct.

The study (`study()`) runs in one mode, the interpreter or native, and returns plain JSON-ready
data; `reproduce()` always includes the interpreter's answer (a child process on a GPU box), on a
GPU the native one, the native compilation of the dot kernel, the installed interpreter's source
of the bug, and the GPU runs recorded under data/gpu/ (`gpu_records(META)`). Tables and figures
for the notebook are built here from those results with `table()` and `figure()`; source listings
go through `listing(name)`, so a test can check that a committed notebook shows the current code.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
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
from workbench.postmortem import (
    OURS,
    UPSTREAM_CPU,
    UPSTREAM_GPU,
    Claims,
    Link,
    Meta,
    Results,
    figure,
    gpu_records,
    source_at,
    table,
)

TRITON = "https://github.com/triton-lang/triton"
# The upstream commit whose interpreter source we read (python/triton/runtime/interpreter.py):
# bf16 stored as uint16 in `_get_np_dtype`, and `create_dot` converting only 8-bit float operands.
SOURCE_READ = "triton-lang/triton@bf34f5bbc5f3cb472d9a19c369f9d5e20399ff15"

META = Meta(
    id="triton-interpreter-bf16-dot",
    title="The Triton CPU interpreter multiplies raw bfloat16 bits in tl.dot",
    component="Triton / CPU interpreter (TRITON_INTERPRET=1), tl.dot",
    category="tooling bug",
    impact="CPU runs (TRITON_INTERPRET=1) of any Triton kernel with a bf16 tl.dot return finite results ~1e9 too large, "
    "without an error; compiled GPU runs are correct",
    upstream_status="closed (not fixed)",
    status_note='#11584 closed; its fix, PR #11585, closed unmerged ("No, we just don\'t support it yet"); '
    "the debugging guide documents bf16 as unsupported in the interpreter",
    our_verdict="the report holds on triton 3.6.0, its mechanism to the bit; natively (H200) the bf16 dot is correct",
    detection="finite results ~1e9 too large; probe: REAL rows finite but error far beyond the bound",
    fix_type="upstream: none; workarounds: upcast tl.dot operands to fp32 (a constexpr, off natively), test in fp16, "
    "or run natively; ours applies the upcast when a runtime detector sees the bug",
    tags=("triton", "interpreter", "bfloat16"),
    reported="2026-09-04",
    published="2026-11-29",
    revised="2026-12-01",
    links=(
        Link("triton#11584", f"{TRITON}/issues/11584", date="2026-09-04", kind="issue", status="closed"),
        Link(
            "PR #11585: convert bf16 operands of tl.dot",
            f"{TRITON}/pull/11585",
            date="2026-09-04",
            kind="PR",
            status='closed unmerged; maintainer, 2026-09-05: "No, we just don\'t support it yet"',
        ),
        Link(
            "PR #10945: bf16 ops in a value dtype",
            f"{TRITON}/pull/10945",
            date="2026-07-18",
            kind="PR",
            status="closed unmerged (covered create_dot too)",
        ),
        Link(
            "PR #10688: bf16 through ml_dtypes",
            f"{TRITON}/pull/10688",
            date="2026-06-20",
            kind="PR",
            status="open; maintainer reluctant to add a dependency",
        ),
        Link(
            "triton#5424",
            f"{TRITON}/issues/5424",
            date="2025-02-14",
            kind="issue",
            status='closed; answered that day: "The interpreter mode doesn\'t support bf16"',
        ),
        Link(
            "triton#4972: bf16 loads under the interpreter",
            f"{TRITON}/issues/4972",
            date="2024-10-23",
            kind="issue",
            status="closed; answered that day with the debugging guide",
        ),
        Link("PR #3811: bf16 <-> fp32 casts in the interpreter (merged)", f"{TRITON}/pull/3811"),
        Link(
            "debugging guide: interpreter limitations", "https://triton-lang.org/main/programming-guide/chapter-3/debugging.html"
        ),
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


def interpreter_source() -> dict[str, str]:
    """The installed interpreter's bf16 storage rule and its `create_dot`, verbatim."""
    from triton.runtime import interpreter

    storage = [line for line in inspect.getsource(interpreter._get_np_dtype).splitlines() if "bfloat16" in line]
    return {"storage": "\n".join(storage), "create_dot": inspect.getsource(interpreter.InterpreterBuilder.create_dot)}


@dataclass
class StudyResults(Results):
    """What reproduce() measured, JSON-ready: the interpreter's study, the native one (None on a
    CPU machine), the dot kernel compiled for sm_90, the installed interpreter's source of the bug,
    and the GPU runs recorded under data/gpu/ (`gpu_records(META)`)."""

    interpreter: dict[str, Any]
    native: dict[str, Any] | None
    compiled: dict[str, dict[str, Any]]
    source: dict[str, str]
    gpu: list[dict[str, Any]]


def reproduce(device: str | torch.device | None = None) -> StudyResults:
    """The interpreter's study (here, or in a child process when this one is native), the native
    study when this process runs on a GPU, the native compilation of the dot kernel, the
    interpreter's source, and the recorded GPU runs."""
    device = DEVICE if device is None else torch.device(device).type
    if device != DEVICE:
        raise ValueError(
            f"reproduce(device={device!r}) but kernels chose {DEVICE!r} at import; run "
            f"`workbench repro {META.id} --device {device}` (or set WORKBENCH_DEVICE={device})."
        )
    here = study()
    return StudyResults(
        interpreter=here if INTERPRETED else run_interpreted(__name__),
        native=None if INTERPRETED else here,
        compiled=compiled(),
        source=interpreter_source(),
        gpu=gpu_records(META),
    )


def _runs(results: StudyResults) -> dict[str, dict[str, Any]]:
    return {mode: run for mode, run in (("interpreter", results.interpreter), ("native", results.native)) if run is not None}


def _recorded(record: dict[str, Any]) -> StudyResults:
    """A GPU record's results as StudyResults (records written before `source` and `gpu` existed lack them)."""
    r = record["results"]
    return StudyResults(r["interpreter"], r["native"], r["compiled"], r.get("source", {}), [])


# ---- tables, figures and listings for the notebook (built from results only) ----------------


def dot_table(results: StudyResults):
    """One 16x16 tl.dot per dtype: max error over max |exact product|, per mode."""
    rows = []
    for mode, run in _runs(results).items():
        for check in [*run["detector"]["checks"].values(), run["detector"]["workaround"]]:
            label = check["dtype"] + (" + upcast" if check["upcast"] else "")
            rows.append((mode, label, f"{check['relative']:.1e}", "yes" if check["correct"] else "NO"))
    return table(("mode", "dtype", "max |err| / max |exact|", "correct"), rows)


def attention_table(results: StudyResults, mode: str = "interpreter"):
    """What `probe` recorded for each attention run: finiteness, error vs bound, per tensor."""
    rows = []
    for row in _runs(results)[mode]["attention"]:
        errors = ", ".join(f"{n} {e['error']:.1e} / {e['bound']:.1e}" for n, e in row["errors"].items())
        rows.append((row["impl"], row["dtype"], row["real_finite"], row["real_within_bound"], errors))
    return table(("implementation", "dtype", "finite", "within bound", "error / bound on REAL rows"), rows)


def cost_table(results: StudyResults):
    """The fixed kernel's forward per dtype under the interpreter, in CPU time: bf16 carries the
    upcast there. Native timings of this tiny case measure launch overhead, not the kernel: not shown."""
    run = results.interpreter
    seconds = run["forward_seconds"]
    upcast = run["detector"]["bf16_dot_is_broken"]
    return table(
        ("dtype", "forward (CPU time)", "vs fp16", "upcast"),
        [
            (dtype, f"{s * 1e3:.0f} ms", f"{s / seconds['float16']:.2f}x", dtype == "bfloat16" and upcast)
            for dtype, s in seconds.items()
        ],
    )


def compiled_table(results: StudyResults):
    """The 16x16 dot kernel compiled for sm_90 with the upcast flag off and on."""
    return table(
        ("upcast", "arch", "widening conversions", "tensor-core ops", "scalar fp32 FMAs per thread"),
        [
            (flag, f"sm_{c['arch']}", c["conversions"], " ".join(c["mma"]) or "none", c["fma"])
            for flag, c in results.compiled.items()
        ],
    )


def workaround_table(results: StudyResults):
    """Each workaround, demonstrated by this page's own runs: bf16 attention error on REAL rows
    against the bound (and the native dot from the GPU records), with its cost."""
    seconds = results.interpreter["forward_seconds"]

    def attention(impl: str, dtype: str = "bfloat16") -> str:
        out = _row(results, impl, dtype)["errors"]["out"]
        return f"out error {out['error']:.1e} / bound {out['bound']:.1e}: " + (
            "within" if out["error"] <= out["bound"] else "OFF"
        )

    rows = [
        ("none: bf16 tl.dot as written", attention(REPRODUCTION), "-"),
        (
            "upcast operands: a.to(tl.float32), b.to(tl.float32) before tl.dot",
            attention(WORKAROUND),
            "fp32 dot on CPU; keep it off natively",
        ),
        ("test in fp16 on CPU", attention(REPRODUCTION, "float16"), "fp16 range (max 65504), not bf16's"),
    ]
    native = [_recorded(r).native for r in results.gpu] + ([results.native] if results.native is not None else [])
    if native:
        bf16 = native[-1]["detector"]["checks"]["bfloat16"]
        rows.append(
            ("run natively on a GPU", f"16x16 bf16 dot error {bf16['relative']:.1e} of max |exact|: right", "needs a GPU")
        )
    cost = seconds["bfloat16"] / seconds["float16"]
    rows.append(
        ("our fixed kernel (upcast decided by a detector)", attention(FIXED), f"forward {cost:.1f}x fp16's under the interpreter")
    )
    return table(("workaround", "bf16 result under the interpreter", "cost / caveat"), rows)


def gpu_table(results: StudyResults):
    """Each recorded GPU run: where and with what it ran, and what it showed natively."""
    rows = []
    for record in results.gpu:
        p, native = record["provenance"], record["results"]["native"]
        bf16 = native["detector"]["checks"]["bfloat16"]
        rows.append(
            (
                record["file"],
                p["device"],
                f"torch {p['torch']}, triton {p['triton']}",
                p["commit"].split()[0],
                p["date"],
                f"{bf16['relative']:.1e}",
                native["detector"]["bf16_dot_is_broken"],
            )
        )
    return table(("record", "device", "versions", "commit", "date", "native bf16 dot error", "detector: broken"), rows)


def plot_dot_errors(results: StudyResults):
    """Bars, log scale: relative error of one 16x16 tl.dot per dtype and mode, with the tolerance."""
    from kernels.interpreter import RELATIVE_TOLERANCE

    runs = _runs(results)
    if results.native is None and results.gpu:  # a CPU machine: the newest GPU record shows the native side
        record = results.gpu[-1]
        runs[f"native ({record['provenance']['device']} record)"] = _recorded(record).native
    fig, axes = figure(1, len(runs), width=3.6 * len(runs), height=3.0, sharey=True)
    for ax, (mode, run) in zip(axes[0], runs.items()):
        checks = [*run["detector"]["checks"].values(), run["detector"]["workaround"]]
        labels = [c["dtype"].replace("float", "fp").replace("bfp", "bf") + ("\n+ upcast" if c["upcast"] else "") for c in checks]
        values = [max(c["relative"], 1e-12) for c in checks]  # an exact result still gets a bar
        ax.bar(labels, values, color=["#4c72b0" if c["correct"] else "#c44e52" for c in checks])
        ax.axhline(RELATIVE_TOLERANCE, color="black", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_title(f"{mode}, triton {run['detector']['triton']}", loc="left", fontsize="medium")
    axes[0, 0].set_ylabel("max |tl.dot - exact| / max |exact|")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color="#4c72b0", label="correct"),
        Patch(color="#c44e52", label="wrong"),
        Line2D([], [], color="black", linestyle="--", linewidth=1, label=f"detector tolerance {RELATIVE_TOLERANCE:g}"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3)
    return fig


def _interpreter_dot_source() -> str:
    source = interpreter_source()
    return source["storage"] + "\n\n" + source["create_dot"]


def _workaround_source() -> str:
    from kernels.varlen import triton_kernels

    return inspect.getsource(getattr(triton_kernels._dot, "fn", triton_kernels._dot))


def _upcast_decision_source() -> str:
    from kernels.varlen import launch

    deciders = [inspect.getsource(f) for name, f in vars(launch).items() if "upcast" in name.lower() and inspect.isfunction(f)]
    passes = [line.strip() for line in inspect.getsource(launch).splitlines() if "DOT_UPCAST=" in line]
    return "\n".join(deciders + ["# passed as:"] + passes)


LISTINGS: dict[str, Callable[[], str]] = {
    "interpreter create_dot": _interpreter_dot_source,  # the installed Triton's interpreter
    "our _dot": _workaround_source,  # kernels/varlen/triton_kernels.py
    "upcast decision": _upcast_decision_source,  # kernels/varlen/launch.py
}


@dataclass(frozen=True)
class Listing:
    """Source code as it is now, printed verbatim: `listing(name)` in a notebook cell. A test
    re-renders every listing a committed notebook shows and compares (tests/test_registry.py)."""

    name: str
    text: str

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


def listing(name: str) -> Listing:
    """The current source of `name` (one of LISTINGS), read from the code itself."""
    if name not in LISTINGS:
        raise ValueError(f"listing({name!r}): give one of {sorted(LISTINGS)}.")
    return Listing(name, LISTINGS[name]().rstrip("\n"))


# ---- claims --------------------------------------------------------------------------------

claims = Claims()


def _decade(x: float) -> str:
    """An order of magnitude ('~1e+9'): evidence that reads the same on any CPU's rounding."""
    return f"~1e{round(math.log10(x)):+d}" if x > 0 else "0"


def _row(results: StudyResults, impl: str, dtype: str = "bfloat16") -> dict[str, Any]:
    return next(r for r in results.interpreter["attention"] if r["impl"] == impl and r["dtype"] == dtype)


@claims(
    "bf16 tl.dot under the interpreter differs from the fp32 product by many orders of magnitude; fp16 does not",
    evidence=UPSTREAM_CPU,
)
def _orders_of_magnitude(results):
    run = results.interpreter["detector"]
    rel = {name: check["relative"] for name, check in run["checks"].items()}
    holds = rel["bfloat16"] > 1e6 and rel["float16"] < 1e-5 and rel["float32"] < 1e-5
    return holds, f"relative error bf16 {_decade(rel['bfloat16'])}; fp16 and fp32 below 1e-5 (triton {run['triton']})"


@claims("the interpreter's bf16 tl.dot is exactly numpy's matmul of the raw uint16 bit patterns", evidence=UPSTREAM_CPU)
def _mechanism(results):
    gap = results.interpreter["detector"]["bit_pattern_gap"]
    return gap == 0.0, f"max |tl.dot - np.matmul(bits, bits)| = {gap:g}"


@claims(
    "the interpreter stores bf16 as uint16 and its create_dot converts only 8-bit float operands before np.matmul",
    evidence=source_at(SOURCE_READ),
)
def _source_says_so(results):
    storage, dot = results.source["storage"], results.source["create_dot"]
    stored = "tl.bfloat16: np.dtype(np.uint16)" in storage
    only_fp8 = "primitive_bitwidth == 8" in dot and "bfloat16" not in dot and "np.matmul" in dot
    read = SOURCE_READ[: SOURCE_READ.index("@") + 8]
    if stored and only_fp8:
        return True, f"as read at {read}; the installed interpreter's _get_np_dtype and create_dot say the same"
    return False, f"installed interpreter: bf16 stored as uint16: {stored}; create_dot converts only 8-bit floats: {only_fp8}"


@claims(
    "a bf16 attention forward with two tl.dot under the interpreter is finite but far off, and probe flags it",
    evidence=UPSTREAM_CPU,
)
def _probe_flags_it(results):
    raw = _row(results, REPRODUCTION)
    others = [_row(results, REPRODUCTION, dtype) for dtype in ("float32", "float16")]
    out = raw["errors"]["out"]
    holds = raw["real_finite"] and not raw["real_within_bound"] and all(r["real_within_bound"] for r in others)
    return (
        holds,
        f"bf16 REAL rows finite, out error {_decade(out['error'])} vs bound {_decade(out['bound'])}; fp32 and fp16 within bound",
    )


@claims("compiled natively on a GPU, Triton's bf16 tl.dot is correct: the bug is the interpreter's alone", evidence=UPSTREAM_GPU)
def _native_is_right(results):
    runs = [(r["provenance"], r["results"]["native"]) for r in results.gpu if r["results"].get("native")]
    if results.native is not None:
        runs.append(({"device": "this machine", "date": "now"}, results.native))
    if not runs:
        return (
            False,
            f"no native run: record one with `workbench repro {META.id} --device cuda --record data/gpu/{META.id}-<gpu>.json`",
        )
    right = [
        p for p, native in runs if native["detector"]["checks"]["bfloat16"]["correct"] and not native["detector"]["interpreted"]
    ]
    where = "; ".join(f"{p['device']} ({p['date'][:10]})" for p, _ in runs)
    return len(right) == len(runs), f"{len(right)}/{len(runs)} native runs correct in bf16: {where}"


@claims("our kernels are within the bound of the oracle in bf16 under the interpreter", evidence=OURS)
def _ours_within_bound(results):
    fixed, workaround = _row(results, FIXED), _row(results, WORKAROUND)
    within = [name for name, e in fixed["errors"].items() if e["error"] <= e["bound"]]
    holds = fixed["real_within_bound"] and fixed["padding_exactly_zero"] and workaround["real_within_bound"]
    return holds, f"fixed kernel: {', '.join(within)} within bound, padding exactly 0; reproduction + upcast: out within bound"


@claims("the detector's answer matches the observed behaviour", evidence=OURS)
def _detector_matches(results):
    run = results.interpreter["detector"]
    observed = not run["checks"]["bfloat16"]["correct"] and not _row(results, REPRODUCTION)["real_within_bound"]
    holds = run["bf16_dot_is_broken"] == observed
    evidence = f"interpreter: detector says broken={run['bf16_dot_is_broken']}, dot and attention observed broken={observed}"
    native = results.native
    if native is not None:
        native_observed = not native["detector"]["checks"]["bfloat16"]["correct"]
        holds = holds and native["detector"]["bf16_dot_is_broken"] is False and not native_observed
        evidence += f"; native: detector says broken=False, observed broken={native_observed}"
    return holds, evidence


@claims("natively the workaround is compiled out: bf16 operands reach the tensor cores", evidence=OURS)
def _compiled_out(results):
    off, on = results.compiled["off"], results.compiled["on"]
    holds = off["operand_type"] == "bf16" and off["conversions"] == 0 and any("bf16" in op for op in off["mma"])
    holds = holds and on["conversions"] == 2 and not on["mma"]  # the contrast: the flag really changes code
    native = results.native
    if native is not None:
        holds = holds and native["detector"]["bf16_dot_is_broken"] is False
    return holds, f"sm_{off['arch']}, flag off: {' '.join(off['mma'])}, 0 conversions; flag on: {on['fma']} scalar FMAs, no mma"


if __name__ == "__main__":  # the child process of `run_interpreted`: the interpreter's study as JSON
    json.dump(study(), sys.stdout)
