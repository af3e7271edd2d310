"""The backends `varlen_attention` can run a call on, in one registry (`registry`), one module
each: `triton` (the fixed Triton kernel), `fa4` (FlashAttention-4 behind our wrapper) and
`torch` (per-document SDPA, "auto"'s pick on the CPU). They are registered here, in "auto"'s
order of asking; a backend of your own is one module and one `register(...)` (tests/test_backends.py
registers a toy one).
"""

from varlen_workbench.kernels.varlen.backends.fa4 import Fa4
from varlen_workbench.kernels.varlen.backends.registry import (
    AUTO,
    Backend,
    Call,
    check_backend,
    choose,
    lookup,
    names,
    register,
    registered,
    table,
    unregister,
)
from varlen_workbench.kernels.varlen.backends.torch import PerDocumentSdpa
from varlen_workbench.kernels.varlen.backends.triton import Triton

register(Triton())
register(Fa4())
register(PerDocumentSdpa())

__all__ = [
    "AUTO",
    "Backend",
    "Call",
    "check_backend",
    "choose",
    "lookup",
    "names",
    "register",
    "registered",
    "table",
    "unregister",
]
