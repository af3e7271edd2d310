"""What TransformerEngine itself showed on the GPU, read from its records for the page's tables and claims.

The records (data/gpu/, each with provenance: GPU, versions, commit, date, command):

    te-thd-2892-cases-<gpu>.json     scripts/te_thd_cases.py: the report's script, and every recipe x boundaries
    te-thd-2892-training-<gpu>.json  scripts/te_thd_training.py: the toy trained through TE's attention
    te-thd-2892-probes-<gpu>.json    scripts/te_probes.py: the audit FAIL's variants, determinism, TE's FP8 Linear, initcheck
    te-thd-2892-seqpar-<gpu>.json    scripts/te_seqpar.py: TE's sequence-parallel block on two GPUs against one
    audit-te.json, audit-te-fp8.json scripts/gpu_audit_matrix.py: the audit matrix's rows for TE

`te_record(kind)` gives the newest of a kind, or raises `NotRecorded` naming the command that makes
it, so a claim about it shows NOT RECORDED rather than vanishing.
"""

from __future__ import annotations

from typing import Any

from varlen_workbench.workbench.postmortem import NotRecorded, table
from varlen_workbench.workbench.records import load_records, portable

COMMANDS = {
    "cases": "python3 scripts/te_thd_cases.py --record $OUT/te-thd-2892-cases-<gpu>.json",
    "training": "python3 scripts/te_thd_training.py --record $OUT/te-thd-2892-training-<gpu>.json",
    "probes": "python3 scripts/te_probes.py --record $OUT/te-thd-2892-probes-<gpu>.json",
    "seqpar": "python3 scripts/te_seqpar.py --device cuda --record $OUT/te-thd-2892-seqpar-<gpu>.json",
}
RUNBOOK = "docs/gpu-transformer-engine.md"


def te_record(kind: str, part: str | None = None) -> dict[str, Any]:
    """The newest (provenance date) whole record of `kind` ('cases', 'training', 'probes', 'seqpar'); with
    `part`, the newest that holds it (scripts/te_probes.py records the parts it was asked for)."""
    if kind not in COMMANDS:
        raise ValueError(f"kind = {kind!r} must be one of {tuple(COMMANDS)}.")
    records = [r for r in load_records(f"te-thd-2892-{kind}-*.json") if not r.get("partial") and (part is None or r.get(part))]
    if not records:
        command = COMMANDS[kind] + (f" --parts {part}" if part else "")
        raise NotRecorded(
            f"no whole TE record of {kind}{f' ({part})' if part else ''}: make one on the GPU with `{command}` ({RUNBOOK})"
        )
    return max(records, key=lambda r: r["provenance"].get("date", ""))


def made(record: dict[str, Any]) -> str:
    """'NVIDIA H200, TE 2.20.2, 2026-12-07, commit 75f70e1': where and when a record was made."""
    p = record["provenance"]
    children = [*record.get("case_runs", []), *(rank for run in record.get("runs", []) for rank in run.get("ranks", []))]
    versions = next((r["versions"] for r in children if "versions" in r), {})
    te = f", TE {versions['transformer-engine']}, cuDNN {versions['cudnn']}" if versions else ""
    return f"{p['device']}{te}, {p['date'][:10]}, commit {p['commit']}"


def _backend(run: dict[str, Any]) -> str:
    chosen = run["backend"]["selected"] or run["backend"]["running"][:1]
    return ", ".join(chosen).replace("FusedAttention (sub-backend 1)", "fused, BF16 (cuDNN)") or "none named"


def _tensors(measured: dict[str, Any] | None) -> str:
    """'out dq dk dv' with each off the bound in capitals: 'out dq DK DV'."""
    if not measured or "tensors" not in measured:
        return (measured or {}).get("error", "not run")[:60]
    return " ".join(n if t["within"] else n.upper() for n, t in measured["tensors"].items())


def script_runs() -> list[dict[str, Any]]:
    return te_record("cases")["script_runs"]


