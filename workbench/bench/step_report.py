"""What a training-step run means (`varlen_workbench.workbench.bench.stepbench`): the step's targets, its
tables of times and host syncs, and the record read back (the performance page)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from varlen_workbench.workbench.bench.step_record import (
    BARE_FA4,
    DEFAULT,
    PADDED_SDPA,
    PHASES,
    RECORD_COMMAND,
    VARLEN_ATTN,
    train_step_ratios,
)
from varlen_workbench.workbench.bench.verdict import Target, format_targets, ms_with_fastest, worst
from varlen_workbench.workbench.instruments.syncs import OWNERS
from varlen_workbench.workbench.postmortem import table
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import read_record

# Issue 34's targets for the whole step: the peer's step time over the default's (> 1: the default is faster).
TRAIN_STEP_TARGETS = {BARE_FA4: 0.97, VARLEN_ATTN: 1.0, PADDED_SDPA: 1.5}


def load_train_step(path: Path = GPU_DATA / "train-step-h200.json") -> dict[str, Any]:
    """The committed training-step record (`python -m varlen_workbench.workbench.bench.stepbench --record ...`)."""
    return read_record(path, how=RECORD_COMMAND)


OUR_SYNCS_PER_FORWARD = 1  # issue 34: our code syncs at most once per forward, whatever the batch kind, never per layer


def our_forward_syncs(record: dict[str, Any]) -> dict[str, int]:
    """Per batch kind counted (`batch_syncs`), the host syncs our code made in the step's forward."""
    return {
        kind: syncs["by_phase"].get("forward", {}).get("ours", 0)
        for kind, syncs in record.get("batch_syncs", {}).items()
        if "error" not in syncs
    }


def train_step_targets(record: dict[str, Any]) -> tuple[list[Target], list[Target]]:
    """The step's targets judged on the medians and on the fastest steps, the host-sync target
    (a count: judged once, with the medians) on every batch kind counted; a target whose
    measurement is missing is left out (`format_train_step` names it and why)."""
    ratios = train_step_ratios(record["rows"])
    documents = record["shape"]["size"]["documents"]
    where = f"{len(documents)} documents, {sum(documents)} tokens packed"
    medians, fastest = (
        [
            Target(f"training step: the default >= {bound}x {peer}", ratios[peer][which], bound, True, where)
            for peer, bound in TRAIN_STEP_TARGETS.items()
            if peer in ratios
        ]
        for which in ("median", "fastest")
    )
    syncs = worst(
        f"host syncs of our code per forward <= {OUR_SYNCS_PER_FORWARD}, every batch kind (default backend)",
        {kind: float(n) for kind, n in our_forward_syncs(record).items()},
        OUR_SYNCS_PER_FORWARD,
        False,
    )
    return medians + ([syncs] if syncs else []), fastest


def _by_owner(syncs: dict[str, Any] | None) -> str:
    return "-" if syncs is None else " / ".join(str(syncs["by_owner"][o]) for o in OWNERS)


def _by_phase(syncs: dict[str, Any] | None, owner: str | None = None) -> str:
    """Host syncs per phase ("forward / backward"), of `owner`'s code or everyone's."""
    if syncs is None:
        return "-"
    counts = [syncs["by_phase"].get(phase, {}) for phase in PHASES]
    return " / ".join(str(c.get(owner, 0) if owner else sum(c.values())) for c in counts)


def batch_syncs_table(record: dict[str, Any]):
    """Per batch kind, the host syncs of one step through our swap (the default backend): all,
    by owner, and ours and transformers' per phase."""
    cells = []
    for kind, syncs in record.get("batch_syncs", {}).items():
        if "error" in syncs:
            cells.append((kind, f"failed: {syncs['error']}", "-", "-", "-"))
            continue
        cells.append(
            (kind, str(syncs["host_syncs"]), _by_owner(syncs), _by_phase(syncs, "ours"), _by_phase(syncs, "transformers"))
        )
    phases = " / ".join(PHASES)
    header = ("batch", "host syncs", " / ".join(OWNERS), f"ours: {phases}", f"transformers: {phases}")
    return table(header, cells, title="host syncs per step of our swap, per batch kind", fold=len(cells))


