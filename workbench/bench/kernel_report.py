"""What a kernel benchmark run means: the contract's cost, the performance targets, kernel and host
times, the tables, and the records read back, merged and plotted (the performance notebook).

`varlen_workbench.workbench.bench.kernels` runs the benchmark and writes its record
(`varlen_workbench.workbench.bench.kernel_record`); this module only reads rows and records, so a
CPU machine renders the committed GPU records with it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from varlen_workbench.workbench.bench.kernel_record import (
    GUARDED_FA4,
    RECORD_COMMAND,
    Row,
    ratio,
    rows_from_record,
    set_peer_ratios,
)
from varlen_workbench.workbench.bench.verdict import Target, ms_with_fastest, worst
from varlen_workbench.workbench.bench.workloads import workloads
from varlen_workbench.workbench.postmortem import table
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import load_records, read_record


def _our_rows(rows: list[Row]) -> dict[str, Row]:
    return {r.workload: r for r in rows if r.impl == "ours" and not r.timing.error}


def contract_costs(rows: list[Row]) -> dict[str, float]:
    """Per padded workload: our forward+backward time over the same batch unpadded, minus 1."""
    ours = _our_rows(rows)
    costs = {}
    for name, row in ours.items():
        if "padded" in name:
            unpadded = next((r for n, r in ours.items() if n != name and n.startswith(name.split(" padded")[0])), None)
            if unpadded:
                costs[name] = ratio(row.timing.forward_backward_ms, unpadded.timing.forward_backward_ms) - 1
    return costs


EQUAL_D128 = "8x2048 d128"  # the equal-length head-dim-128 workloads, causal and not
VALIDATE_AT = "8x2048"  # where the cost of validate=True is judged
# The ratio each must reach (FlashAttention-4's on d128 workloads only, where real models live).
PEERS = {"torch varlen_attn": 1.3, "FlexAttention (compiled)": 1.0, "SDPA dense (cuDNN)": 0.8, "FlashAttention-4 varlen": 0.8}
GUARDED_FA4_BOUND = 0.95  # FA4 behind our wrapper, against FA4 alone on the same batch


def _variant_ratio(rows: list[Row], variant: str, field_: str, prefix: str = "") -> dict[str, float]:
    """Per workload (name starting with `prefix`): our `variant` row's `field_` over plain ours', minus 1."""
    ours = _our_rows(rows)
    found = {}
    for r in rows:
        if r.impl == variant and not r.timing.error and r.workload in ours and r.workload.startswith(prefix):
            base = getattr(ours[r.workload].timing, field_)
            value = getattr(r.timing, field_)
            if base and value:
                found[r.workload] = value / base - 1
    return found


def _guarded_over_fa4(rows: list[Row]) -> dict[str, float]:
    """Per workload where both ran: FA4's forward+backward time over FA4 behind our wrapper's."""
    by_impl = {(r.workload, r.impl): r for r in rows if not r.timing.error}
    fa4 = "FlashAttention-4 varlen"
    return {
        w: ratio(by_impl[(w, fa4)].timing.forward_backward_ms, r.timing.forward_backward_ms)
        for (w, impl), r in by_impl.items()
        if impl == GUARDED_FA4 and (w, fa4) in by_impl
    }


def guarded_fa4_ratios(rows: list[Row]) -> dict[str, tuple[float, float]]:
    """Per workload where both ran: FA4's time over FA4 behind our wrapper's, forward+backward,
    (on the medians, on the fastest calls); >= 0.95 is the wrapper within 5%."""
    fastest = _guarded_over_fa4(fastest_calls(rows))
    return {w: (median, fastest[w]) for w, median in _guarded_over_fa4(rows).items()}


VALIDATION_VARIANTS = {"same": "ours validate=True", "new": "ours validate=True, new metadata"}


def validation_costs(rows: list[Row]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per 8x2048 workload: the extra time of validate=True over validate=False on our kernel,
    same and new metadata, forward and forward+backward: {"same fwd": (median, fastest), ...}."""
    fastest = fastest_calls(rows)
    costs: dict[str, dict[str, tuple[float, float]]] = {}
    for kind, variant in VALIDATION_VARIANTS.items():
        for label, field_ in (("fwd", "forward_ms"), ("f+b", "forward_backward_ms")):
            fast = _variant_ratio(fastest, variant, field_, VALIDATE_AT)
            for w, median in _variant_ratio(rows, variant, field_, VALIDATE_AT).items():
                costs.setdefault(w, {})[f"{kind} {label}"] = (median, fast[w])
    return costs


