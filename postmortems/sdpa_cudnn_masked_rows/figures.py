"""The tables and figures of the sdpa-cudnn-masked-rows notebook."""

from __future__ import annotations

from typing import Any

from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.cases import CASES, FULLY, TENSORS
from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.study import MaskedRowsResults, padded_inputs
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.postmortem import (
    figure,
    table,
)


def error_table(results: MaskedRowsResults, case: Case) -> Any:
    """Per tensor: the recorded cuDNN error on the H200 beside the replica's and the math backend's here."""
    label = case.label()
    rec = results.recorded[label]["sdpa-cudnn"]["errors"]
    rows = []
    for t in TENSORS:
        replica = results.probes[label]["cuDNN's mask on math (replica)"].errors[t]
        math = results.probes[label]["math backend"].errors[t]
        rows.append((t, rec[t][0], rec[t][2], replica.error, replica.ratio, math.error, replica.bound))
    return table(
        (
            "tensor",
            "cuDNN H200 error",
            "cuDNN / torch's own",
            "replica (CPU) error",
            "replica / torch's own",
            "math (CPU) error",
            "bound",
        ),
        rows,
        title=f"{label}: REAL rows against the fp64 oracle",
    )


def workaround_table(results: MaskedRowsResults, only: str = "") -> Any:
    """Each way out, per case: REAL rows within the bound, output of keyless rows, where it ran
    (`only`: the rows whose "how" starts with it, e.g. "(a)", plus the replica as is for contrast)."""
    rows = []
    for case in CASES:
        label = case.label()
        for name in ("cuDNN's mask on math (replica)", "(a) replica + zero rows without key", "math backend", "(d) our kernel"):
            r = results.probes[label][name]
            keyless = results.keyless[label]
            peak = float(r.tensors["out"][keyless].abs().max()) if keyless else 0.0
            where = f"{'our Triton kernel' if name.startswith('(d)') else 'torch math backend'}, {r.device}"
            rows.append((label, name, r.real_within_bound, peak, where))
        for row in ("sdpa-efficient", "sdpa-math"):
            rec = results.recorded[label][row]
            rows.append((label, f"(b) {row.split('-')[1]} backend", rec["verdict"] == "pass", "not recorded", "H200 record"))
    if only:
        rows = [r for r in rows if r[1].startswith(only) or (only != "(b)" and r[1].startswith("cuDNN's mask"))]
    return table(("case", "how", "REAL rows within bound", "max |out| on keyless rows", "evidence from"), rows, fold=16)


def mask_figure(case: Case = FULLY):
    """The boolean mask the audit passed, one panel per batch row (attention-gym style): allowed
    pairs dark, REAL query rows with no visible key outlined in red, padding slots blue."""
    from matplotlib.patches import Rectangle

    *_, mask = padded_inputs(case, "cpu")
    lq, lk = case.real_lengths("q"), case.real_lengths("k")
    fig, axes = figure(1, len(lq), width=2.2 * len(lq) + 0.6, height=2.7)
    for b, ax in enumerate(axes[0]):
        ax.grid(False)
        ax.imshow(mask[b, 0].float(), cmap="Greys", vmin=0, vmax=1.25, aspect="equal")
        ax.set_title(f"batch row {b}: len_q {lq[b]}, len_k {lk[b]}", fontsize=8)
        ax.set_xticks(range(mask.shape[-1]))
        ax.set_yticks(range(mask.shape[-2]))
        ax.set_xlabel("key slot", fontsize=8)
        if b == 0:
            ax.set_ylabel("query slot", fontsize=8)
        ax.tick_params(labelsize=7)
        for i in range(lq[b]):
            if not bool(mask[b, 0, i].any()):
                ax.add_patch(Rectangle((-0.5, i - 0.5), mask.shape[-1], 1, fill=False, edgecolor="#c8453a", linewidth=2))
        for i in range(lq[b], mask.shape[-2]):
            ax.axhspan(i - 0.5, i + 0.5, color="#9ecae1", alpha=0.35, lw=0)
        for j in range(lk[b], mask.shape[-1]):
            ax.axvspan(j - 0.5, j + 0.5, color="#9ecae1", alpha=0.35, lw=0)
    fig.suptitle(case.label(), fontsize=9)
    return fig


def row_error_figure(results: MaskedRowsResults):
    """Per REAL query row, max |out - oracle| of the math backend, the replica and workaround (a);
    keyless rows shaded, the recorded cuDNN error (the max over rows) as a dashed line."""
    fig, axes = figure(1, len(CASES), width=8.0, height=3.2)
    for ax, case in zip(axes[0], CASES):
        label = case.label()
        keyless = results.keyless[label]
        for i in keyless:
            ax.axvspan(i - 0.5, i + 0.5, color="#c8453a", alpha=0.15, lw=0)
        for name, marker in (
            ("math backend", "o"),
            ("cuDNN's mask on math (replica)", "x"),
            ("(a) replica + zero rows without key", "."),
        ):
            values = [max(v, 1e-6) for v in results.per_row[label][name]]
            ax.plot(range(len(values)), values, marker, label=name.replace("cuDNN's mask on math (replica)", "replica"), ms=5)
        ax.axhline(
            results.recorded[label]["sdpa-cudnn"]["errors"]["out"][0], color="#c8453a", ls="--", lw=1, label="cuDNN, H200 (max)"
        )
        ax.set_yscale("log")
        ax.set_ylim(3e-7, 10)
        ax.set_xlabel("REAL query row (packed index)", fontsize=8)
        ax.set_title(label, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("max |out - fp64 oracle|\n(exactly 0 drawn at 1e-6)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7, frameon=False)
    return fig


def gpu_table(record: dict[str, Any]) -> Any:
    """The GPU probe's results, one row per (layout, dtype, backend, mask)."""
    rows = []
    for point in record["probes"]["points"]:
        rows.append(
            (
                point["layout"],
                point["dtype"],
                point["default_choice"],
                point["backend"],
                point["mask"],
                point.get("error", ""),
                point.get("keyless_out_max_abs"),
                point.get("vs_unmasked"),
                point.get("keyless_dq_max_abs"),
                point.get("real_errors", {}).get("dk"),
                point.get("deterministic"),
                point.get("bitwise_equal_to_bool_mask", ""),
            )
        )
    return table(
        (
            "layout",
            "dtype",
            "SDPA picks",
            "backend",
            "mask",
            "refused",
            "keyless |out|",
            "vs unmasked",
            "keyless |dq|",
            "dk error",
            "deterministic",
            "= bool mask",
        ),
        rows,
        fold=24,
    )
