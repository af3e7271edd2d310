"""The tables of fsa-varlen-descriptors."""

from __future__ import annotations

from varlen_workbench.postmortems.fsa_varlen_descriptors.cases import CASES, FUNCTIONS, ROWS, TAIL_CASES
from varlen_workbench.postmortems.fsa_varlen_descriptors.study import FsaDescriptorResults
from varlen_workbench.workbench.postmortem import table

GRADS = ("out", "dq", "dk", "dv")


def calls_table(results: FsaDescriptorResults, function: str = FUNCTIONS[0]):
    """Each replayed call of `function` under the interpreter, bare and with the workarounds: the
    descriptors that would fault on the GPU, and the error of REAL rows in units of PyTorch's own."""
    rows = []
    for case in CASES:
        for call in (c for c in results.calls if c.function == function and c.case == case):
            p = call.probe
            rows.append(
                (
                    case.label(),
                    call.variant,
                    call.misaligned,
                    call.zero_extent,
                    *(p.errors[n].ratio for n in GRADS),
                    p.real_within_bound,
                )
            )
    header = ("call", "variant", "lse bases misaligned", "descriptors of extent 0", *(f"{n} error / fp16's" for n in GRADS))
    return table((*header, "REAL rows within bound"), rows, title=function)


def tail_table(results: FsaDescriptorResults):
    """The calls with TAIL rows in NaN-poisoned memory, through both functions, bare and with the
    workarounds: non-finite values on TAIL rows, whether every padding row is exactly 0, REAL rows."""
    rows = [
        (
            call.function.removesuffix("_attn_varlen_func"),
            call.case.label(),
            call.variant,
            *(call.probe.nonfinite[n]["TAIL"] for n in GRADS),
            call.probe.padding_exactly_zero,
            call.probe.real_within_bound,
            call.misaligned,
        )
        for case in TAIL_CASES
        for call in results.poisoned
        if call.case == case
    ]
    header = ("function", "call", "variant", *(f"{n}: TAIL non-finite" for n in GRADS), "TAIL rows exactly 0")
    return table((*header, "REAL rows within bound", "lse bases misaligned"), rows, title="in NaN-poisoned memory")


def descriptor_table(results: FsaDescriptorResults, case, function: str = FUNCTIONS[0], variant: str = "as is"):
    """Every descriptor one call builds, per kernel and source line: programs, base address mod 16, extent 0."""
    call = results.call(function, variant, case)
    return table(
        ("kernel", "source line", "programs", "base mod 16: programs", "extent 0", "Triton's rule"),
        [
            (
                d["kernel"],
                d["site"],
                d["programs"],
                ", ".join(f"{m}: {n}" for m, n in sorted(d["base_mod16"].items(), key=lambda x: int(x[0]))),
                d.get("zero_extent", 0),
                d.get("violation", "kept"),
            )
            for d in call.descriptors
        ],
        title=f"{function} on {case.label()}",
    )


def audit_table(results: FsaDescriptorResults):
    """The H200 audit of both rows: each check's verdict and what it raised (each check in a fresh process)."""
    names = [c["name"] for c in results.audits[ROWS[FUNCTIONS[0]]]["checks"]]
    rows = []
    for name in names:
        cells = [next(c for c in results.audits[row]["checks"] if c["name"] == name) for row in ROWS.values()]
        rows.append((name, *(f"{c['verdict']}: {c['evidence'].splitlines()[0]}" for c in cells)))
    return table(("check", *ROWS.values()), rows)


def sanitizer_table(results: FsaDescriptorResults):
    """compute-sanitizer on the H200, per row and tool: error count and the first frame reported."""
    return table(
        ("row", "tool", "errors", "first reported"),
        [
            (row, tool, r["errors"], r["first"])
            for row, record in results.sanitizers.items()
            for tool, r in record["tools"].items()
        ],
    )


def misaligned_h200_table(results: FsaDescriptorResults):
    """Each call of scripts/fsa_misaligned.py alone on the H200 (CUDA_LAUNCH_BLOCKING=1): how far it
    got, what it raised where, and the lse base of each backward preprocess program mod 16 bytes."""
    rows = []
    for call in results.misaligned_h200["results"]:
        bases = [m for launch in call["preprocess_lse_bases"] for m in launch["base_mod16"].values()]
        where = call.get("library_frames", [""])[-2:-1] or [""]
        rows.append(
            (
                call["function"].removesuffix("_attn_varlen_func"),
                call["case"],
                str(call["cu_seqlens_q"]),
                call["stage"],
                call.get("error", "").removeprefix("RuntimeError: "),
                where[0],
                ", ".join(map(str, bases)),
            )
        )
    header = ("function", "call", "cu_seqlens_q", "reached", "raised", "at", "lse bases mod 16 (bytes)")
    return table(header, rows)
