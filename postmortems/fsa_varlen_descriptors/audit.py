"""The first call each audit check made of flash-sparse-attn on the H200, recovered on the CPU.

The H200 matrix ran each check of the `fsa-varlen` rows in a fresh process (a fault loses the CUDA
context), so each cell records the error of that check's first call. `first_call` builds the check's
context as `varlen-workbench audit --device cuda` does (its native layouts, float16, head dim 64) and stops
at its first probe, returning the layout and keywords of that call without running the library.
"""

from __future__ import annotations

from typing import Any

from varlen_workbench.workbench.audit import adapt
from varlen_workbench.workbench.audit.adapters import fsa as fsa_adapters
from varlen_workbench.workbench.audit.checks import CHECKS, Context

ADAPTER_FUNCTIONS = {"flash_dense_attn_varlen_func": "fsa_dense_varlen", "flash_sparse_attn_varlen_func": "fsa_sparse_varlen"}


class _FirstCall(Exception):
    """Raised by `first_call`'s context at the check's first probe: its case and keywords."""


def first_call(check: str, function: str) -> tuple[Context, Any, dict[str, Any]]:
    """(the check's context, the case, the probe's keywords) of the first call audit check `check`
    makes of `function` through the `fsa-varlen` adapter in the H200 matrix."""

    class AsOnTheGpu(Context):
        native = True  # the check's layouts on CUDA, not its interpreter-sized ones

        def probe(self, case, **kwargs):
            raise _FirstCall(case, kwargs)

    if check not in CHECKS:
        raise ValueError(f"--checks: there is no audit check {check!r}; choose from {sorted(CHECKS)}")
    if function not in ADAPTER_FUNCTIONS:
        raise ValueError(f"function={function!r}: choose one of {sorted(ADAPTER_FUNCTIONS)}")
    ctx = AsOnTheGpu(adapt(getattr(fsa_adapters, ADAPTER_FUNCTIONS[function]), device="cpu"), "float16", head_dim=64)
    try:
        CHECKS[check].run(ctx)
    except _FirstCall as call:
        return ctx, *call.args
    raise ValueError(f"audit check {check!r} makes no call of {function}")
