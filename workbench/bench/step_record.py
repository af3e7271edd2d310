"""The training-step benchmark's record: its command, the names of what it times, the phases it
counts host syncs in, and each implementation's step time over the default's.

`varlen_workbench.workbench.bench.stepbench` measures and writes; `varlen_workbench.workbench.bench.step_report`
reads and judges. Both import this module.
"""

from __future__ import annotations

from typing import Any

RECORD_COMMAND = "python -m varlen_workbench.workbench.bench.stepbench --record data/gpu/train-step-h200.json"


PHASES = ("forward", "backward")  # the step's profiler ranges: host syncs are counted per phase


# The implementations the step times (`stepbench.IMPLEMENTATIONS`), by the names the record keeps.
DEFAULT = "ours, default backend"
TRITON = 'ours, backend="triton"'
OURS_FA4 = 'ours, backend="fa4"'
BARE_FA4 = "FlashAttention-4 varlen, bare"
VARLEN_ATTN = "torch varlen_attn"
PADDED_SDPA = "transformers sdpa, right-padded"


def train_step_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per implementation timed beside the default: its step time over the default's, on the
    medians and on the fastest steps ({"median": x, "fastest": y}; > 1: the default is faster)."""
    timed = {r["impl"]: r for r in rows if r.get("median_ms")}
    ours = timed.get(DEFAULT)
    if ours is None:
        return {}
    return {
        name: {"median": r["median_ms"] / ours["median_ms"], "fastest": r["min_ms"] / ours["min_ms"]}
        for name, r in timed.items()
        if name != DEFAULT
    }