@dataclass(frozen=True)
class WrapperLog:
    """What `python benchmarks/fa4_wrapper.py` printed on the GPU: its provenance line, its text
    and, per workload, FA4 bare's time over the wrapper's (same metadata)."""

    provenance: str
    text: str
    ratios: dict[str, float]


def fa4_wrapper_log(path: Path = GPU_DATA / "logs" / "fa4-wrapper-h200.log") -> WrapperLog:
    """The committed log of `benchmarks/fa4_wrapper.py` (a '# ' provenance line, then a table; no
    record), its warnings dropped."""
    provenance, *rest = _log_lines(path, "python benchmarks/fa4_wrapper.py")
    lines = [line for line in rest if line and not line.startswith((" ", "/"))]
    start = next(i for i, line in enumerate(lines) if line.startswith("workload"))
    ratios = {line[:26].strip(): float(line.split()[-1]) for line in lines[start + 1 :]}
    return WrapperLog(provenance[2:], "\n".join(lines), ratios)


def _log_lines(path: Path, command: str) -> list[str]:
    """The lines of a committed GPU log of `command`, whose first is '# ' and its provenance."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no log of `{command}`; run it on a GPU")
    lines = path.read_text().splitlines()
    if not lines or not lines[0].startswith("# "):
        raise ValueError(f"{path}: the first line must be '# ' and the run's provenance (GPU, commit, date, command)")
    return lines


@dataclass(frozen=True)
class ValidateCostLog:
    """What `python -m benchmarks.validate_cost` printed on the GPU: its provenance line, its last
    table, per workload and variant the (median, fastest) ratio to validate=False, minus 1, and
    validate=False's own (median, fastest) time in ms."""

    provenance: str
    text: str
    costs: dict[str, dict[str, tuple[float, float]]]
    baseline: dict[str, tuple[float, float]]  # validate=False's (median, fastest) ms: how noisy the row is


def validate_cost_log(path: Path = GPU_DATA / "logs" / "validate-cost-h200.log") -> ValidateCostLog:
    """The committed log of `benchmarks/validate_cost.py`: a '# ' provenance line, then its table."""
    lines = _log_lines(path, "python -m benchmarks.validate_cost")
    start = max(i for i, line in enumerate(lines) if line.startswith("workload")) - 1  # the last table, its title line
    table = [line for line in lines[start:] if line.strip()]
    variants = [v.strip() for v in table[1][len("workload") :].split("  ") if v.strip()]
    costs: dict[str, dict[str, tuple[float, float]]] = {}
    baseline: dict[str, tuple[float, float]] = {}
    for line in table[2:]:
        cells = re.findall(r"([\d.]+) \(([\d.]+)\)", line)
        name = line[: line.index(cells[0][0])].strip()
        medians, fastest = [float(m) for m, _ in cells], [float(f) for _, f in cells]
        costs[name] = {v: (m / medians[0] - 1, f / fastest[0] - 1) for v, m, f in zip(variants, medians, fastest)}
        baseline[name] = (medians[0], fastest[0])
    return ValidateCostLog(lines[0][2:], "\n".join(table), costs, baseline)


@dataclass(frozen=True)
class HostCostLog:
    """What `python -m benchmarks.host_cost` printed on the GPU: its provenance line, its table,
    and per variant the host time of one forward+backward in us, its Python function calls and
    its Triton launches (kernels stubbed out)."""

    provenance: str
    text: str
    variants: dict[str, tuple[float, int, float]]


