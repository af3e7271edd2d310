"""Context-parallel attentions: `varlen_workbench.workbench.instruments.context_parallel.context_parallel_attention`'s call.

    impl(q_local, k_local, v_local, cu_seqlens, cu_seqlens_padded, *, causal=False, validate=True)

on every rank of a process group, with that rank's zig-zag shard of q, k, v (`shard_thd`) and the
global boundaries. Such a function does not compute in one process, so every single-process check
and the fuzzer are n/a for it ("one-process"); the `context-parallel` check spawns the ranks
itself (`varlen_workbench.workbench.audit.context_parallel`), fuzzed layouts included.

    varlen-workbench audit varlen_workbench.workbench.instruments.context_parallel:context_parallel_attention
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from varlen_workbench.workbench.audit.adapters.base import AdapterRefused, _target_of, register_adapter
from varlen_workbench.workbench.instruments.context_parallel import cp_backend

CP_SIZE = 2  # the ranks the audit's context-parallel check runs
ONE_PROCESS = "a context-parallel attention: it runs on the ranks of a process group, which the context-parallel check spawns"


def _cp_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    lacks = {"one-process": ONE_PROCESS}
    if _target_of(fn) is None:
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        lacks["run"] = (
            f"{name} is not importable as 'module:function', and the context-parallel check's ranks are spawned "
            "processes that import it: define it at the top level of an importable module"
        )
    try:
        cp_backend(CP_SIZE)  # NCCL needs a GPU per rank; a CPU-only machine runs gloo
    except ValueError as exc:
        lacks.setdefault("run", str(exc))
    return lacks


@register_adapter(
    "context-parallel",
    lacks=_cp_lacks,
    detect=lambda fn, names: {"cu_seqlens", "cu_seqlens_padded", "group"} <= names,
    calls=(5, ("causal", "validate")),
)
def _context_parallel(fn: Callable) -> Callable:
    """The function itself, called by the context-parallel check on each spawned rank with its
    zig-zag shards and the global cu_seqlens / cu_seqlens_padded; never in one process."""

    def call(*args, **kwargs):
        raise AdapterRefused(ONE_PROCESS)

    return call
