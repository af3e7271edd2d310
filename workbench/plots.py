"""Plots of the workbench's records, in one style readable on the site and in light or dark JupyterLab.

Every function returns a `matplotlib.figure.Figure` built without pyplot (no global figure
state, nothing shown twice); a notebook cell ending with the call displays it. Figures carry an
explicit white face and dark ink, so they read the same whatever the page or theme behind them.

* `plot_token_norms(record)` — per-token norms (a `ProbeRecord`, or `TokenNorms` from the
  gradient-health monitor) with GAP and TAIL rows shaded and NaN/Inf rows marked;
* `plot_nan_map(sweep, rows=..., cols=...)` — non-finite counts over a sweep grid;
* `plot_errors(records)` — error on REAL rows against the fp64 oracle, in units of PyTorch's own;
* `plot_health(monitor)` — gradient norms over steps with state transitions and the first
  non-finite parameter;
* `plot_layout(batch)` — the packed layout and which key rows each query row sees.
"""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import matplotlib
import matplotlib.ticker
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.rcsetup import cycler

from varlen_workbench.workbench.bounds import FACTORS
from varlen_workbench.workbench.instruments.health import GradientHealth, State
from varlen_workbench.workbench.layout import Case, PackedBatch, Region, pack
from varlen_workbench.workbench.reference import reference_attention

INK = "#1f2328"
FACE = "white"
REGION_COLORS = {Region.REAL: "#2f6db5", Region.GAP: "#f0a04b", Region.TAIL: "#d1495b"}
STATE_COLORS = {State.HEALTHY: "#3a9d5d", State.VANISHING: "#2f6db5", State.EXPLODING: "#f0a04b", State.NONFINITE: "#d1495b"}
SERIES = ["#2f6db5", "#d1495b", "#3a9d5d", "#8e5ac8", "#f0a04b", "#1b998b", "#6c757d"]
STYLE = {
    "figure.facecolor": FACE,
    "axes.facecolor": FACE,
    "savefig.facecolor": FACE,
    "text.color": INK,
    "axes.labelcolor": INK,
    "axes.edgecolor": "#57606a",
    "xtick.color": INK,
    "ytick.color": INK,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "font.size": 9,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "axes.grid": True,
    "grid.color": "#d8dee4",
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": cycler(color=SERIES),
}