def train_step_table(record: dict[str, Any]):
    """One line per implementation: its step time (median, fastest in brackets), the default's
    speed-up over it, its host syncs per step by owner and by phase, peak memory, loss, and a
    note: why it was skipped, its error, or what it is."""
    ratios = train_step_ratios(record["rows"])
    cells = []
    for r in record["rows"]:
        note = r["detail"] if r["status"] == "ran" else f"{r['status']}: {r['detail']}"
        if r["status"] != "ran":
            cells.append((r["impl"], *["-"] * 7, note))
            continue
        ratio_ = ratios.get(r["impl"])
        syncs = r["syncs"]
        cells.append(
            (
                r["impl"],
                ms_with_fastest(r["median_ms"], r["min_ms"]),
                "-" if ratio_ is None else f"{ratio_['median']:.3f}x ({ratio_['fastest']:.3f}x)",
                "-" if syncs is None else str(syncs["host_syncs"]),
                _by_owner(syncs),
                _by_phase(syncs),
                "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}",
                f"{r['loss']:.4f}",
                note,
            )
        )
    header = (
        "implementation",
        "step ms median (min)",
        "default's speed-up median (min)",
        "host syncs",
        " / ".join(OWNERS),
        " / ".join(PHASES),
        "peak MB",
        "loss",
        "note",
    )
    size, device = record["shape"]["size"], record["provenance"]["device"]
    title = f"{size['layers']}-layer Llama, {sum(size['documents'])} tokens in {len(size['documents'])} documents, on {device}"
    return table(header, cells, title=title, fold=len(cells))


def sync_examples(record: dict[str, Any], frames: int = 8) -> str:
    """Per implementation (and per batch kind of the default) and owner, the first host sync's
    call and its innermost `frames` frames."""
    counted = [(r["impl"], r.get("syncs")) for r in record["rows"]]
    counted += [(f"{DEFAULT}, {kind} batch", syncs) for kind, syncs in record.get("batch_syncs", {}).items()]
    lines = []
    for name, syncs in counted:
        for who, stack in ((syncs or {}).get("examples") or {}).items():
            lines.append(f"{name}, {who}: {stack[0]}")
            lines += [f"    {frame}" for frame in stack[1 : frames + 1]]
    return "\n".join(lines)


def format_train_step(record: dict[str, Any]) -> str:
    """What `python -m varlen_workbench.workbench.bench.stepbench` prints: the table, the targets side by side on the
    medians and the fastest steps, the targets not judged and why, one example stack per owner."""
    medians, fastest = train_step_targets(record)
    timed = train_step_ratios(record["rows"])
    rows = {r["impl"]: r for r in record["rows"]}

    def why(peer: str) -> str:
        if not timed:
            return "the default was not timed"
        row = rows.get(peer)
        return "not run" if row is None else f"{row['status']}: {row['detail']}" if row["status"] != "ran" else "untimed"

    missing = [
        f"not judged: the default >= {bound}x {peer} ({why(peer)})"
        for peer, bound in TRAIN_STEP_TARGETS.items()
        if peer not in timed
    ]
    if not our_forward_syncs(record):
        missing.append("not judged: host syncs of our code per forward (no batch kind counted: a CUDA run counts them)")
    parts = [str(train_step_table(record))]
    if record.get("batch_syncs"):
        parts.append(str(batch_syncs_table(record)))
    if medians:
        parts.append(format_targets(medians, fastest))
    if missing:
        parts.append("\n".join(missing))
    examples = sync_examples(record)
    if examples:
        parts.append("host syncs, one example per implementation and owner (innermost frame first):\n" + examples)
    return "\n\n".join(parts)
