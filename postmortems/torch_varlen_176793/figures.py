"""The tables and figures of the torch-varlen-176793 notebook."""

from __future__ import annotations

import math
from typing import Any

from varlen_workbench.postmortems.torch_varlen_176793.cases import GRADS
from varlen_workbench.workbench.postmortem import table


def workaround_table(points: list[dict[str, Any]]):
    def verdict(p):
        if "error" in p:
            return p["error"][:70]
        if p["tail_nonfinite"]:
            return f"{p['tail_nonfinite']} non-finite"
        return "exactly 0" if p["tail_zero"] else f"finite, max |x| {p['tail_max_abs']:.3g}"

    rows = [
        (p["workaround"], p["loss"], verdict(p), "" if "error" in p else ("yes" if p["real_within_bound"] else "NO"))
        for p in points
    ]
    return table(("workaround", "loss reads", "TAIL rows of out, dq, dk, dv", "REAL rows within bound"), rows)


def capture_table(compile_: dict[str, dict[str, Any]], graphs: dict[str, dict[str, Any]] | None = None):
    """torch.compile(fullgraph=True) (and, from a GPU record, CUDA-graph capture) per subject."""

    def outcome(o: dict[str, Any] | None, ok: str) -> str:
        if o is None:
            return "not run"
        return ok if o["ok"] else o["error"].split(":")[0]

    rows = [(name, outcome(o, "compiles"), outcome((graphs or {}).get(name), "captured")) for name, o in compile_.items()]
    return table(("subject", "torch.compile(fullgraph=True)", "CUDA graph capture"), rows)


def gpu_points_table(record: dict[str, Any]):
    """One row per (memory, pad, impl) of a GPU record: non-finite counts and peak |x| in TAIL
    rows of out/dq/dk/dv, REAL rows against the fp64 oracle, and the REAL-row gap to our kernel."""
    points = record["probes"]["points"]
    agreement = {
        (p["pad"], p["poisoned"], p["impl"].split(" vs ")[0]): p["real_max_abs_diff"] for p in points if " vs " in p["impl"]
    }
    rows = []
    for p in points:
        if " vs " in p["impl"]:
            continue
        memory = "poisoned" if p["poisoned"] else "as left"
        if "error" in p:
            rows.append((memory, p["pad"], p["impl"], p["error"][:60], "", "", ""))
            continue
        counts = "/".join(str(p["nonfinite"][t]["TAIL"]) for t in ("out",) + GRADS)
        peak = max((p["max_abs"][t]["TAIL"] for t in p["max_abs"]), key=lambda x: math.inf if x != x else x)
        diff = agreement.get((p["pad"], p["poisoned"], p["impl"]))
        gap = "" if diff is None else max(diff.values(), key=lambda x: math.inf if x != x else x)
        rows.append((memory, p["pad"], p["impl"], counts, peak, "within" if p["real_within_bound"] else "OUTSIDE", gap))
    return table(
        ("memory", "trailing rows", "impl", "TAIL non-finite out/dq/dk/dv", "TAIL max |x|", "REAL vs fp64", "REAL vs fixed"),
        rows,
        fold=10,
    )


def gpu_workaround_table(record: dict[str, Any]):
    """The workarounds on torch's varlen_attn (GPU): correctness under poisoning and time."""
    probes = record["probes"]
    timing = {t["workaround"]: t for t in probes["timing"]}
    rows = []
    for p in probes["workarounds"]:
        if p["loss"] != "loss mask":
            continue
        t = timing.get(p["workaround"], {})
        rows.append(
            (
                p["workaround"],
                p.get("error", "exactly 0" if p.get("tail_zero") else f"{p.get('tail_nonfinite')} non-finite")[:60],
                "yes" if p.get("real_within_bound") else "no",
                t.get("ms", math.nan),
                t.get("vs_as_is", math.nan),
            )
        )
    return table(("workaround (loss mask)", "TAIL rows, poisoned", "REAL within bound", "fwd+bwd ms", "time / as is"), rows)
