"""The tables and figures of the te-thd-2892 notebook."""

from __future__ import annotations

import math

import matplotlib
import torch

from varlen_workbench.postmortems.te_thd_2892.cases import (
    ALIGN,
    BIDIRECTIONAL_STEPS,
    CAST_VALUES,
    HEALTH_PARAMS,
    TE_DOCSTRING,
    WORKAROUND_FRACTION,
)
from varlen_workbench.postmortems.te_thd_2892.study import TeResults
from varlen_workbench.postmortems.te_thd_2892.training import health_runs, qkv_norm_ratio
from varlen_workbench.workbench.bounds import ErrorCheck
from varlen_workbench.workbench.instruments.seqpar import BOUNDARIES
from varlen_workbench.workbench.layout import Case, Region, pack
from varlen_workbench.workbench.plots import INK, REGION_COLORS, SERIES, STYLE, attention_mask, plot_health
from varlen_workbench.workbench.postmortem import (
    figure,
    table,
)


def plot_gradient_health(fraction: float):
    """The explorer's frame: per-parameter gradient norms over training, workaround beside correct."""
    monitors = health_runs(fraction)
    fig = plot_health(monitors, list(HEALTH_PARAMS))
    finite = [x for m in monitors.values() for name in HEALTH_PARAMS for x in m.norms(name) if math.isfinite(x) and x > 0]
    fig.axes[0].set_ylim(min(finite) / 4, max(finite) * 4)  # zoom past the threshold bands: the runs' own range
    fig.suptitle(
        f"bidirectional toy, {fraction:.0%} of rows are padding: qkv gradient norm, workaround / correct = "
        f"{qkv_norm_ratio(monitors):.2f}",
        x=0.01,
        ha="left",
        fontsize=10,
    )
    return fig


def _ratio(check: ErrorCheck) -> str:
    # Of the bound, not "x PyTorch": in float32 the bound's fp32 floor can be the larger (varlen_workbench.workbench.bounds).
    return f"{check.error:.3g} ({check.error / check.bound:.3g} of the bound)" if check.error == check.error else "NaN"


def _within(check: ErrorCheck) -> str:
    return "yes" if check.within else "NO"


def workaround_table(results: TeResults):
    """REAL-row error: VERL's call vs the right call, at `WORKAROUND_FRACTION` padding."""
    sweep = {causal: dict(points)[WORKAROUND_FRACTION] for causal, points in results.workaround_sweep.items()}
    rows = [
        (
            "causal" if causal else "non-causal",
            _ratio(sweep[causal]),
            _within(sweep[causal]),
            _ratio(results.contract[causal]),
            _within(results.contract[causal]),
        )
        for causal in (True, False)
    ]
    return table(
        ("attention", "cu_seqlens = cu_seqlens_padded", "within", "real cu_seqlens + cu_seqlens_padded", "within"),
        rows,
        title=f"REAL-row error against the fp64 oracle, {WORKAROUND_FRACTION:.0%} padding at each sequence's end (replica)",
    )


def auto_detect_table(results: TeResults):
    return table(
        ("layout", "TE 2.12-2.17.1", "TE 2.18-2.20.2"),
        [(name, str(old), str(new)) for name, (old, new) in results.auto_detect.items()],
        title="pad_between_seqs when left None (source reading, transcribed)",
    )


def training_table(results: TeResults):
    rows = [
        (
            name,
            f"{run.losses[0]:.3f}",
            f"{run.final_loss:.3f}",
            f"{run.eval_loss:.3f}",
        )
        for name, (run, _) in results.training.items()
    ]
    return table(("causal toy, run", "first loss", "final loss", "held-out loss"), rows)


def seeds_table(results: TeResults):
    rows = [(str(s.seed), f"{s.train_gap:+.3f}", f"{s.heldout_gap:+.3f}") for s in results.seeds]
    return table(
        ("seed", "training loss, workaround - correct", "held-out loss, workaround - correct"),
        rows,
        title=f"bidirectional toy, {BIDIRECTIONAL_STEPS} steps, padding to multiples of {ALIGN} rows",
    )


def fp8_table(results: TeResults):
    rows = [(fill, scales, f"{c.error:.3g}", f"{c.bound:.3g}", _within(c)) for (fill, scales), c in results.fp8.items()]
    return table(("padding holds", "scales from", "REAL-row error", "FP8 bound", "within"), rows)