def script_table():
    """The report's script on TE: as written, then with each slip mended in turn."""
    record = te_record("cases")
    rows = []
    for run in record["script_runs"]:
        mended = ", ".join(run["mended"]) or "none (as written)"
        ended = "exit 0" if run.get("code") == 0 else f"{run['outcome']} {run.get('signal') or run.get('code')}"
        said = f"line {run['line']}: {run['error']}" if run.get("error") else "ran both calls"
        rows.append((mended, ended, said))
    return table(("slips mended", "ended", "what stopped it"), rows, title=f"The report's script on TE ({made(record)})")


def case_runs() -> dict[str, dict[str, Any]]:
    return {run["case"]: run for run in te_record("cases")["case_runs"]}


def cases_table():
    """Every recipe x boundaries on the report's shapes: TE's backend, its output's shape, which of
    out, dq, dk, dv keep REAL rows within the bound (capitals: off it), padding rows."""
    record = te_record("cases")
    rows = []
    for run in record["case_runs"]:
        contract = run.get("contract")
        if contract is None or contract.get("ran") == "nothing":
            error = (contract or run).get("error", "")
            rows.append((run["case"], "none", "-", error.split(":")[0] + ": " + _why_refused(run), "-", "-"))
            continue
        shape = " x ".join(map(str, run["te_output_shapes"][0])) if run["te_output_shapes"] else "-"
        real_grad = _tensors(run.get("contract_real_rows_grad")) if "contract_real_rows_grad" in run else "(same)"
        rows.append(
            (
                run["case"],
                _backend(run),
                shape,
                _tensors(contract),
                real_grad,
                "0" if contract.get("padding_exactly_zero") else "values",
            )
        )
    header = ("recipe:boundaries", "TE's backend", "TE's output", "REAL rows in bound", "dO zero on padding", "padding rows")
    return table(header, rows, title=f"The report's cases on TE, judged by the real boundaries ({made(record)})", fold=8)


def _why_refused(run: dict[str, Any]) -> str:
    """TE's own reason, from its debug log's 'Disabling' lines, for the fused backend."""
    disabled = [line for line in run["backend"]["disabled"] if "FusedAttention" in line]
    if disabled:
        return disabled[0].replace("Disabling FusedAttention", "fused").strip(": ")
    if run.get("stage") == "recipe":  # the recipe object itself refused its arguments
        return f"{run['recipe']} refused when built"
    return (run.get("error") or "").split(":", 1)[-1].strip()[:80]


def training_runs() -> list[dict[str, Any]]:
    return te_record("training")["runs"]


def training_te_table():
    """The toy trained through TE's attention and through the replica: held-out perplexity (judged
    with the correct boundaries), the boundaries kept apart and made identical; a run that raised
    says what it raised."""
    record = te_record("training")
    runs: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    rows = []
    for run in record["runs"]:
        if "error" in run:
            rows.append((run["attention"], run["objective"], "not run", "not run", run["error"].split(". ")[0]))
            continue
        runs.setdefault((run["attention"], run["objective"]), {})[run["boundaries"]] = run
    for (attention, objective), pair in runs.items():
        apart, same = pair["separate"], pair["identical"]
        gap = "identical" if apart["losses"] == same["losses"] else f"{same['final_loss'] - apart['final_loss']:+.3f}"
        rows.append((attention, objective, f"{apart['eval_perplexity']:.3f}", f"{same['eval_perplexity']:.3f}", gap))
    rows.sort(key=lambda row: row[2] == "not run")
    header = ("attention", "objective", "boundaries apart", "identical (VERL)", "final loss, identical - apart")
    return table(header, rows, title=f"Toy training, held-out perplexity ({made(record)})")


def gemm_rows() -> list[dict[str, Any]]:
    return te_record("probes", "gemm")["gemm"][0].get("result") or []


