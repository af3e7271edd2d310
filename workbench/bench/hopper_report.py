"""The forward kernel's Hopper switches as a GPU recorded them (`benchmarks.hopper_forward`):
the record read back, tabled and summarised for the performance notebook.

Every figure is a ratio of two medians from the same run. A speed-up is the other time over the
variant's (> 1: the variant is faster), against the shipped kernel (`CURRENT`) or FlashAttention-4
(`FA4`). The backward is the forward+backward median minus the forward median: the switches
touch the forward only, so the backward of every variant is the shipped one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from varlen_workbench.workbench.bench.verdict import ms_with_fastest
from varlen_workbench.workbench.postmortem import table
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import read_record

HOPPER_COMMAND = "python -m benchmarks.hopper_forward --record data/gpu/hopper-forward-<gpu>.json"
CURRENT = "current"  # the forward as shipped, its tile tuned
FA4 = "FlashAttention-4 varlen"  # FA4's flash_attn_varlen_func, called bare
TIMES = ("forward", "forward_backward", "backward")


@dataclass(frozen=True)
class SwitchRow:
    """One (workload, variant) of the record: its medians and fastest calls in ms (None when not
    timed), the forward tile it was pinned to, its output check and the error that stopped it."""

    workload: str
    variant: str
    tile: str | None
    check: str | None
    error: str | None
    forward_ms: float | None
    forward_min_ms: float | None
    forward_backward_ms: float | None
    forward_backward_min_ms: float | None

    def time(self, what: str) -> float | None:
        """The median of `what` (one of `TIMES`); the backward is forward+backward minus forward."""
        if what not in TIMES:
            raise ValueError(f"time({what!r}): pass one of {TIMES}")
        if what == "backward":
            both, forward = self.forward_backward_ms, self.forward_ms
            return both - forward if both is not None and forward is not None else None
        return getattr(self, f"{what}_ms")


def load_hopper(path: Path = GPU_DATA / "hopper-forward-h200.json") -> dict[str, Any]:
    """The committed record of the Hopper switches (its provenance names the command)."""
    return read_record(path, how=HOPPER_COMMAND)


def hopper_rows(record: Mapping[str, Any]) -> list[SwitchRow]:
    """The record's rows, in its order; every workload must have its `CURRENT` row."""
    fields = [f for f in SwitchRow.__dataclass_fields__]
    rows = []
    for i, r in enumerate(record["rows"]):
        missing = [f for f in fields if f not in r]
        if missing:
            raise ValueError(f"row {i} of the record lacks {missing}: records are written by `{HOPPER_COMMAND}`")
        rows.append(SwitchRow(**{f: r[f] for f in fields}))
    workloads = dict.fromkeys(r.workload for r in rows)
    without = [w for w in workloads if not any(r.workload == w and r.variant == CURRENT for r in rows)]
    if without:
        raise ValueError(f"workloads {without} have no {CURRENT!r} row to compare with: re-record them with `{HOPPER_COMMAND}`")
    return rows


def speedups(rows: list[SwitchRow], variant: str, what: str = "forward", over: str = CURRENT) -> dict[str, float]:
    """Per workload where both were timed: `over`'s median `what` over `variant`'s (> 1: `variant` is faster)."""
    by = {(r.workload, r.variant): r.time(what) for r in rows}
    found = {}
    for (workload, name), mine in by.items():
        other = by.get((workload, over))
        if name == variant and mine and other:
            found[workload] = other / mine
    return found


def value_range(values: Mapping[str, float]) -> tuple[float, float]:
    """(smallest, largest) of `values`; it must not be empty."""
    if not values:
        raise ValueError("value_range() of nothing: the variant was timed on no workload of the record")
    return min(values.values()), max(values.values())


def refusals(rows: list[SwitchRow]) -> dict[str, dict[str, str]]:
    """Per variant, the workloads where it did not run and the error that stopped it."""
    found: dict[str, dict[str, str]] = {}
    for r in rows:
        if r.error:
            found.setdefault(r.variant, {})[r.workload] = r.error
    return found


def tile_warps(tile: str) -> int:
    """The warps of a tile as the tuner names it ("128x64 w8 s3" -> 8)."""
    found = re.search(r"\bw(\d+)\b", tile)
    if not found:
        raise ValueError(f"tile {tile!r} names no warps (expected e.g. '128x64 w8 s3')")
    return int(found.group(1))


def switch_table(rows: list[SwitchRow]):
    """One line per (workload, variant): median (fastest) forward and forward+backward ms, and the
    speed-ups over the shipped kernel and over FA4 (a `varlen_workbench.workbench.postmortem.Table`)."""

    def times(values: dict[str, float], workload: str) -> str:
        return f"{values[workload]:.2f}x" if workload in values else "-"

    ratios = {
        (variant, what, over): speedups(rows, variant, what, over)
        for variant in dict.fromkeys(r.variant for r in rows)
        for what in ("forward", "forward_backward")
        for over in (CURRENT, FA4)
    }
    cells = []
    for r in rows:
        cells.append(
            (
                r.workload,
                r.variant,
                r.tile or "-",
                ms_with_fastest(r.forward_ms, r.forward_min_ms),
                ms_with_fastest(r.forward_backward_ms, r.forward_backward_min_ms),
                *(
                    times(ratios[(r.variant, what, over)], r.workload)
                    for over in (CURRENT, FA4)
                    for what in ("forward", "forward_backward")
                ),
                "not run (error below)" if r.error else r.check or "-",
            )
        )
    header = (
        "workload",
        "variant",
        "forward tile",
        "fwd ms median (min)",
        "f+b ms median (min)",
        "fwd vs current",
        "f+b vs current",
        "fwd vs FA4",
        "f+b vs FA4",
        "output check",
    )
    return table(header, cells, fold=len(cells))