def cast_table(results: TeResults):
    found = results.cast["values"]
    n = len(CAST_VALUES)
    rows = [
        (f"{x:g}", f"{t:g}", f"{tr:g}", f"{q:g}")
        for x, t, tr, q in zip(*(found[k][:n].tolist() for k in ("x", "torch", "triton", "quantizer")))
    ]
    return table(("fp32 value", "torch .to(e4m3)", "Triton x.to(tl.float8e4nv)", "our quantizer"), rows)


def seqpar_table(results: TeResults):
    rows = [
        (
            f"{BOUNDARIES[r.size_from]}[-1]",
            "ours" if r.validate else "none",
            str(r.rows),
            "-" if r.out is None else str(tuple(r.out.shape)),
            str(r.exact),
            (r.error or "").split(":")[0],
        )
        for r in results.seqpar.runs
    ]
    return table(("all-gather sized from", "size check", "rows", "output", "== one process", "error"), rows)


def cp_rule_table(results: TeResults):
    """The 2 x cp_size rule kept and broken: the layouts, our check's answer, and what the ranks got
    (the broken layout run with the check off)."""
    study = results.cp_rule

    def found(findings) -> str:
        if not findings:
            return "none: REAL rows within the bound, padding rows exactly 0"
        ranks = {f.evidence.split(": ")[0] for f in findings}
        tensors = sorted({f.evidence.split(": ")[1] for f in findings})
        return f"{', '.join(tensors)} off the bound on {len(ranks)} of {study.cp_size} ranks"

    multiple = 2 * study.cp_size
    rows = [
        ("kept", study.kept, "accepted", 0, found(study.kept_findings)),
        ("broken", study.broken, "refused (the message above)", study.rows_on_no_rank, found(study.unchecked_findings)),
    ]
    return table(
        ("rule", "real lengths", "padded lengths", "our check", "rows on no rank", "the ranks' out, dq, dk, dv (check off)"),
        [
            (rule, str(list(c.seqlens_q)), str(list(c.padded_lengths("q"))), check, str(n), what)
            for rule, c, check, n, what in rows
        ],
        title=f"{study.backend}, {study.cp_size} ranks: every padded length a multiple of 2 x cp_size = {multiple}, or not",
    )


def rope_table(results: TeResults):
    rows = [
        (str(s.index), str(s.length), str(s.offset), s.kind, _ratio(s.check), _within(s.check)) for s in results.rope.sequences
    ]
    return table(("sequence", "real tokens", "first position", "real-boundary positions", "attention error", "within"), rows)


def plot_workaround_sweep(results: TeResults):
    """REAL-row error of the workaround in units of the bound, vs padding fraction, causal or not."""
    fig, axes = figure(1, 1, width=6.0, height=3.0)
    ax = axes[0, 0]
    with matplotlib.rc_context(STYLE):
        for k, causal in enumerate((False, True)):
            points = results.workaround_sweep[causal]
            ax.plot(
                [f for f, _ in points],
                [c.error / c.bound for _, c in points],
                "o-",
                color=SERIES[k],
                label="causal" if causal else "non-causal",
            )
        ax.axhline(1.0, color=INK, ls="--", lw=1, label="bound")
        ax.set_yscale("log")
        ax.set_xlabel("padding fraction of every sequence")
        ax.set_ylabel("REAL-row error / bound")
        ax.set_title("cu_seqlens = cu_seqlens_padded, zero padding", loc="left")
        ax.legend()
    return fig


def plot_seeds(results: TeResults):
    """Per-seed gaps (workaround - correct) of the bidirectional toy: training and held-out loss."""
    fig, axes = figure(1, 1, width=6.0, height=2.8)
    ax = axes[0, 0]
    with matplotlib.rc_context(STYLE):
        for k, attr in enumerate(("train_gap", "heldout_gap")):
            gaps = [getattr(s, attr) for s in results.seeds]
            ax.plot(gaps, [k] * len(gaps), "o", color=SERIES[k], ms=7, alpha=0.8)
            ax.plot([sum(gaps) / len(gaps)], [k], "|", color=INK, ms=18, mew=2)
        ax.axvline(0.0, color=INK, lw=1, ls="--")
        ax.set_yticks([0, 1], ["training loss", "held-out loss"])
        ax.set_ylim(-0.6, 1.6)
        ax.set_xlabel(f"workaround - correct ({len(results.seeds)} seeds; bar: mean)")
        ax.set_title("bidirectional toy: the gap per seed", loc="left")
    return fig


