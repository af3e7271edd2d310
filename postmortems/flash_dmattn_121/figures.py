"""The tables and figures of the flash-dmattn-121 notebook."""

from __future__ import annotations

import math

import matplotlib
import matplotlib.colors
import torch

from varlen_workbench.postmortems.flash_dmattn_121.cases import (
    GRADS,
    REPLICA_CASES,
    SEED,
    SHOWN_VARIANTS,
    SWEEP_DENSITIES,
    SWEEP_SEQLENS,
    TENSORS,
    TRAIN_SEQLEN,
    UPSTREAM_CASES,
    UPSTREAM_TENSORS,
    MaskCase,
    recorded,
    shown_name,
)
from varlen_workbench.postmortems.flash_dmattn_121.study import (
    UPSTREAM_BLOCK_N,
    Results,
    UpstreamRun,
    observed_upstream_nan_rows,
    oracle,
    train_health,
)
from varlen_workbench.postmortems.flash_dmattn_121.upstream import SUCCESSOR_VERSION
from varlen_workbench.workbench.plots import plot_health  # importing plots also lets a cell ending with a Figure show it
from varlen_workbench.workbench.postmortem import (
    figure,
    table,
)


def plot_training(pad: int, device=None):
    """Per-parameter gradient norms over training, the three variants side by side (an explorer frame)."""
    runs = train_health(pad, None if device is None else str(device))
    return plot_health(
        {v: runs[v] for v in SHOWN_VARIANTS}, title=f"batch item 1 left-padded by {pad} of {TRAIN_SEQLEN} tokens (causal)"
    )


def worst_ratio(ratios) -> float:
    """The largest error ratio, NaN if any is NaN (a non-finite tensor has no error to compare)."""
    ratios = list(ratios)
    return math.nan if any(x != x for x in ratios) else max(ratios)


def ratio_text(x: float) -> str:
    return "NaN" if x != x else f"{x:.2f}"


def upstream_table(results: Results):
    """1.2.2's Triton kernel per case: non-finite entries of each tensor, and its worst error in units of the bound."""
    rows = []
    for r in results.upstream.values():
        worst = worst_ratio(r.error_ratio(n) for n in UPSTREAM_TENSORS)
        rows.append([r.case.name, *(f"{r.nonfinite(n)}/{r.tensors[n].numel()}" for n in UPSTREAM_TENSORS), ratio_text(worst)])
    return table(
        ["case", *(f"bad {n}" for n in UPSTREAM_TENSORS), "err/bound"],
        rows,
        title=f"flash-dmattn {results.upstream_version}, {results.upstream_dtype}",
    )


def patch_table(results: Results):
    """The patch (replica) on each failing case: what it made finite, what it left, and how wrong the finite ones are."""
    rows = []
    for case in results.failing():
        buggy, patched = results.get(case, "replica"), results.get(case, "patch")
        fixed = [n for n in TENSORS if not buggy.finite(n) and patched.finite(n)]
        left = [n for n in TENSORS if not patched.finite(n)]
        rows.append(
            [
                case.name,
                ", ".join(fixed) or "-",
                ", ".join(left) or "-",
                *(f"{patched.error_ratio(g):.0f}x" for g in ("dk", "dv")),
            ]
        )
    return table(["failing case", "made finite", "still non-finite", "dK err/bound", "dV err/bound"], rows)


def nan_do_table(results: Results):
    """NaN in one row of dO: non-finite gradient entries from autograd (oracle), the replica and the patch."""
    rows = [["fp64 oracle (autograd)", *(results.nan_do_oracle_nonfinite[g] for g in GRADS)]]
    rows += [[v, *(r.nonfinite(g) for g in GRADS)] for v, r in results.nan_do.items()]
    return table(["", *(f"bad {g}" for g in GRADS)], rows)


def coverage_table(results: Results):
    return table(
        ["case (1.2.2)", "NaN-filled memory changes no bit", "gradients finite"],
        [[c.case, c.identical, c.finite] for c in results.coverage],
    )