def host_cost_log(path: Path = GPU_DATA / "logs" / "host-cost-h200.log") -> HostCostLog:
    """The committed log of `benchmarks/host_cost.py`: a '# ' provenance line, then its table."""
    lines = _log_lines(path, "python -m benchmarks.host_cost")
    start = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    variants = {}
    for line in lines[start + 1 :]:
        if line.strip():
            found = re.fullmatch(r"(.+?)\s+([\d.]+)\s+(\d+)\s+([\d.]+)", line.strip())
            if found is None:
                raise ValueError(f"{path}: {line!r} is not a variant, its host us, function calls and launches")
            name, host_us, calls, launches = found.groups()
            variants[name] = (float(host_us), int(calls), float(launches))
    return HostCostLog(lines[0][2:], "\n".join(lines[1:]), variants)


def targets(rows: list[Row]) -> list[Target]:
    """Issue 17's targets (bf16, ratios from one run), each with its worst configuration;
    a target whose peers did not run is left out."""
    ours = _our_rows(rows)
    by_impl = {(r.workload, r.impl): r for r in rows if not r.timing.error}
    equal = {w: r for w, r in ours.items() if w.startswith(EQUAL_D128)}
    found = [
        worst(
            f"forward+backward >= {bound}x {peer}, every workload it runs",
            {w: r.ratios[peer] for w, r in ours.items() if peer in r.ratios},
            bound,
            True,
        )
        for peer, bound in PEERS.items()
        if peer not in ("SDPA dense (cuDNN)", "FlashAttention-4 varlen")
    ]
    fa4 = "FlashAttention-4 varlen"
    found.append(
        worst(
            f"forward+backward >= {PEERS[fa4]}x {fa4}, every d128 workload it runs",
            {w: r.ratios[fa4] for w, r in ours.items() if fa4 in r.ratios and " d128" in w},
            PEERS[fa4],
            True,
        )
    )
    cudnn = "SDPA dense (cuDNN)"
    found += [
        worst(
            f"forward+backward >= {PEERS[cudnn]}x {cudnn}, d128 equal lengths",
            {w: r.ratios[cudnn] for w, r in equal.items() if cudnn in r.ratios},
            PEERS[cudnn],
            True,
        ),
        worst(
            f"forward >= {PEERS[cudnn]}x {cudnn}, d128 equal lengths",
            {w: r.ratios[cudnn + " (fwd)"] for w, r in equal.items() if cudnn + " (fwd)" in r.ratios},
            PEERS[cudnn],
            True,
        ),
        worst(
            "validate=True costs <= 5% over validate=False, forward, same metadata (8x2048)",
            _variant_ratio(rows, VALIDATION_VARIANTS["same"], "forward_ms", VALIDATE_AT),
            0.05,
            False,
        ),
        worst(
            "validate=True costs <= 5% over validate=False, forward+backward, same metadata (8x2048)",
            _variant_ratio(rows, VALIDATION_VARIANTS["same"], "forward_backward_ms", VALIDATE_AT),
            0.05,
            False,
        ),
        worst(
            "validate=True costs <= 5%, forward+backward, new metadata each call (8x2048)",
            _variant_ratio(rows, VALIDATION_VARIANTS["new"], "forward_backward_ms", VALIDATE_AT),
            0.05,
            False,
        ),
        worst(
            "host time of one forward+backward <= torch varlen_attn's (ratio)",
            {
                w: ratio(r.timing.host_ms, by_impl[(w, "torch varlen_attn")].timing.host_ms)
                for w, r in ours.items()
                if (w, "torch varlen_attn") in by_impl and r.timing.host_ms and by_impl[(w, "torch varlen_attn")].timing.host_ms
            },
            1.0,
            False,
        ),
        worst(
            f"forward+backward of FA4 behind our wrapper >= {GUARDED_FA4_BOUND}x {fa4} alone, every workload both run",
            _guarded_over_fa4(rows),
            GUARDED_FA4_BOUND,
            True,
        ),
        worst(
            "whole step captured in a CUDA graph: replay time over eager, forward+backward (benchmarked)",
            {w: c + 1 for w, c in _variant_ratio(rows, "ours CUDA graph", "forward_backward_ms").items()},
            1.0,
            False,
        ),
        worst(
            "padded layout (align 64, tail 256) costs <= 5% over unpadded, forward+backward", contract_costs(rows), 0.05, False
        ),
        worst(
            "peak memory of forward+backward <= torch varlen_attn's (ratio)",
            {
                w: ratio(r.timing.peak_mb, by_impl[(w, "torch varlen_attn")].timing.peak_mb)
                for w, r in ours.items()
                if (w, "torch varlen_attn") in by_impl and by_impl[(w, "torch varlen_attn")].timing.peak_mb
            },
            1.0,
            False,
        ),
    ]
    return [t for t in found if t is not None]