def plot_fp8(results: TeResults):
    """REAL-row error of the FP8 forward per padding fill, scales from real rows vs all rows."""
    fig, axes = figure(1, 1, width=6.5, height=3.0)
    ax = axes[0, 0]
    fills = list(dict.fromkeys(fill for fill, _ in results.fp8))
    with matplotlib.rc_context(STYLE):
        for k, scales in enumerate(("real", "all")):
            for i, fill in enumerate(fills):
                check = results.fp8[(fill, scales)]
                x = i + (k - 0.5) * 0.38
                if math.isfinite(check.error):
                    ax.bar(x, check.error, 0.36, color=SERIES[k], label=f"scales from {scales} rows" if i == 0 else None)
                else:
                    ax.bar(x, 10.0, 0.36, color=REGION_COLORS[Region.TAIL], alpha=0.35, hatch="xx", label="NaN" if k else None)
                    ax.text(x, 11.0, "NaN", ha="center", va="bottom", fontsize=8)
            ax.hlines(
                [results.fp8[(f, "real")].bound for f in fills],
                [i - 0.45 for i in range(len(fills))],
                [i + 0.45 for i in range(len(fills))],
                colors=INK,
                linestyles="--",
                lw=1,
            )
        ax.set_yscale("log")
        ax.set_ylim(top=40.0)
        ax.set_xticks(range(len(fills)), fills)
        ax.set_xlabel("what the padding rows hold")
        ax.set_ylabel("max REAL-row error vs fp64")
        ax.set_title("blockwise FP8 forward (dashed: FP8 bound)", loc="left")
        ax.legend(loc="upper left")
    return fig


def plot_rope(results: TeResults):
    """Positions per row (padded layout vs real boundaries) and the attention error per sequence."""
    study = results.rope
    batch = pack(study.case, "cpu", requires_grad=False)
    fig, axes = figure(1, 2, width=10.5, height=3.0)
    left, right = axes[0]
    with matplotlib.rc_context(STYLE):
        real = torch.nonzero(batch.regions_q == Region.REAL).flatten()  # padding rows carry no token to rotate
        left.plot(real, study.from_padded[real], ".", ms=3, color=SERIES[0], label="from cu_seqlens_padded (Megatron-Core MLA)")
        left.plot(real, study.from_real[real], ".", ms=3, color=SERIES[1], label="from cu_seqlens on the padded layout")
        left.set_xlabel("row of a real token (gaps: padding)")
        left.set_ylabel("RoPE position")
        left.legend()
        ratios = [s.check.error / s.check.bound for s in study.sequences]
        right.bar(range(len(ratios)), ratios, color=[SERIES[2] if s.check.within else SERIES[1] for s in study.sequences])
        for s, r in zip(study.sequences, ratios):
            right.text(s.index, r, s.kind, ha="center", va="bottom", fontsize=8)
        right.axhline(1.0, color=INK, ls="--", lw=1)
        right.set_yscale("log")
        right.set_xticks(range(len(ratios)), [f"seq {s.index}" for s in study.sequences])
        right.set_ylabel("REAL-row error / bound")
        right.set_title("attention with real-boundary positions", loc="left")
    return fig


def plot_contract(case: Case = TE_DOCSTRING):
    """Which keys each query sees: with real cu_seqlens (left) and with cu_seqlens = cu_seqlens_padded (right, red: padding keys)."""
    batch = pack(case.with_(causal=False), "cpu", requires_grad=False)
    sees_all = pack(case.with_(seqlens_q=case.padded_q, causal=False), "cpu", requires_grad=False)
    right_call = attention_mask(batch).int()
    verl = attention_mask(sees_all).int() + (attention_mask(sees_all) & (batch.regions_k != Region.REAL)[None, :]).int()
    fig, axes = figure(1, 2, width=8.0, height=3.4)
    colors = matplotlib.colors.ListedColormap(["white", "#1f3b63", REGION_COLORS[Region.TAIL]])
    with matplotlib.rc_context(STYLE):
        for ax, mask, title in (
            (axes[0, 0], right_call, "real cu_seqlens + cu_seqlens_padded"),
            (axes[0, 1], verl, "cu_seqlens = cu_seqlens_padded (VERL)"),
        ):
            ax.grid(False)
            ax.imshow(mask.numpy(), cmap=colors, vmin=0, vmax=2, interpolation="nearest")
            ax.set_xlabel("key row")
            ax.set_ylabel("query row")
            ax.set_title(title, loc="left", fontsize=9)
        fig.suptitle("TE's docstring layout [a a a 1 b b 2 2 c c c c 3], no causal mask", x=0.01, ha="left", fontsize=10)
    return fig