def gpu_table(record: dict):
    """The GPU record's upstream cases: 1.2.2 natively in bf16."""
    rows = []
    for name, r in record["probes"]["cases"].items():
        name = shown_name(name)
        if not r["ok"]:
            rows.append([name, r["error"], "", "", "", ""])
            continue
        worst = worst_ratio(r["error_over_bound"].values())
        rows.append([name, *(f"{r['nonfinite'][n]}/{r['numel'][n]}" for n in UPSTREAM_TENSORS), ratio_text(worst)])
    return table(["case", *(f"bad {n}" for n in UPSTREAM_TENSORS), "err/bound"], rows)


def _successor_cell(results: Results, case_name: str) -> str:
    """What the GPU record says flash-sparse-attn's dense kernel did on one case (it needs CUDA)."""
    if results.gpu is None:
        return "no GPU record"
    successor = results.gpu["probes"]["successor"]
    run = recorded(successor, case_name) if successor.get("ok") else None
    if run is None:
        return "not run: " + successor.get("error", "no such probe")
    if not run["ok"]:
        return "raised " + run["error"]
    bad = [n for n, c in run["nonfinite"].items() if c]
    return f"NaN in {', '.join(bad)}" if bad else "finite (GPU, bf16)"


def report_claims_table(results: Results):
    """The report's claims, each checked on 1.2.2 (this run, and the GPU record) and on flash-sparse-attn 2.0.6."""
    seed, ragged = results.up(SEED), results.upstream[UPSTREAM_CASES[1].name]

    def state(run: UpstreamRun) -> str:
        bad = [n for n in UPSTREAM_TENSORS if not run.finite(n)]
        return f"NaN in {', '.join(bad)}" if bad else "finite, within bound" if run.all_within else "finite, outside the bound"

    gpu_seeds = "no GPU record"
    if results.gpu is not None:
        runs = results.gpu["probes"]["seed_config_seeds"]
        gpu_seeds = "; ".join(f"{k}: NaN in {s['nonfinite_runs']}/{s['runs']} seeds" for k, s in runs.items())
    coverage = all(c.identical and c.finite for c in results.coverage)
    rows = [
        [
            "the snippet runs",
            results.call_errors["the report's snippet as written"],
            "no triton_dmattn_func; import: " + results.successor_import,
        ],
        [
            "NaN in dV on 1x256x1x64, causal, bf16",
            f"no: {results.upstream_dtype} here {state(seed)}; H200 bf16 {gpu_seeds}",
            _successor_cell(results, SEED.name),
        ],
        [
            "only dV is NaN (dQ, dK, out, lse fine)",
            f"at 200 tokens: {state(ragged)}; dK with dV always",
            "at 200 tokens: " + _successor_cell(results, UPSTREAM_CASES[1].name),
        ],
        [
            "cause: empty_like dk/dv",
            "no: NaN-filled memory changes no bit" if coverage else "not shown",
            "not checked (other code)",
        ],
        ["fix: tl.where(tl.isfinite(x), x, 0)", "cannot compile; made to, hides the NaN (replica)", "not applicable (API gone)"],
    ]
    return table(["the report says", f"flash-dmattn {results.upstream_version}", f"flash-sparse-attn {SUCCESSOR_VERSION}"], rows)


