"""What `varlen-workbench audit --help` says of the audit without importing it (the audit imports
torch: seconds): the names of its checks and built-in adapters, its dtypes and per-device defaults.

Each fact is declared here once. The audit reads its defaults from here, and its registries
(`varlen_workbench.workbench.audit.checks.CHECKS`, `varlen_workbench.workbench.audit.adapters.ADAPTERS`)
refuse to load when what they register differs from the names below, so that a check or an
adapter added there and not here (or the reverse) fails at once.
"""

from __future__ import annotations

from collections.abc import Mapping

# The audit's checks, in the order they run and are reported.
CHECKS = (
    "real-accuracy",
    "tail-rows",
    "gap-rows",
    "padding-leak",
    "empty-sequences",
    "no-real-query",
    "custom-scale",
    "fully-masked-rows",
    "causal-unequal",
    "gqa",
    "sliding-window",
    "lse",
    "determinism",
    "context-parallel",
    "input-validation",
)

# The adapters the audit registers, in registration order (detection order), besides one
# `ours-<backend>` per backend of `varlen_attention` (BACKEND_ADAPTER_PREFIX).
ADAPTERS = (
    "context-parallel",
    "flex-document",
    "bshd",
    "sdpa-math",
    "sdpa-efficient",
    "sdpa-flash",
    "sdpa-cudnn",
    "dmattn",
    "dmattn-nobias",
    "sdpa-nested",
    "te-thd",
    "ours",
    "torch-varlen",
    "flash-attn",
    "fa4",
    "fsa-varlen",
    "cudnn-ragged",
    "contract",
)
BACKEND_ADAPTER_PREFIX = "ours-"  # ours-triton: varlen_attention pinned to the triton backend

CASE_DTYPES = ("float32", "float16", "bfloat16")  # what the checks' cases can be built in

# Per device type ("cpu": the Triton interpreter or PyTorch's CPU kernels; "cuda": native).
DEFAULT_BUDGET = {"cpu": 20, "cuda": 1000}  # layouts: the interpreter runs ~1 layout/s, a GPU hundreds
DEFAULT_DTYPE = {"cpu": "float32", "cuda": "float16"}
# Natively, head dim 64 shares Triton compilations with the fuzzer's native profile.
DEFAULT_HEAD_DIM = {"cpu": 32, "cuda": 64}


def per_device(defaults: Mapping[str, object]) -> str:
    """A per-device default as help text: "20 on CPU, 1000 on CUDA"."""
    return ", ".join(f"{value} on {device.upper()}" for device, value in defaults.items())


def registered_as_declared(what: str, registered: list[str], declared: tuple[str, ...]) -> None:
    """Raises RuntimeError when a registry's entries differ from what this module declares."""
    if registered != list(declared):
        raise RuntimeError(
            f"the audit registers {what} {registered}, and varlen_workbench.workbench.audit_catalog declares {list(declared)}: "
            f"declare each of the audit's {what} in both, in one order."
        )
