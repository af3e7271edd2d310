"""The tables and figures of the flash-dmattn-flex-mask notebook."""

from __future__ import annotations

from varlen_workbench.postmortems.flash_dmattn_flex_mask.cases import _RATIO, AUDITED, IMPLS, STUDY
from varlen_workbench.postmortems.flash_dmattn_flex_mask.study import Results, _short
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.postmortem import (
    figure,
    table,
)


def cases_table(r: Results, impls: tuple[str, ...] = IMPLS[:1]):
    """Per audited case and implementation: out error in units of PyTorch's own, rows right."""
    rows = []
    for check in AUDITED:
        recorded = r.recorded.get(check, {}).get("ratios", {}).get("out")
        for name in impls:
            if check not in r.runs[name]:
                continue
            run = r.run(name, check)
            rows.append(
                (
                    check,
                    run.case.label(),
                    name,
                    run.ratios["out"],
                    "yes" if run.within else "NO",
                    f"{sum(run.rows_right)}/{len(run.rows_right)}",
                    recorded if name == IMPLS[0] and recorded is not None else "",
                )
            )
    where = "CPU, forward" if r.device == "cpu" else f"{r.device}, forward+backward"
    return table(
        ("audit check", "case", "implementation", "out error / PyTorch's", "within bound", "real rows right", "H200 record"),
        rows,
        title=f"each failing case of the H200 audit, re-run ({where}); H200 record: out error / PyTorch's recorded there",
        fold=18,
    )


def weights_figure(r: Results):
    """Per batch item: the mask passed, the weights flex_dmattn_func applied, the weights with workaround (a)."""
    w = r.weights
    mask, applied, fixed = w["mask"], w["weights"], w["weights with the bias workaround"]
    lens = STUDY.real_lengths("q")
    fig, axes = figure(3, len(lens), width=7.2, height=2.3)
    labels = (
        "attn_mask passed\n(black: may attend)",
        "weights applied by\nflex_dmattn_func",
        "weights with (a):\nmask as -inf bias",
    )
    for b, n in enumerate(lens):
        for row, (image, cmap) in enumerate(((mask[b].float(), "Greys"), (applied[b], "Blues"), (fixed[b], "Blues"))):
            ax = axes[row, b]
            ax.grid(False)
            shown = ax.imshow(image[:n].numpy(), cmap=cmap, vmin=0, vmax=1, aspect="auto")
            if n < image.shape[-1]:
                ax.axvline(n - 0.5, color="#d1495b", linewidth=1.2, linestyle="--")
            ax.set_xticks(range(image.shape[-1]))
            ax.set_yticks(range(n))
            ax.tick_params(labelsize=7)
            if row == 0:
                ax.set_title(f"item {b}: {n} real tokens", fontsize=9)
            if b == 0:
                ax.set_ylabel(f"{labels[row]}\nquery row", fontsize=8)
            if row == 2:
                ax.set_xlabel("key (dashed: end of real keys)", fontsize=8)
    fig.colorbar(shown, ax=axes[1:, -1].tolist(), shrink=0.8, label="attention weight")
    fig.suptitle(f"{STUDY.with_(dtype='float32').label()}, padded to 7: the mask is dropped, padded keys get weight", fontsize=10)
    return fig


def row_error_figure(r: Results):
    """Per real query row of each audited case: out error over the bound, as-is and with workaround (a)."""
    checks = list(AUDITED)
    fig, axes = figure(1, 2, width=7.6, height=3.0, sharey=True)
    for ax, name in zip(axes[0], IMPLS[:2]):
        for i, check in enumerate(checks):
            run = r.run(name, check)
            errors = [max(e, 1e-3) for e in run.row_errors]
            colours = ["#3a9d5d" if ok else "#d1495b" for ok in run.rows_right]
            ax.scatter([i] * len(errors), errors, c=colours, s=14, alpha=0.8, edgecolors="none")
        ax.axhline(1.0, color="#1f2328", linewidth=0.9, linestyle="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(checks)), [c.replace("fuzz:", "fuzz\n").replace("-", "-\n", 1) for c in checks], fontsize=6.5)
        ax.set_title(name, fontsize=9)
    axes[0, 0].set_ylabel("out error of a real row / bound\n(dashed: the bound)", fontsize=8)
    fig.suptitle(
        "every real query row of the audited cases (green: within the bound, red: over it; below 1e-3 drawn at 1e-3)", fontsize=9
    )
    return fig


def workaround_table(r: Results, impl: str):
    """One implementation over the audited cases: the largest error / PyTorch's over the tensors it
    computed (out; and dq, dk, dv where the backward ran), within bound, real query rows right."""
    runs = r.runs[impl]
    backward = all(x.backward for x in runs.values())
    return table(
        (
            "audit check",
            "case",
            f"worst error / PyTorch's ({', '.join(next(iter(runs.values())).ratios)})",
            "within bound",
            "real rows right",
        ),
        [
            (
                check,
                x.case.label(),
                max(x.ratios.values()),
                "yes" if x.within else "NO",
                f"{sum(x.rows_right)}/{len(x.rows_right)}",
            )
            for check, x in runs.items()
        ],
        title=f"{impl}: {'CPU' if r.device == 'cpu' else r.device}, {'forward+backward' if backward else 'forward'}",
    )


def mask_effect_table(r: Results):
    return table(
        ("attn_mask passed", "keys kept", "output bit-identical to all-ones", "max error vs the fp64 answer with that mask"),
        [(x["mask"], x["kept keys"], x["identical to all-ones"], x["max error vs that mask"]) for x in r.mask_effect["rows"]],
        title=f"flex_dmattn_func on {STUDY.with_(dtype='float32').label()} padded to 7, is_causal=False",
    )


def audit_table(r: Results):
    """The H200 record, check by check: verdict and the ratios it recorded."""
    rows = []
    for check in r.audit["checks"]:
        ratios = dict(_RATIO.findall(check["evidence"]))
        shown = ", ".join(f"{t} {float(x):.3g}x" for t, x in ratios.items()) or _short(check["evidence"])
        rows.append((check["name"], check["verdict"], Case(**check["cases"][0]).label() if check["cases"] else "", shown))
    fuzz = r.audit["fuzz"]
    for failure in fuzz["failures"]:
        ratios = ", ".join(f"{t} {float(x):.3g}x" for t, x in _RATIO.findall(failure["evidence"]))
        rows.append(
            (
                f"fuzz:{failure['check']}",
                f"{fuzz['failing_layouts']}/{fuzz['tried']} layouts",
                Case(**failure["case"]).label(),
                ratios,
            )
        )
    prov = r.audit["provenance"]
    return table(
        ("check", "verdict", "first failing case", "recorded (error / PyTorch's own)"),
        rows,
        title=f"{r.audit['file']}: {prov['device']}, torch {prov['torch']}, triton {prov['triton']}, {r.audit['dtype']}, commit {prov['commit']}",
        fold=16,
    )