def gemm_te_table():
    """TE's Linear on the report's packed shapes under each FP8 recipe: the REAL rows' relative
    error of y and dW against fp64, with padding rows zero, normal or large."""
    record = te_record("probes", "gemm")
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in gemm_rows():
        by.setdefault(r["name"], {})[r["fill"]] = r
    body = []
    for name, fills in by.items():
        if any("error" in r for r in fills.values()):
            body.append((name, next(r["error"] for r in fills.values() if "error" in r)[:60], "", ""))
            continue
        y = " / ".join(f"{fills[f]['y_real_error']:.3g}" for f in fills)
        dw = " / ".join(f"{fills[f]['dw_error']:.3g}" for f in fills)
        body.append((name, y, dw, f"{fills['large']['y_real_error'] / fills['zeros']['y_real_error']:.2f}x"))
    fills = " / ".join(next(iter(by.values())))
    header = ("recipe", f"y error, padding {fills}", f"dW error, padding {fills}", "y: large / zero padding")
    return table(header, body, title=f"TE's Linear: REAL-row error against fp64 ({made(record)})")


def variants_table():
    """The audit row te's smallest failing fuzz layout, one thing changed at a time: what TE's
    backward leaves in dk and dv of REAL rows (NaN-poisoned memory)."""
    record = te_record("probes", "variants")
    rows = []
    for run in record["variants"]:
        case = run["case"]
        found = (run.get("result") or {}).get("findings")
        said = "; ".join(f["evidence"] for f in found) if found else ("clean" if found == [] else run["outcome"])
        heads = f"{case['heads']}/{case['kv_heads'] or case['heads']}"
        rows.append((run["variant"], f"q={case['seqlens_q']} k={case['seqlens_k']}", heads, case["dtype"], said))
    return table(
        ("variant", "lengths", "heads q/kv", "dtype", "REAL rows of dk, dv"),
        rows,
        title=f"TE's backward on empty sequences ({made(record)})",
    )


def initcheck_table():
    """compute-sanitizer's initcheck on the row te's forward + backward, layout by layout."""
    record = te_record("probes", "initcheck")
    rows = []
    for run in record["initcheck"]:
        case = run["case"]
        kernel = run["first"].split(" at ")[-1].split("(")[0].split("<")[0].removeprefix("void ") if run["first"] else "-"
        rows.append((run["layout"], f"q={case['seqlens_q']} k={case['seqlens_k']}", run["errors"], kernel))
    return table(("layout", "lengths", "uninitialised reads", "first in"), rows, title=f"initcheck on TE ({made(record)})")


def seqpar_runs() -> list[dict[str, Any]]:
    return te_record("seqpar")["runs"]


# The claim the page makes once TE has run under sequence parallelism (a page claims what ran):
# its statement and its check, `seqpar_verdict`.
SEQPAR_CLAIM = (
    "TE 2.20.2 under sequence parallelism on two GPUs (tensor-parallel size 2, the report's shapes, BF16 and "
    "DelayedScaling GEMMs, boundaries different and VERL's equal): each rank's column-parallel Linear gathers "
    "cu_seqlens_padded[-1] = 544 rows, not cu_seqlens[-1] = 500; attention and the row-parallel Linear get all 544; "
    "REAL rows of the output and of the input and weight gradients are within the bound of the same block on one GPU"
)


def seqpar_verdict() -> tuple[bool, str]:
    """SEQPAR_CLAIM checked on the newest two-GPU record: made on CUDA, every configuration of
    seqpar_te.SP_CASES run, every child exited 0, each rank's gather of the padded rows, attention
    and the row-parallel Linear given them, every judged tensor within its bound."""
    from varlen_workbench.postmortems.te_thd_2892.seqpar_te import SP_CASES, TP
    from varlen_workbench.postmortems.te_thd_2892.upstream import REPORT_CASE

    record = te_record("seqpar")
    runs = record["runs"]
    layout, real = sum(REPORT_CASE.padded_lengths("q")), sum(REPORT_CASE.real_lengths("q"))
    holds = record["config"]["device"] == "cuda" and [run["case"] for run in runs] == [c.name for c in SP_CASES]
    holds &= all(child.get("code") == 0 for run in runs for child in [*run["ranks"], run["reference"]])
    holds &= all((run["layout_rows"], run["real_rows"]) == (layout, real) for run in runs)
    holds &= all(
        run["gathered_rows"] == [[layout]] * TP and run["padded_downstream"] and run["real_within_bound"] for run in runs
    )
    judged = [t for run in runs for t in (run["tensors"] or {}).values() if "bound" in t]
    worst = max((t["real_error"] / t["bound"] for t in judged), default=float("nan"))
    gathered = sorted({rows for run in runs for ranks in run["gathered_rows"] for rows in (ranks or [None])}, key=str)
    return holds, f"{len(runs)} configurations; rows gathered {gathered}; worst {worst:.2f} of the bound ({made(record)})"