def kernel_times(record: dict) -> dict[str, dict[str, float]]:
    """Per workload of the record, our attention kernels alone beside the op as the benchmark
    timed it: the tuner's median of each chosen tile (one kernel, L2 flushed, from the record's
    `tiles`) and the op's forward and forward+backward times. What the op adds on top is the
    work lists, the padding fills, the delta pass, autograd's .grad accumulation and the host
    dispatch where it cannot keep ahead of the GPU (short documents). A shape class is timed on
    the first call that reaches it, so a later workload of the same class is left out."""
    from varlen_workbench.kernels.varlen.tuner import SHAPE_CLASS_FIELDS, shape_class  # Triton: only when asked

    # Records from before sliding windows lack the field: their classes had none; nor had they a
    # head dim of v's own.
    def field(t: dict, f: str):
        return t.get(f, False) if f == "sliding" else t.get(f, t["head_dim"]) if f == "head_dim_v" else t[f]

    tiles = {tuple(field(t, f) for f in SHAPE_CLASS_FIELDS): t for t in record["tiles"]}
    ours = _our_rows(rows_from_record(record))
    found, timed = {}, set()
    for w in workloads():  # the benchmark's order: a class is timed on its first workload only
        if w.name not in ours:
            continue
        c = w.case
        chosen = {}
        for kernel, side in (("forward", "q"), ("dkdv", "k"), ("dq", "q")):
            key = shape_class(
                kernel,
                c.torch_dtype,
                c.heads,
                c.head_dim,
                c.total_rows(side),
                c.batch,
                c.causal,
                c.heads // (c.kv_heads or c.heads),
                w.sliding,
            )
            if key in tiles and key not in timed:
                chosen[kernel] = tiles[key]["timings_ms"].get(tiles[key]["tile"], math.nan)
            timed.add(key)
        if len(chosen) == 3:
            t = ours[w.name].timing
            found[w.name] = {
                "forward kernel": chosen["forward"],
                "forward op": t.forward_ms,
                "all kernels": sum(chosen.values()),
                "forward+backward op": t.forward_backward_ms,
            }
    return found


def format_kernel_times(times: dict[str, dict[str, float]]) -> str:
    lines = [f"{'workload':<44} {'fwd kernel':>10} {'fwd op':>7} {'kernels':>8} {'f+b op':>7} {'kernels/op':>10}"]
    for name, t in times.items():
        lines.append(
            f"{name:<44} {t['forward kernel']:>10.3f} {t['forward op']:>7.3f} {t['all kernels']:>8.3f} "
            f"{t['forward+backward op']:>7.3f} {t['all kernels'] / t['forward+backward op']:>10.0%}"
        )
    return "\n".join(lines)


