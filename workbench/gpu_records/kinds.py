"""The one table of GPU record kinds: for each committed record under data/gpu/ (by file name),
the code it measured, the command that remakes it, and how long that takes.

What a kind measured is what makes its record stale when it changes (`varlen_workbench.workbench.
fingerprint`): our kernel's sources for our records; the adapter and the upstream version for an
audit row of an upstream library; for TransformerEngine's records, TE's version and our case
runner. Paths are repository folders (every .py under them) or files, as they are now; a record
made earlier is fingerprinted from the paths as they were at its commit.

`minutes` is the estimate for a record that does not say how long it took (an audit's `seconds`
does). `varlen-workbench gpu-records` (`make gpu-records`) reads this table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# The upstream versions the records are meant to measure (what the GPU image and the carried
# wheels hold; pyproject's extras pin the ones we install). A record that names no version of
# its upstream is taken to have run this one.
UPSTREAM = {
    "torch": "2.11.0",
    "triton": "3.6.0",
    "flash-attn-4": "4.0.0b36",
    "flash-dmattn": "1.2.2",
    "flash-sparse-attn": "2.0.6",
    "nvidia-cudnn-frontend": "1.32.0",
    "transformer-engine": "2.20.2",
}
# Upstream packages the GPU image lacks: a call that remakes their records carries the wheels first.
CARRIED = {"flash-attn-4", "flash-dmattn", "flash-sparse-attn", "nvidia-cudnn-frontend", "transformer-engine"}

# The calls before any record: the wheels of CARRIED packages, then the native GPU tests.
WHEELS = ("bash ../shared/tools/gpu-wheels.sh", 3.0)
TESTS = ("python -m pytest -q -p no:nbval -m gpu tests", 6.0)

# Our kernel: what every record of ours measured.
OURS = ("kernels/varlen", "kernels/runtime.py", "kernels/_compat.py", "kernels/contract.py", "kernels/interpreter.py")
MATRIX_ROW = "python scripts/gpu_audit_matrix.py --rows {row} --force"  # the row's audit and sanitizer runs, complete or not
ADAPTERS = "workbench/audit/adapters/"


# Measured files that moved: their path now -> where they were before (a record made earlier is
# fingerprinted from git history, the code at its commit).
FORMERLY = {
    "workbench/instruments/realclient.py": "workbench/realclient.py",
    "workbench/instruments/sdpa_dispatch.py": "workbench/sdpa_dispatch.py",
}


def former_paths(measures: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(FORMERLY[m] for m in measures if m in FORMERLY)


@dataclass(frozen=True)
class RecordKind:
    pattern: str  # a regular expression the whole file name matches; a group `row` names an audit matrix row
    measures: tuple[str, ...]  # repository paths of the code it measured
    upstream: tuple[str, ...]  # UPSTREAM packages whose version is part of what it measured
    command: str | None  # what remakes it ({file}, {row}); None: no command remakes it now (why in `note`)
    minutes: float
    note: str = ""

    def command_for(self, name: str) -> str | None:
        if self.command is None:
            return None
        match = re.fullmatch(self.pattern, name)
        fields = {"file": f"data/gpu/{name}", **(match.groupdict() if match else {})}
        return self.command.format(**fields)


def _row(rows: str, measures: tuple[str, ...], upstream: tuple[str, ...], minutes: float = 6.0) -> RecordKind:
    """An audit matrix row's audit and sanitizer records."""
    return RecordKind(rf"(audit|sanitizer)-(?P<row>{rows})\.json", measures, upstream, MATRIX_ROW, minutes)


def _repro(pm: str, folder: str, upstream: tuple[str, ...], suffix: str = "h200", minutes: float = 4.0) -> RecordKind:
    """A post-mortem's GPU probes (`varlen-workbench repro ID --device cuda --record`)."""
    return RecordKind(
        rf"{pm}-{suffix}\.json",
        (f"postmortems/{folder}",),
        upstream,
        f"varlen-workbench repro {pm} --device cuda --record {{file}}",
        minutes,
    )