@dataclass(frozen=True)
class BackwardGap:
    """One workload's step against FA4's, split at the forward (ratios: FA4 time / ours, > 1: ours faster)."""

    forward: float  # the fastest of our forward variants
    backward: float  # the shipped backward
    step: float  # forward+backward, the variant with the fastest forward
    free_forward: float  # FA4's whole step over our backward alone: ours with a forward of zero time
    backward_share: float  # the backward's part of our shipped step


def backward_gaps(rows: list[SwitchRow]) -> dict[str, BackwardGap]:
    """Per workload where FA4 was timed: how far the backward keeps ours from FA4, however fast the forward."""
    by = {(r.workload, r.variant): r for r in rows}
    found = {}
    for workload in dict.fromkeys(r.workload for r in rows):
        fa4, current = by.get((workload, FA4)), by[(workload, CURRENT)]
        ours = [r for r in rows if r.workload == workload and r.variant != FA4 and r.forward_ms and r.forward_backward_ms]
        if fa4 is None or not (fa4.forward_ms and fa4.forward_backward_ms) or current not in ours:
            continue
        fastest = min(ours, key=lambda r: r.forward_ms or 0.0)
        backward, fa4_backward = current.time("backward") or 0.0, fa4.time("backward") or 0.0
        if backward <= 0 or fa4_backward <= 0:
            raise ValueError(
                f"{workload}: a forward+backward median at or below its forward median; re-record with `{HOPPER_COMMAND}`"
            )
        found[workload] = BackwardGap(
            forward=fa4.forward_ms / (fastest.forward_ms or math.nan),
            backward=fa4_backward / backward,
            step=fa4.forward_backward_ms / (fastest.forward_backward_ms or math.nan),
            free_forward=fa4.forward_backward_ms / backward,
            backward_share=backward / (current.forward_backward_ms or math.nan),
        )
    return found


def format_backward_gaps(gaps: Mapping[str, BackwardGap]) -> str:
    lines = [f"{'workload':<44} {'fwd vs FA4':>10} {'bwd vs FA4':>10} {'f+b vs FA4':>10} {'free fwd':>8} {'bwd share':>9}"]
    for name, g in gaps.items():
        lines.append(
            f"{name:<44} {g.forward:>9.2f}x {g.backward:>9.2f}x {g.step:>9.2f}x {g.free_forward:>7.2f}x {g.backward_share:>9.0%}"
        )
    return "\n".join(lines)


# The fused backward (dQ accumulated with fp32 atomic adds inside the dK/dV kernel, as
# FlashAttention-2/3/4 do), tried as `deterministic=False` at commit 3a14037 and reverted: its
# record stays, and the command runs at that commit.
FUSED_COMMAND = "git checkout 3a14037 && python -m benchmarks.backward_modes --record data/gpu/backward-modes-h200.json"
TWO_KERNELS, FUSED = "ours deterministic=True", "ours deterministic=False"


@dataclass(frozen=True)
class FusedTrial:
    """One workload: the shipped two-kernel backward and the fused one, median (fastest) ms."""

    workload: str
    check: str  # the fused gradients against the two-kernel ones, checked before timing
    two_kernels: tuple[float, float]
    fused: tuple[float, float]
    fa4: tuple[float, float] | None

    @property
    def speedup(self) -> float:
        """The two-kernel backward's median over the fused one's (> 1: fused is faster)."""
        return self.two_kernels[0] / self.fused[0]


def load_fused_trial(path: Path = GPU_DATA / "backward-modes-h200.json") -> dict[str, Any]:
    return read_record(path, how=FUSED_COMMAND)


def fused_trials(record: Mapping[str, Any]) -> list[FusedTrial]:
    """Per workload of the record, the backward alone (forward+backward minus forward) both ways."""
    by = {(r["workload"], r["impl"]): r for r in record["rows"] if not r.get("error")}
    found = []
    for workload, check in record["checks"].items():
        times = {
            impl: (by[(workload, impl)]["backward_ms"], by[(workload, impl)]["backward_min_ms"])
            for impl in (TWO_KERNELS, FUSED, FA4)
            if (workload, impl) in by
        }
        if TWO_KERNELS not in times or FUSED not in times:
            raise ValueError(f"{workload}: the record lacks a timed {TWO_KERNELS!r} or {FUSED!r} row; see `{FUSED_COMMAND}`")
        found.append(FusedTrial(workload, check, times[TWO_KERNELS], times[FUSED], times.get(FA4)))
    return found


def fused_kernel_times(record: Mapping[str, Any]) -> list[tuple[str, float, float, float]]:
    """Per shape class the tuner timed: (class, dK/dV kernel + dQ kernel, their sum, the fused kernel),
    each the fastest candidate tile's time in ms, with the L2 flushed."""
    best: dict[tuple, dict[str, float]] = {}
    for t in record["tiles"]:
        key = (t["head_dim"], t["causal"], t["group"], t["rows_per_seq_log2"])
        best.setdefault(key, {})[t["kernel"]] = min(t["timings_ms"].values())
    rows = []
    for (head_dim, causal, group, rows_log2), kernels in best.items():
        if {"dkdv", "dq", "dkdv_fused"} <= kernels.keys():
            name = (
                f"d{head_dim}{' causal' if causal else ''}{f' GQA group {group}' if group > 1 else ''}, ~2^{rows_log2} rows/seq"
            )
            rows.append((name, kernels["dkdv"], kernels["dkdv"] + kernels["dq"], kernels["dkdv_fused"]))
    return rows
