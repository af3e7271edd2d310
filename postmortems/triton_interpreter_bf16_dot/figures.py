"""The tables and figures of the triton-interpreter-bf16-dot notebook."""

from __future__ import annotations

from varlen_workbench.postmortems.triton_interpreter_bf16_dot.cases import FIXED, REPRODUCTION, WORKAROUND
from varlen_workbench.postmortems.triton_interpreter_bf16_dot.study import StudyResults, _recorded, _row, _runs
from varlen_workbench.workbench.postmortem import (
    figure,
    table,
)


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
    from varlen_workbench.kernels.interpreter import RELATIVE_TOLERANCE

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