KINDS: tuple[RecordKind, ...] = (
    # Our kernel, audited and sanitized (the matrix's reference row), alone and behind FA4.
    _row("ours", OURS, ("torch", "triton")),
    _row("ours-fa4", OURS, ("torch", "triton", "flash-attn-4")),
    RecordKind(
        r"audit-kernels\.json",
        OURS,
        ("torch", "triton"),
        "varlen-workbench audit varlen_workbench.kernels.varlen:varlen_attention --device cuda --budget 5000 "
        "--workers 6 --record {file}",
        4.0,
    ),
    RecordKind(r"audit-sanitizer\.json", OURS, ("torch", "triton"), "python scripts/gpu_audit_matrix.py --only-sanitizer", 8.0),
    # Upstream rows of the audit matrix: the adapter and the upstream version.
    _row("torch-varlen", (ADAPTERS + "varlen.py",), ("torch",)),
    RecordKind(
        r"audit-torch-varlen-campaign\.json",
        (ADAPTERS + "varlen.py", "workbench/malformed.py"),
        ("torch",),
        "varlen-workbench audit torch.nn.attention.varlen:varlen_attn --device cuda --campaign --budget 0 --record {file}",
        2.0,
    ),
    RecordKind(
        r"audit-torch-varlen-earlier\.json",
        (ADAPTERS + "varlen.py",),
        ("torch",),
        None,
        2.0,
        "the audit before the matrix, kept as history",
    ),
    _row("sdpa-(flash|efficient|math|cudnn)", (ADAPTERS + "padded.py",), ("torch",)),
    _row("sdpa-nested", (ADAPTERS + "nested.py",), ("torch",)),
    _row("flex-document", (ADAPTERS + "flex.py",), ("torch",)),
    _row("dmattn-(triton|triton-nobias|flex)", (ADAPTERS + "padded.py",), ("flash-dmattn",)),
    _row("fsa-(dense|sparse)-varlen", (ADAPTERS + "fsa.py",), ("flash-sparse-attn",)),
    _row("fa4", (ADAPTERS + "varlen.py",), ("flash-attn-4",)),
    _row("cudnn-ragged", (ADAPTERS + "cudnn_ragged.py",), ("nvidia-cudnn-frontend",)),
    _row("te|te-fp8", (ADAPTERS + "te.py",), ("transformer-engine",)),
    # Benchmarks and profiles of our kernel.
    RecordKind(
        r"bench-h200\.json",
        OURS,
        ("torch", "triton"),
        "varlen-workbench bench --shapes 8x2048 4x16384 --record {file}",
        6.0,
    ),
    RecordKind(
        r"bench-h200-mixes\.json",
        OURS,
        ("torch", "triton"),
        "varlen-workbench bench --shapes 'short docs' long-tail --record {file}",
        6.0,
    ),
    RecordKind(
        r"bench-h200-log-uniform\.json",
        OURS,
        ("torch", "triton"),
        "varlen-workbench bench --shapes log-uniform --record {file}",
        6.0,
    ),
    RecordKind(
        r"backward-modes-h200\.json",
        OURS,
        ("torch", "triton"),
        None,
        3.0,
        "benchmarks/backward_modes.py is gone",
    ),
    RecordKind(
        r"hopper-forward-h200\.json",
        OURS,
        ("torch", "triton"),
        "python benchmarks/hopper_forward.py --record {file}",
        5.0,
    ),
    RecordKind(r"ncu-h200\.json", OURS, ("torch", "triton"), None, 5.0, "its ncu command is in the record"),
    RecordKind(
        r"initcheck-tma-control-h200\.json",
        (*OURS, "scripts/initcheck_tma_control.py"),
        ("torch", "triton"),
        "python scripts/initcheck_tma_control.py --record {file}",
        3.0,
    ),
    RecordKind(
        r"real-client-h200\.json",
        (*OURS, "workbench/instruments/realclient.py", "workbench/reference.py"),
        ("torch", "triton"),
        "python -m varlen_workbench.workbench.instruments.realclient --size h200 --device cuda --record {file}",
        5.0,
    ),
    RecordKind(
        r"real-client-h200-fa4\.json",
        (*OURS, "workbench/instruments/realclient.py", "workbench/reference.py"),
        ("torch", "triton", "flash-attn-4"),
        "python -m varlen_workbench.workbench.instruments.realclient --size h200 --device cuda "
        "--backends 'FlashAttention-4 varlen' --record {file}",
        4.0,
    ),
    RecordKind(
        r"paste-blocks-h200\.json",
        ("postmortems/torch_varlen_176793", "postmortems/fa4_unwritten_padding", "tests/test_snippets.py"),
        ("torch", "flash-attn-4"),
        None,
        3.0,
        "its pytest command is in the record (it needs the published site)",
    ),
    # Post-mortems' GPU probes: the post-mortem's code and the upstream version it probes.
    _repro("torch-varlen-176793", "torch_varlen_176793", ("torch",)),
    RecordKind(
        r"torch-varlen-176793-h200-damage\.json",
        ("postmortems/torch_varlen_176793",),
        ("torch",),
        None,
        2.0,
        "its command is in the record",
    ),
    _repro("flash-dmattn-121", "flash_dmattn_121", ("flash-dmattn",)),
    _repro("flash-dmattn-flex-mask", "flash_dmattn_flex_mask", ("flash-dmattn",)),
    _repro("sdpa-cudnn-masked-rows", "sdpa_cudnn_masked_rows", ("torch",)),
    _repro("triton-interpreter-bf16-dot", "triton_interpreter_bf16_dot", ("triton",)),
    RecordKind(
        r"sdpa-default-backend-h200\.json",
        ("workbench/instruments/sdpa_dispatch.py",),
        ("torch",),
        "python -m varlen_workbench.workbench.instruments.sdpa_dispatch --record {file}",
        2.0,
    ),
    RecordKind(
        r"fsa-misaligned\.json",
        ("postmortems/fsa_varlen_descriptors", "scripts/fsa_misaligned.py"),
        ("flash-sparse-attn",),
        "python scripts/fsa_misaligned.py --device cuda --json {file}",
        4.0,
    ),
    RecordKind(
        r"fsa-workaround-h200\.json",
        ("postmortems/fsa_varlen_descriptors", "scripts/fsa_misaligned.py"),
        ("flash-sparse-attn",),
        "python scripts/fsa_misaligned.py --device cuda --cases aligned --workaround --no-autotune --json {file}",
        3.0,
    ),
    # TransformerEngine: TE's version and our case runner (the modules its scripts run, not the
    # post-mortem's prose).
    RecordKind(
        r"te-(install|probe|reuse)-h\d+\.json",
        ("scripts/te_install.py",),
        ("transformer-engine",),
        None,
        8.0,
        "builds TE from source: see the te-thd-2892 page's runbook",
    ),
    RecordKind(
        r"te-thd-2892-cases-h200\.json",
        ("postmortems/te_thd_2892/upstream.py", "scripts/te_thd_cases.py"),
        ("transformer-engine",),
        "python scripts/te_thd_cases.py --jobs 6 --timeout 200 --record {file}",
        5.0,
    ),
    RecordKind(
        r"te-thd-2892-probes-h100\.json",
        ("postmortems/te_thd_2892/upstream.py", "postmortems/te_thd_2892/te_probes.py", "scripts/te_probes.py"),
        ("transformer-engine",),
        "python scripts/te_probes.py --jobs 5 --timeout 240 --record {file}",
        5.0,
    ),
    RecordKind(
        r"te-thd-2892-training-h200\.json",
        ("postmortems/te_thd_2892/training.py", "scripts/te_thd_training.py"),
        ("transformer-engine",),
        "python scripts/te_thd_training.py --record {file}",
        3.0,
    ),
)


def kind_of(name: str) -> RecordKind:
    """The kind of the record file `name` (a file name under data/gpu/)."""
    for kind in KINDS:
        if re.fullmatch(kind.pattern, name):
            return kind
    raise LookupError(
        f"data/gpu/{name} matches no record kind; declare what it measured and how to remake it "
        "in varlen_workbench.workbench.gpu_records.kinds.KINDS"
    )


def recorded_minutes(record: dict[str, Any], kind: RecordKind) -> float:
    """How long remaking `record` takes: its own `seconds` where it has them, else the kind's estimate."""
    seconds = record.get("seconds")
    return seconds / 60 if isinstance(seconds, (int, float)) and seconds > 0 else kind.minutes
