"""What TransformerEngine itself showed on the GPU, read from its records for the page's tables and claims.

The records (data/gpu/, each with provenance: GPU, versions, commit, date, command):

    te-thd-2892-cases-<gpu>.json     scripts/te_thd_cases.py: the report's script, and every recipe x boundaries
    te-thd-2892-training-<gpu>.json  scripts/te_thd_training.py: the toy trained through TE's attention
    te-thd-2892-probes-<gpu>.json    scripts/te_probes.py: the audit FAIL's variants, determinism, TE's FP8 Linear, initcheck
    audit-te.json, audit-te-fp8.json scripts/gpu_audit_matrix.py: the audit matrix's rows for TE

`te_record(kind)` gives the newest of a kind, or raises `NotRecorded` naming the command that makes
it, so a claim about it shows NOT RECORDED rather than vanishing.
"""

from __future__ import annotations

from typing import Any

from postmortems.te_thd_2892.te_probes import scale_damage
from workbench.postmortem import NotRecorded, table
from workbench.records import load_records

COMMANDS = {
    "cases": "python3 scripts/te_thd_cases.py --record $OUT/te-thd-2892-cases-<gpu>.json",
    "training": "python3 scripts/te_thd_training.py --record $OUT/te-thd-2892-training-<gpu>.json",
    "probes": "python3 scripts/te_probes.py --record $OUT/te-thd-2892-probes-<gpu>.json",
}
RUNBOOK = "docs/gpu-transformer-engine.md"


def te_record(kind: str, part: str | None = None) -> dict[str, Any]:
    """The newest (provenance date) whole record of `kind` ('cases', 'training', 'probes'); with
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
    versions = next((r["versions"] for r in record.get("case_runs", []) if "versions" in r), {})
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
    """The toy trained through TE's attention and through the replica: final loss and held-out
    perplexity (judged with the correct boundaries), the boundaries kept apart and made identical."""
    record = te_record("training")
    runs: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    errors = []
    for run in record["runs"]:
        if "error" in run:
            errors.append(f"{run['attention']} {run['objective']}: {run['error'].split('.')[0]}")
            continue
        runs.setdefault((run["attention"], run["objective"]), {})[run["boundaries"]] = run
    rows = []
    for (attention, objective), pair in runs.items():
        apart, same = pair["separate"], pair["identical"]
        rows.append(
            (
                attention,
                objective,
                f"{apart['eval_perplexity']:.3f}",
                f"{same['eval_perplexity']:.3f}",
                "identical" if apart["losses"] == same["losses"] else f"{same['final_loss'] - apart['final_loss']:+.3f}",
            )
        )
    title = f"Toy training, held-out perplexity ({made(record)})"
    if errors:
        title += "; not run: " + "; ".join(errors)
    return table(
        ("attention", "objective", "boundaries apart", "identical (VERL)", "final loss, identical - apart"), rows, title=title
    )


def probes() -> dict[str, Any]:
    return te_record("probes")


def gemm_te_table():
    """TE's Linear on the report's packed shapes under each FP8 recipe: REAL rows' relative error
    of y and dW against fp64, padding rows zero, normal or large."""
    record = te_record("probes")
    rows = record["gemm"][0].get("result") or []
    damage = scale_damage(rows)
    body = []
    for r in rows:
        if "error" in r:
            body.append((r["name"], r["fill"], "-", "-", r["error"][:80]))
        else:
            body.append((r["name"], r["fill"], r["y_real_error"], r["dw_error"], f"{damage.get(r['name'], float('nan')):.2f}x"))
    return table(
        ("recipe", "padding", "y error (REAL rows)", "dW error", "large / zero padding"),
        body,
        title=f"TE's Linear, FP8 scales and padding rows ({made(record)})",
    )