def _draw_mask(ax, case: MaskCase, nan_rows: torch.Tensor, item: int = 0) -> None:
    """The mask of batch item `item` (dark = visible), 1.2.2's first key block, NaN rows in red."""
    n = case.seqlen
    mask = case.mask()
    visible = torch.ones(n, n, dtype=torch.bool) if mask is None else mask[item, 0].clone()
    if case.causal:
        visible &= torch.ones(n, n, dtype=torch.bool).tril()
    ax.imshow(
        visible.float().numpy(),
        cmap=matplotlib.colors.ListedColormap(["#ffffff", "#8c959f"]),
        vmin=0,
        vmax=1,
        interpolation="nearest",
        extent=(-0.5, n - 0.5, n - 0.5, -0.5),
    )
    rows = torch.nonzero(nan_rows).flatten().tolist()
    for r in rows:
        ax.axhspan(r - 0.5, r + 0.5, color="#d1495b", alpha=0.55, lw=0)
    if n > UPSTREAM_BLOCK_N:
        ax.axvline(UPSTREAM_BLOCK_N - 0.5, color="#2f6db5", lw=1.2, ls="--")
    ax.grid(False)
    ax.set_xlabel(f"key (dashed: end of key block 0, {UPSTREAM_BLOCK_N} keys)")
    ax.set_ylabel("query")
    ax.set_title(f"mask (grey = visible)\nred: {len(rows)} NaN output rows", fontsize=9)


def plot_mechanism(results: Results, case: MaskCase, item: int = 0):
    """Left: `case`'s mask with 1.2.2's NaN output rows. Right: per-key |dV| of the oracle and of 1.2.2, the patch (replica) and the workaround."""
    name = case.name
    up = results.upstream[name]
    fig, axes = figure(1, 2, width=10.5, height=4.0)
    left, right = axes[0]
    _draw_mask(left, up.case, observed_upstream_nan_rows(up)[item], item)
    ref = oracle(up.case, results.device)["oracle"]
    keys = torch.arange(case.seqlen)
    right.plot(keys, ref["dv"][item].double().norm(dim=(-2, -1)).cpu(), color="#1f2328", lw=2.2, label="fp64 oracle")
    dv = up.tensors["dv"][item].double().norm(dim=(-2, -1)).cpu()
    right.plot(
        keys,
        torch.nan_to_num(dv, nan=0.0),
        color="#d1495b",
        lw=0,
        marker="x",
        ms=3,
        label=f"1.2.2: {up.nan_rows('dv')} NaN rows (drawn at 0)",
    )
    replica = {c.name: c for c in REPLICA_CASES}
    if name in replica:
        patched = results.get(replica[name], "patch").tensors["dv"][item].double().norm(dim=(-2, -1)).cpu()
        right.plot(keys, patched, color="#e09f3e", lw=1.4, label="proposed patch (replica): finite, wrong")
    right.set_xlabel("key")
    right.set_ylabel("|dV| per key")
    right.set_title(f"dV per key, batch item {item}", fontsize=9)
    right.legend(loc="upper right", fontsize=8)
    fig.suptitle(name, x=0.01, ha="left", fontsize=10)
    return fig


def plot_sweep(results: Results):
    """NaN output rows of 1.2.2 on random masks: observed vs predicted by the first-key-block rule."""
    fig, axes = figure(1, 1, width=6.4, height=3.0)
    ax = axes[0, 0]
    records = [p for p in results.sweep.records if p["ok"]]
    positions = {d: i for i, d in enumerate(SWEEP_DENSITIES)}
    for k, (seqlen, marker) in enumerate(zip(SWEEP_SEQLENS, ("o", "s", "D"))):
        points = [p for p in records if p["seqlen"] == seqlen]
        x = [positions[p["density"]] + (k - 1) * 0.15 for p in points]
        ax.plot(x, [p["nan_rows"] for p in points], marker, ms=8, mfc="none", label=f"observed, Q=K={seqlen}")
        ax.plot(x, [p["predicted_nan_rows"] for p in points], "x", ms=6, color="#1f2328")
    ax.plot([], [], "x", color="#1f2328", label="predicted")
    ax.set_xticks(range(len(SWEEP_DENSITIES)), [f"{d:g}" for d in SWEEP_DENSITIES])
    ax.set_xlabel("mask density (fraction of (query, key) pairs kept)")
    ax.set_ylabel("NaN output rows")
    ax.set_title("flash-dmattn 1.2.2 on random masks", fontsize=10)
    ax.legend(fontsize=8)
    return fig
