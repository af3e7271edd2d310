"""The kernel benchmark's record: what one measurement is (`Timing`, `Row`), how implementations
are named, the peers' ratios, and the rows written to and read back from the record.

`varlen_workbench.workbench.bench.kernels` measures and writes; `varlen_workbench.workbench.bench.kernel_report`
reads and judges. Both import this module, never each other's internals the other way round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

RECORD_COMMAND = "python -m varlen_workbench.workbench.bench.kernels --record data/gpu/bench-<gpu>.json"


def variant(backend: str) -> str:
    """The benchmark's name for our call pinned to `backend`: "ours" for the Triton kernel (the
    records' name), "ours backend=<name> (<label>)" for every other registered backend."""
    from varlen_workbench.kernels.varlen.backends import lookup

    return "ours" if backend == "triton" else f"ours backend={backend} ({lookup(backend).label})"


GUARDED_FA4 = variant("fa4")


@dataclass
class Timing:
    forward_ms: float | None = None
    forward_backward_ms: float | None = None
    peak_mb: float | None = None
    host_ms: float | None = None  # host time to issue one forward+backward (Python, dispatch, launches)
    error: str | None = None
    # The fastest timed call beside the medians above: how much of a median is noise (records
    # made before 2026-12-02 lack them).
    forward_min_ms: float | None = None
    forward_backward_min_ms: float | None = None


def ratio(numerator: float | None, denominator: float | None) -> float:
    """numerator / denominator, NaN when either was not measured (None) or the denominator is 0."""
    return numerator / denominator if numerator is not None and denominator else math.nan


@dataclass
class Row:
    workload: str
    impl: str
    timing: Timing
    tflops_fwd: float | None = None
    tflops_fwd_bwd: float | None = None
    gbs_fwd: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)


def set_peer_ratios(results: dict[str, Row]) -> None:
    """Our row of one workload gets each peer's time over ours, forward+backward and forward."""
    ours = results.get("ours")
    if ours and ours.timing.forward_ms:
        ours.ratios = {}
        for name, row in results.items():
            if not name.startswith("ours") and row.timing.forward_ms:
                ours.ratios[name] = ratio(row.timing.forward_backward_ms, ours.timing.forward_backward_ms)
                ours.ratios[name + " (fwd)"] = ratio(row.timing.forward_ms, ours.timing.forward_ms)


def to_record(rows: list[Row], tiles: list[dict] | None = None) -> dict:
    """The record's payload (`write_record` adds the provenance); `tiles` is what the tuner chose
    for our kernel (tuner().report())."""
    return {
        "rows": [
            {
                "workload": r.workload,
                "impl": r.impl,
                **{k: v for k, v in vars(r.timing).items()},
                "tflops_fwd": r.tflops_fwd,
                "tflops_fwd_bwd": r.tflops_fwd_bwd,
                "gbs_fwd": r.gbs_fwd,
                "ratios": r.ratios,
            }
            for r in rows
        ],
        "tiles": tiles or [],
    }


def rows_from_record(record: dict) -> list[Row]:
    """The rows of a record written by `to_record`, for `format_table` and the plots."""
    timing_fields = set(Timing.__dataclass_fields__)
    return [
        Row(
            r["workload"],
            r["impl"],
            Timing(**{k: r[k] for k in timing_fields if k in r}),  # older records lack host_ms
            r["tflops_fwd"],
            r["tflops_fwd_bwd"],
            r["gbs_fwd"],
            dict(r["ratios"]),
        )
        for r in record["rows"]
    ]