def render_png(fig: Figure, dpi: int = 100) -> bytes:
    """The figure as PNG bytes on its own (white) face, without volatile metadata."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor=fig.get_facecolor(), metadata={"Software": None})
    return buffer.getvalue()


def _display_figures_in_ipython() -> None:
    """Lets a cell ending with a Figure show it: figures made without pyplot have no display
    of their own until a backend registers one (that happens only when pyplot is imported).
    Outside a running IPython (which imports IPython before any user code) there is nothing to
    register, and the command line does not pay for importing it."""
    if "IPython" not in sys.modules:
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.display_formatter.formatters["image/png"].for_type(Figure, render_png)


_display_figures_in_ipython()


def figure(
    nrows: int = 1, ncols: int = 1, *, width: float = 7.0, height: float = 2.6, **kwargs: Any
) -> tuple[Figure, np.ndarray]:
    """A white, constrained-layout figure and a 2-D array of axes, drawn in the house style."""
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(width, height * nrows), facecolor=FACE, layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False, **kwargs)
    return fig, axes


def _runs(labels: Sequence[int]) -> list[tuple[int, int, int]]:
    """(label, start, stop) of maximal runs of equal labels."""
    runs, start = [], 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            runs.append((int(labels[start]), start, i))
            start = i
    return runs


def _shade_padding(ax, regions: torch.Tensor, axis: str = "x") -> None:
    span = ax.axvspan if axis == "x" else ax.axhspan
    for label, start, stop in _runs(regions.tolist()):
        if label != Region.REAL:
            span(start - 0.5, stop - 0.5, color=REGION_COLORS[Region(label)], alpha=0.18, lw=0, zorder=0)


def _region_legend() -> list[Patch]:
    return [Patch(color=REGION_COLORS[r], alpha=0.18 if r != Region.REAL else 1.0, label=r.name) for r in Region]


# -- per-token norms ---------------------------------------------------------------------------


def plot_token_norms(record: Any, tensors: Sequence[str] | None = None, *, title: str | None = None) -> Figure:
    """Per-token (per-row) norms with REAL / GAP / TAIL rows shaded; NaN/Inf rows marked on top.

    `record` is a `ProbeRecord` (out, dq, dk, dv) or the monitor's `TokenNorms`: anything with
    `token_norms` (name -> (T,) tensor) and `regions(name)`. The y axis is symmetric-log, so
    exact zeros (a correct kernel's padding) sit on the baseline and garbage stands out.
    """
    names = list(tensors or record.token_norms)
    missing = [n for n in names if n not in record.token_norms]
    if missing:
        raise ValueError(f"tensors {missing} are not in the record; it has {list(record.token_norms)}.")
    fig, axes = figure(len(names), 1, height=1.9)
    with matplotlib.rc_context(STYLE):
        for ax, name in zip(axes[:, 0], names):
            norms = record.token_norms[name].double()
            regions = record.regions(name)
            rows = np.arange(norms.numel())
            finite = torch.isfinite(norms).numpy()
            values = norms.numpy()
            _shade_padding(ax, regions)
            ax.plot(rows[finite], values[finite], ".", ms=3.5, color=REGION_COLORS[Region.REAL], label="norm")
            top = float(np.max(values[finite], initial=1.0)) * 4
            if not finite.all():
                ax.plot(
                    rows[~finite],
                    np.full((~finite).sum(), top),
                    "X",
                    ms=6,
                    color=REGION_COLORS[Region.TAIL],
                    label=f"NaN/Inf ({int((~finite).sum())} rows)",
                )
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(0, top * 2)
            ax.set_xlim(-0.5, norms.numel() - 0.5)
            ax.set_ylabel(f"|{name}| per row")
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        axes[-1, 0].set_xlabel("row of the packed tensor")
        handles = _region_legend()[1:] + [
            h for ax in axes[:, 0] for h in ax.get_legend_handles_labels()[0] if h.get_label() != "norm"
        ]
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
        case = getattr(record, "case", None)
        label = title or " — ".join(x for x in (getattr(record, "impl", None), case.label() if case is not None else None) if x)
        axes[0, 0].set_title(label, loc="left")
    return fig


# -- sweeps ------------------------------------------------------------------------------------


def _nonfinite_total(record: dict) -> float:
    return float(sum(v for k, v in record.items() if k.startswith("nonfinite_") and isinstance(v, (int, float))))


def plot_nan_map(
    sweep: Any,
    *,
    rows: str,
    cols: str,
    facet: str | None = None,
    value: str | Callable[[dict], float] = _nonfinite_total,
    fixed: dict | None = None,
    title: str | None = None,
) -> Figure:
    """Non-finite counts (or any `value` column) over two axes of a sweep, one panel per `facet`.

    Cells: green-grey = 0, red = count (log colour scale, number printed), hatched grey = the
    point failed (its exception type is printed). Every other axis must have one value, or be
    pinned with `fixed={axis: value}`. The default value sums every `nonfinite_*` column.
    """
    axes_values = sweep.axes
    fixed = dict(fixed or {})
    for name in [rows, cols, *([facet] if facet else []), *fixed]:
        if name not in axes_values:
            raise ValueError(f"{name!r} is not an axis of this sweep; axes are {list(axes_values)}.")
    free = [a for a in axes_values if a not in (rows, cols, facet) and a not in fixed and len(axes_values[a]) > 1]
    if free:
        raise ValueError(f"axes {free} vary but are not shown; pin them with fixed={{{free[0]!r}: ...}} or use facet=.")
    get = value if callable(value) else (lambda r: r.get(value, math.nan))
    facets = axes_values[facet] if facet else [None]
    row_values, col_values = axes_values[rows], axes_values[cols]
    fig, axes = figure(1, len(facets), width=min(3.2 * len(facets) + 0.8, 12), height=0.45 * len(row_values) + 1.4, sharey=True)
    grids = []
    for f in facets:
        pins = {**fixed, **({facet: f} if facet else {})}
        grid = np.full((len(row_values), len(col_values)), np.nan)
        errors: dict[tuple[int, int], str] = {}
        for i, rv in enumerate(row_values):
            for j, cv in enumerate(col_values):
                matches = sweep.where(**pins, **{rows: rv, cols: cv})
                if matches and not matches[0]["ok"]:
                    errors[(i, j)] = matches[0]["error_type"]
                elif matches:
                    grid[i, j] = get(matches[0])
        grids.append((f, grid, errors))
    peak = max([float(np.nanmax(g)) for _, g, _ in grids if np.isfinite(g).any()] + [1.0])
    cmap = matplotlib.colormaps["Reds"]
    norm = matplotlib.colors.LogNorm(vmin=1, vmax=max(peak, 10))
    with matplotlib.rc_context(STYLE):
        for ax, (f, grid, errors) in zip(axes[0], grids):
            ax.grid(False)
            for i in range(len(row_values)):
                for j in range(len(col_values)):
                    v = grid[i, j]
                    if (i, j) in errors:
                        ax.add_patch(
                            matplotlib.patches.Rectangle(
                                (j - 0.5, i - 0.5), 1, 1, facecolor="#eaeef2", hatch="///", edgecolor="#8c959f", lw=0
                            )
                        )
                        ax.text(j, i, errors[(i, j)], ha="center", va="center", fontsize=6.5, color=INK)
                        continue
                    color = "#e6f2ea" if v == 0 else cmap(norm(max(v, 1))) if np.isfinite(v) else "#ffffff"
                    ax.add_patch(matplotlib.patches.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=color, edgecolor=FACE, lw=1.5))
                    text = "" if np.isnan(v) else f"{v:.3g}"
                    ax.text(
                        j,
                        i,
                        text,
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white" if np.isfinite(v) and v > peak**0.6 and v > 0 else INK,
                    )
            ax.set_xlim(-0.5, len(col_values) - 0.5)
            ax.set_ylim(len(row_values) - 0.5, -0.5)
            ax.set_xticks(range(len(col_values)), [str(c) for c in col_values], rotation=30 if len(col_values) > 4 else 0)
            ax.set_yticks(range(len(row_values)), [str(r) for r in row_values])
            ax.set_xlabel(cols)
            ax.set_title(f"{facet} = {f}" if facet else (title or ""))
            ax.spines[:].set_visible(False)
        axes[0, 0].set_ylabel(rows)
        if facet and title:
            fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    return fig


# -- error against the oracle --------------------------------------------------------------------


def plot_errors(records: Sequence[Any], *, title: str | None = None) -> Figure:
    """Error of each record on REAL rows against the fp64 oracle, per tensor, in units of PyTorch's own error
    (floored at the rounding no fp32-accumulating kernel avoids: `varlen_workbench.workbench.bounds`).

    A bar at or below the dashed line (the FlashAttention-style factor: 2 for out, 3 for
    gradients) passes. A NaN error is drawn as a hatched red bar reaching the top.
    """
    records = list(records)
    if not records or any(not r.errors for r in records):
        raise ValueError("plot_errors needs ProbeRecords made with reference=True (they carry errors against the oracle).")
    names = [n for n in records[0].errors]
    fig, axes = figure(1, 1, width=max(4.5, 1.2 * len(names) * len(records) ** 0.5 + 2), height=2.8)
    ax = axes[0, 0]
    width = 0.8 / len(records)
    ratios = [[r.errors[n].ratio if n in r.errors else math.nan for n in names] for r in records]
    finite = [x for row in ratios for x in row if math.isfinite(x) and x > 0]
    top = max(finite + [FACTORS.get(n, 3.0) for n in names]) * 8
    bottom = min(finite + [0.1]) / 4
    with matplotlib.rc_context(STYLE):
        for k, (record, row) in enumerate(zip(records, ratios)):
            x = np.arange(len(names)) + (k - (len(records) - 1) / 2) * width
            color = SERIES[k % len(SERIES)]
            for xi, ratio in zip(x, row):
                if math.isnan(ratio) or math.isinf(ratio):
                    ax.bar(
                        xi,
                        top - bottom,
                        width * 0.9,
                        bottom=bottom,
                        color=REGION_COLORS[Region.TAIL],
                        alpha=0.35,
                        hatch="xx",
                        edgecolor=REGION_COLORS[Region.TAIL],
                    )
                    ax.text(xi, top / 2, "NaN" if math.isnan(ratio) else "Inf", ha="center", va="center", rotation=90, fontsize=8)
                else:
                    ax.bar(xi, max(ratio, bottom) - bottom, width * 0.9, bottom=bottom, color=color)
            ax.bar(0, 0, 0, color=color, label=record.impl)  # legend entry
        for i, n in enumerate(names):
            ax.hlines(FACTORS.get(n, 3.0), i - 0.45, i + 0.45, colors=INK, linestyles="--", lw=1)
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("error / PyTorch's error (floored)")
        ax.legend(loc="upper left", ncols=min(len(records), 4))
        ax.set_title(title or "REAL rows vs fp64 oracle (dashed: bound)")
    return fig


# -- gradient health -------------------------------------------------------------------------------


def plot_health(
    monitor: GradientHealth | Mapping[str, GradientHealth], params: Sequence[str] | None = None, *, title: str | None = None
) -> Figure:
    """Gradient norm of each parameter over steps, threshold bands, transitions and the first non-finite parameter.

    Non-finite steps are drawn as crosses on the top edge (a NaN has no height); every state
    transition is a marker coloured by the new state. Given a mapping of monitors (e.g. the
    buggy path and the fixed one trained on the same batches), the runs stand side by side on
    one shared axis, so finite garbage inflating one run's norms shows against the other's.
    """
    monitors = dict(monitor) if isinstance(monitor, Mapping) else {"": monitor}
    for label, m in monitors.items():
        if not m.history:
            raise ValueError(f"the monitor {label!r} has no steps yet; call monitor.step(loss) after each optimizer step first.")
    first_monitor = next(iter(monitors.values()))
    names = list(params or first_monitor.names.values())
    for label, m in monitors.items():
        unknown = [n for n in names if n not in m.names.values()]
        if unknown:
            raise ValueError(f"params {unknown} are not watched by monitor {label!r}; it watches {list(m.names.values())}.")
    series = {label: {n: np.array(m.norms(n)) for n in names} for label, m in monitors.items()}
    thresholds = first_monitor.thresholds
    values = [v for runs in series.values() for v in runs.values()]
    finite = np.concatenate([v[np.isfinite(v)] for v in values] + [np.array([thresholds.exploding])])
    top = float(finite.max()) * 10
    low = max(min(float(finite[finite > 0].min(initial=1.0)), thresholds.vanishing) / 10, 1e-30)
    panels = len(monitors)
    fig, axes = figure(1, panels, width=4.2 * panels + 2.6 if panels > 1 else 7.5, height=3.2, sharey=True)
    with matplotlib.rc_context(STYLE):
        for ax, (label, m) in zip(axes[0], monitors.items()):
            _draw_health(ax, m, series[label], low, top)
            ax.set_title(label or title or "gradient health (x: non-finite, o: state transition)")
        axes[0, 0].set_ylabel("gradient L2 norm")
        state_handles = [
            matplotlib.lines.Line2D([], [], marker="o", ls="", mfc="none", color=STATE_COLORS[s], label=f"-> {s.value}")
            for s in State
        ]
        last = axes[0, -1]
        last.legend(handles=last.get_legend_handles_labels()[0] + state_handles, loc="center left", bbox_to_anchor=(1.01, 0.5))
        if panels > 1 and title:
            fig.suptitle(title)
    return fig


def _draw_health(ax, monitor: GradientHealth, series: dict[str, np.ndarray], low: float, top: float) -> None:
    steps = np.arange(len(monitor.history))
    ax.axhspan(monitor.thresholds.exploding, top, color=STATE_COLORS[State.EXPLODING], alpha=0.08, lw=0)
    ax.axhspan(low, monitor.thresholds.vanishing, color=STATE_COLORS[State.VANISHING], alpha=0.08, lw=0)
    for k, (name, values) in enumerate(series.items()):
        color = SERIES[k % len(SERIES)]
        ok = np.isfinite(values)
        ax.plot(steps, np.where(ok, values, np.nan), "-", lw=1.2, color=color, label=name)
        bad = [
            s
            for s in steps
            if monitor.history[s].params.get(name) is not None and monitor.history[s].params[name].state is State.NONFINITE
        ]
        ax.plot(bad, np.full(len(bad), top / 2), "x", color=color, ms=6)
    for t in monitor.transitions:
        if t.param in series:
            y = series[t.param][t.step]
            ax.plot(t.step, y if math.isfinite(y) else top / 2, "o", ms=7, mfc="none", mew=1.6, color=STATE_COLORS[t.after])
    first = next((e for e in monitor.causal_chain().events if e.kind == "gradient"), None)
    if first is not None:
        ax.axvline(first.step, color=STATE_COLORS[State.NONFINITE], lw=1, ls=":")
        ax.annotate(
            f"first non-finite: {first.names[0]}",
            (first.step, top / 2),
            xytext=(6, -14),
            textcoords="offset points",
            fontsize=8,
            color=STATE_COLORS[State.NONFINITE],
        )
    ax.set_yscale("log")
    ax.set_ylim(low, top)
    ax.set_xlabel("step")


# -- layout and mask --------------------------------------------------------------------------------


def attention_mask(batch: PackedBatch) -> torch.Tensor:
    """(T_q, T_k) bool: which key rows each query row of the packed batch sees.

    Derived from the fp64 oracle itself, not from a second copy of the masking rule: with
    q = 0 every visible key gets the same weight, and v = one-hot(key position in its sequence)
    makes the output spell out which keys those are.
    """
    cu_q, cu_k = batch.cu_seqlens_q.cpu(), batch.cu_seqlens_k.cpu()
    pad_q, pad_k = batch.cu_seqlens_q_padded.cpu(), batch.cu_seqlens_k_padded.cpu()
    total_q, total_k = batch.q.shape[0], batch.k.shape[0]
    width = max(batch.max_seqlen_k, 1)
    v = torch.zeros(total_k, 1, width, dtype=torch.float64)
    starts_k, lengths_k = pad_k.tolist(), cu_k.diff().tolist()
    for start, n in zip(starts_k, lengths_k):
        v[torch.arange(start, start + n), 0, torch.arange(n)] = 1.0
    q = torch.zeros(total_q, 1, width, dtype=torch.float64)
    out = reference_attention(
        q,
        torch.zeros_like(v),
        v,
        cu_q,
        cu_k,
        batch.max_seqlen_q,
        batch.max_seqlen_k,
        cu_seqlens_q_padded=pad_q,
        cu_seqlens_k_padded=pad_k,
        causal=batch.case.causal,
        window_size=batch.case.window,
    )
    mask = torch.zeros(total_q, total_k, dtype=torch.bool)
    starts_q, lengths_q = pad_q.tolist(), cu_q.diff().tolist()
    for s, (start, n) in enumerate(zip(starts_q, lengths_q)):
        mask[start : start + n, starts_k[s] : starts_k[s] + width] = (
            out[start : start + n, 0, : min(width, total_k - starts_k[s])] > 0
        )
    return mask


def plot_layout(batch: PackedBatch | Case, *, title: str | None = None) -> Figure:
    """The packed layout (rows of q and k by region and sequence) and the attention mask.

    Left: every row of q and k, real rows coloured by sequence, GAP and TAIL rows in their
    colours. Right: query rows (down) x key rows (across); a dark cell is a key the query sees,
    padding rows and columns are shaded.
    """
    if isinstance(batch, Case):
        batch = pack(batch, device="cpu", requires_grad=False)
    mask = attention_mask(batch)
    fig, axes = figure(1, 2, width=8.0, height=3.6, width_ratios=[1, 2.2])
    strip, grid = axes[0]
    with matplotlib.rc_context(STYLE):
        for x, (regions, cu_pad) in enumerate(
            [(batch.regions_q, batch.cu_seqlens_q_padded), (batch.regions_k, batch.cu_seqlens_k_padded)]
        ):
            # Label = sequence index on REAL rows, -1 - region elsewhere: runs then split at sequence boundaries.
            owner = torch.searchsorted(
                cu_pad.cpu()[1:].contiguous(), torch.arange(regions.numel(), dtype=cu_pad.dtype), right=True
            )
            labels = torch.where(regions == Region.REAL, owner, -1 - regions.long())
            for label, start, stop in _runs(labels.tolist()):
                if label >= 0:
                    color = ["#2f6db5", "#7fa7d9"][label % 2]
                    strip.text(x, (start + stop) / 2 - 0.5, f"seq {label}", ha="center", va="center", fontsize=7, color="white")
                else:
                    color = REGION_COLORS[Region(-1 - label)]
                strip.add_patch(
                    matplotlib.patches.Rectangle(
                        (x - 0.4, start - 0.5), 0.8, stop - start, facecolor=color, edgecolor=FACE, lw=0.8
                    )
                )
        strip.set_xlim(-0.6, 1.6)
        strip.set_ylim(max(mask.shape) - 0.5, -0.5)
        strip.set_xticks([0, 1], ["q rows", "k rows"])
        strip.set_ylabel("row")
        strip.grid(False)
        strip.spines[:].set_visible(False)
        grid.grid(False)
        grid.imshow(
            mask.numpy(),
            cmap=matplotlib.colors.ListedColormap([FACE, "#1f3b63"]),
            vmin=0,
            vmax=1,
            interpolation="nearest",
            aspect="auto",
        )
        _shade_padding(grid, batch.regions_k, axis="x")
        _shade_padding(grid, batch.regions_q, axis="y")
        for axis in (strip.yaxis, grid.xaxis, grid.yaxis):
            # Whole rows only, even in a layout of one or two rows (min_n_ticks=1: one row is one tick).
            axis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True, min_n_ticks=1))
        grid.set_xlabel("key row")
        grid.set_ylabel("query row")
        masking = [*(["causal"] if batch.case.causal else []), *([f"window {batch.case.window}"] if batch.case.windowed else [])]
        grid.set_title("visible (query, key) pairs" + (f" — {', '.join(masking)}, bottom-right aligned" if masking else ""))
        fig.legend(handles=[Patch(color="#1f3b63", label="visible")] + _region_legend()[1:], loc="outside lower center", ncols=3)
        fig.suptitle(title or batch.case.label(), x=0.01, ha="left", fontsize=10)
    return fig