def seqpar_table():
    """TE's sequence-parallel block on two GPUs: how the ranks ended, the rows each rank's
    column-parallel Linear gathered, whether attention and the row-parallel Linear got the padded
    rows, which tensors keep REAL rows within the one-GPU block's bound (capitals: off it)."""
    record = te_record("seqpar")
    rows = []
    for run in record["runs"]:
        ended = ", ".join(f"{r['outcome']} {r.get('signal') or r.get('code')}" for r in run["ranks"])
        gathered = " / ".join("-" if g is None else " ".join(map(str, g)) for g in run["gathered_rows"])
        tensors = run["tensors"]
        if tensors is None:
            said = (
                next((r["error"] for r in run["ranks"] if r.get("error")), None) or f"stopped at {run['ranks'][0].get('reached')}"
            )
            judged = said[:60]
        else:
            judged = " ".join(n if t.get("within") else n.upper() for n, t in tensors.items())
        layout = f"{run['layout_rows']} ({run['real_rows']} real)"
        rows.append((run["case"], ended, gathered, layout, "yes" if run["padded_downstream"] else "no", judged))
    header = (
        "recipe:boundaries",
        "ranks ended",
        "rows gathered, per rank",
        "layout rows",
        "padded downstream",
        "REAL rows in bound",
    )
    return table(header, rows, title=f"TE's sequence-parallel block, 2 ranks against 1 ({made(record)})")


def records_table():
    """Every GPU record of this page: what made it, on which GPU, when, at which commit."""
    from varlen_workbench.workbench.audit.matrix import RECORD_COMMAND

    rows = []
    for pattern in (
        "te-probe-*.json",
        "te-install-*.json",
        "te-reuse-*.json",
        "te-thd-2892-*.json",
        "audit-te*.json",
        "sanitizer-te*.json",
    ):
        for record in load_records(pattern):
            p = record["provenance"]
            command = p.get("command") or f"{RECORD_COMMAND} --rows te,te-fp8"  # the matrix's records name no command
            rows.append((record["file"], p["device"], p["date"][:16], p["commit"], portable(command.split(" --record")[0])))
    return table(("record (data/gpu/)", "GPU", "made (UTC)", "commit", "command"), rows, title="This page's GPU records")


def plot_te_training():
    """Per training step, the toy's loss with VERL's identical boundaries minus its loss with them
    kept apart: causal and bidirectional, through TE's attention and through the replica."""
    import matplotlib

    from varlen_workbench.workbench.plots import INK, SERIES, STYLE
    from varlen_workbench.workbench.postmortem import figure

    record = te_record("training")
    runs = {(r["attention"], r["objective"], r["boundaries"]): r["losses"] for r in record["runs"] if "losses" in r}
    fig, axes = figure(1, 1, width=6.5, height=3.4)
    ax = axes[0, 0]
    with matplotlib.rc_context(STYLE):
        for k, attention in enumerate(dict.fromkeys(a for a, _, _ in runs)):
            for objective, style in (("causal", ":"), ("bidirectional", "-")):
                apart, same = runs[attention, objective, "separate"], runs[attention, objective, "identical"]
                gap = [b - a for a, b in zip(apart, same)]
                ax.plot(gap, color=SERIES[k], ls=style, lw=1.5, label=f"{attention}, {objective}")
        ax.axhline(0.0, color=INK, lw=0.8)
        ax.set_xlabel("training step")
        ax.set_ylabel("loss: identical - apart")
        fig.legend(fontsize=8, frameon=False, ncol=4, loc="outside lower center")
        ax.set_title(f"VERL's boundaries, per step ({made(record)})", loc="left", fontsize=9)
    return fig