def host_times(rows: list[Row]) -> dict[str, dict[str, float]]:
    """Per workload, our host time to issue one forward+backward beside the GPU time per call
    (back to back), and varlen_attn's host time where it ran. Host time at or above the GPU
    time means the host, not the GPU, sets the pace: the kernels wait for their launches."""
    peers = {r.workload: r for r in rows if r.impl == "torch varlen_attn" and not r.timing.error}
    found = {}
    for name, r in _our_rows(rows).items():
        if r.timing.host_ms is None:
            continue  # a record from before host times were measured
        peer = peers.get(name)
        found[name] = {
            "host ms": r.timing.host_ms,
            "f+b ms": r.timing.forward_backward_ms if r.timing.forward_backward_ms is not None else math.nan,
            "varlen_attn host ms": peer.timing.host_ms if peer and peer.timing.host_ms else math.nan,
        }
    return found


def format_host_times(times: dict[str, dict[str, float]]) -> str:
    lines = [f"{'workload':<44} {'host ms':>8} {'f+b ms':>7} {'host/GPU':>8} {'varlen_attn host ms':>20}"]
    for name, t in times.items():
        lines.append(
            f"{name:<44} {t['host ms']:>8.3f} {t['f+b ms']:>7.3f} {t['host ms'] / t['f+b ms']:>8.0%} {t['varlen_attn host ms']:>20.3f}"
        )
    return "\n".join(lines)


def load_profile(path: Path = GPU_DATA / "ncu-h200.json") -> dict[str, Any]:
    """The committed Nsight Compute summary of our kernels and FlashAttention-2's (one workload)."""
    return read_record(path, how="ncu (the committed data/gpu/ncu-h200.json names the command)")


def format_profile(profile: dict[str, Any]) -> str:
    """One line per kernel: time under the profiler, SM throughput, issue, occupancy and its limits."""
    lines = [
        f"{'kernel':<48} {'us':>7} {'SM %':>5} {'IPC':>5} {'regs':>4} {'smem KB':>7} {'occ %':>5} {'blocks/SM by regs, smem':>24}"
    ]
    for k in profile["kernels"]:
        lines.append(
            f"{k['kernel']:<48} {k['duration_us']:>7.0f} {k['sm_throughput_pct']:>5.1f} {k['ipc_active']:>5.2f} "
            f"{k['registers_per_thread']:>4.0f} {k['shared_kb_per_block']:>7.1f} {k['theoretical_occupancy_pct']:>5.1f} "
            f"{k['block_limit_registers']:>14.0f}, {k['block_limit_shared_mem']:.0f}"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


TIMINGS_HEADER = (
    "workload",
    "impl",
    "fwd ms median (min)",
    "f+b ms median (min)",
    "fwd TF/s",
    "f+b TF/s",
    "fwd GB/s",
    "peak MB",
    "host ms",
)


def timings_table(rows: list[Row]):
    """One line per (workload, implementation) measured: a `varlen_workbench.workbench.postmortem.Table` (text in a
    terminal, an HTML table folded past its first rows on the site)."""
    cells = []
    for r in rows:
        t = r.timing
        if t.error:
            cells.append((r.workload, r.impl, f"failed: {t.error}", *["-"] * 6))
            continue
        cells.append(
            (
                r.workload,
                r.impl,
                ms_with_fastest(t.forward_ms, t.forward_min_ms),
                ms_with_fastest(t.forward_backward_ms, t.forward_backward_min_ms),
                f"{r.tflops_fwd:.1f}",
                f"{r.tflops_fwd_bwd:.1f}",
                f"{r.gbs_fwd:.0f}",
                f"{t.peak_mb:.0f}",
                _ms(t.host_ms),
            )
        )
    return table(TIMINGS_HEADER, cells, fold=16)


def format_table(rows: list[Row]) -> str:
    """What `varlen-workbench bench` prints: the timings, the padding contract's cost, the ratios."""
    lines = [str(timings_table(rows))]
    for name, cost in contract_costs(rows).items():
        lines.append(f"cost of the padding contract ({name} vs unpadded): {cost * 100:+.1f}% forward+backward time")
    lines.append("")
    lines.append("ratios (peer time / our time; > 1 means ours is faster), forward+backward and forward:")
    for r in rows:
        if r.impl == "ours" and r.ratios:
            pairs = ", ".join(f"{k} {v:.2f}x" for k, v in r.ratios.items())
            lines.append(f"  {r.workload}: {pairs}")
    return "\n".join(lines)


def fastest_calls(rows: list[Row]) -> list[Row]:
    """The rows with each time replaced by its fastest timed call (the median where a record kept
    none) and the peers' ratios recomputed from those: the targets judged on these and on the
    medians bound how much of a verdict is the machine's noise."""
    fastest = [
        dataclasses.replace(
            r,
            timing=dataclasses.replace(
                r.timing,
                forward_ms=r.timing.forward_min_ms or r.timing.forward_ms,
                forward_backward_ms=r.timing.forward_backward_min_ms or r.timing.forward_backward_ms,
            ),
            ratios={},
        )
        for r in rows
    ]
    for workload in dict.fromkeys(r.workload for r in fastest):
        set_peer_ratios({r.impl: r for r in fastest if r.workload == workload})
    return fastest


def speed_table(peer: str, records: list[dict] | None = None):
    """Our kernel's forward+backward time beside `peer`'s, per workload both ran in the committed
    benchmark (every data/gpu/bench-*.json, merged): the median with the fastest call in brackets,
    and the speed-up (> 1: ours is faster) on the medians and on the fastest calls."""
    record = merge_records(records or load_records("bench-*.json", how=RECORD_COMMAND))
    rows = rows_from_record(record)
    by = {(r.workload, r.impl): r for r in rows if not r.timing.error}
    fastest = {r.workload: r for r in fastest_calls(rows) if r.impl == "ours"}
    cells = []
    for (workload, impl), ours in by.items():
        theirs = by.get((workload, peer))
        if impl != "ours" or theirs is None:
            continue
        times = [ms_with_fastest(t.timing.forward_backward_ms, t.timing.forward_backward_min_ms) for t in (theirs, ours)]
        cells.append((workload, *times, f"{ours.ratios[peer]:.2f}x ({fastest[workload].ratios[peer]:.2f}x)"))
    header = ("workload", f"{peer} f+b ms median (min)", "ours f+b ms median (min)", "speed-up median (min)")
    return table(header, cells, title=f"on {record['provenance'].get('device', '?')}")


def workload_commits(records: list[dict]) -> dict[str, str]:
    """Per workload, the commit (7 hex digits) of the record that measured it: merged runs of
    disjoint workloads may come from different commits."""
    return {r["workload"]: str(rec["provenance"].get("commit", "?"))[:7] for rec in records for r in rec["rows"]}


def merge_records(records: list[dict]) -> dict:
    """One record from several runs of disjoint workloads (e.g. `--shapes` subsets): their rows
    and tiles in order; provenance fields that differ are joined with " | ", in the same order."""
    if not records:
        raise ValueError(
            "merge_records needs at least one record; load them with varlen_workbench.workbench.records.load_records('bench-*.json')"
        )
    seen = [r["workload"] for rec in records for r in {x["workload"]: x for x in rec["rows"]}.values()]
    twice = sorted({w for w in seen if seen.count(w) > 1})
    if twice:
        raise ValueError(f"records overlap on workloads {twice}: merge runs of disjoint workloads, or keep the newer run only")
    keys = list(dict.fromkeys(k for rec in records for k in rec["provenance"]))
    provenance = {}
    for k in keys:
        values = list(dict.fromkeys(str(rec["provenance"].get(k, "-")) for rec in records))
        provenance[k] = values[0] if len(values) == 1 else " | ".join(values)
    return {
        "provenance": provenance,
        "rows": [r for rec in records for r in rec["rows"]],
        "tiles": [t for rec in records for t in rec.get("tiles", [])],
        "files": [rec.get("file", "?") for rec in records],
    }


def records_table(record: dict) -> str:
    """The table `varlen-workbench bench` printed for this record, rebuilt from its rows."""
    return format_table(rows_from_record(record))


def plot_records(record: dict, ax=None):
    """Forward+backward TFLOP/s per workload, one bar per implementation (failed runs omitted)."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows_from_record(record) if r.tflops_fwd_bwd]
    workloads_ = list(dict.fromkeys(r.workload for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    if ax is None:
        _, ax = plt.subplots(figsize=(13, 6), layout="constrained")
    width = 0.8 / len(impls)
    # tab20's ten strong colours, then their light twins: a record has more than the ten of the
    # default cycle (eleven implementations and variants), and no two may share one.
    palette = plt.colormaps["tab20"].colors
    colors = palette[::2] + palette[1::2]
    for i, impl in enumerate(impls):
        values = {r.workload: r.tflops_fwd_bwd for r in rows if r.impl == impl}
        xs = [j + i * width for j, w in enumerate(workloads_) if w in values]
        ax.bar(xs, [values[w] for w in workloads_ if w in values], width, label=impl, color=colors[i % len(colors)])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads_))])
    # Slanted, anchored at their right end: long names stay clear of their neighbours.
    ax.set_xticklabels(workloads_, fontsize=7, rotation=35, ha="right", rotation_mode="anchor")
    ax.set_ylabel("forward+backward TFLOP/s")
    p = record["provenance"]
    ax.set_title(f"{p['device']}, torch {p['torch']}, triton {p['triton']} ({p['date']})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes, clear of the bars
    return ax


def ratios_by_workload(record: dict) -> dict[str, dict[str, tuple[float, float]]]:
    """Per workload, {peer: (forward+backward ratio, forward ratio)} for the peers of `PEERS`
    that ran (peer time / our time: > 1 means ours is faster)."""
    found = {}
    for r in rows_from_record(record):
        if r.impl == "ours" and not r.timing.error:
            found[r.workload] = {
                peer: (r.ratios[peer], r.ratios.get(peer + " (fwd)", math.nan)) for peer in PEERS if peer in r.ratios
            }
    return found


def plot_ratios(record: dict, axes=None):
    """Our speed against each peer of `PEERS`, per workload: horizontal bars (workload names on
    the y axis, never overlapping) of peer time / our time, forward+backward (left) and forward
    (right), with each peer's target as a dashed line in its colour."""
    import matplotlib.pyplot as plt

    ratios = ratios_by_workload(record)
    names = list(ratios)
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 1.8), sharey=True, layout="constrained")
    height = 0.8 / len(PEERS)
    colors = dict(zip(PEERS, ("tab:blue", "tab:orange", "tab:green", "tab:purple")))
    for ax, which, title in zip(axes, (0, 1), ("forward+backward", "forward")):
        for i, peer in enumerate(PEERS):
            ys = [j + i * height for j, w in enumerate(names) if peer in ratios[w]]
            xs = [ratios[w][peer][which] for w in names if peer in ratios[w]]
            ax.barh(ys, xs, height, color=colors[peer], label=f"vs {peer} (target {PEERS[peer]}x)")
            ax.axvline(PEERS[peer], color=colors[peer], linestyle="--", linewidth=1)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel(f"{title}: peer time / our time (> 1: ours faster)")
        ax.set_title(title, fontsize=9)
    axes[0].set_yticks([j + 0.4 - height / 2 for j in range(len(names))])
    axes[0].set_yticklabels(names, fontsize=7)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].figure.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=len(PEERS))  # clear of the bars
    p = record["provenance"]
    axes[0].figure.suptitle(
        f"Ratios per workload: {p['device']}, torch {p['torch']}, triton {p['triton']} ({p['date']})", fontsize=9
    )
    return axes


# -- the training step (varlen_workbench.workbench.bench.stepbench) ---------------------------------------------------
