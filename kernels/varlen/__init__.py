"""The fixed varlen attention: Triton kernels (`forward_kernels`, `backward_kernels` and what they
share, `kernel_common`), their launchers (`launch`) and tile tuner (`tuner`), `varlen_attention`
(`op`), the per-step metadata every call of a step shares (`metadata`: `VarlenMetadata`), the
device check of its boundary values (`device_check`), and the registry of backends that compute
a call (`backends`: the Triton kernel, FlashAttention-4 behind the contract-keeping wrapper of
`fa4`, per-document SDPA); `varlen_attn` is torch's `varlen_attn` signature on the same call.

`from varlen_workbench.kernels.varlen import varlen_attention` is the kernel's public import.
Importing it sets nothing and patches nothing, in any import order: each launch runs compiled on
CUDA tensors and through Triton's CPU interpreter on CPU tensors (`varlen_workbench.kernels.runtime`).
`varlen_attention_<backend>` is `varlen_attention` pinned to a registered backend, e.g.
`varlen-workbench audit varlen_workbench.kernels.varlen:varlen_attention_triton`.
"""

from collections.abc import Callable

from varlen_workbench.kernels.varlen.backends import names
from varlen_workbench.kernels.varlen.metadata import VarlenMetadata
from varlen_workbench.kernels.varlen.op import DTYPES, HEAD_DIMS, AuxRequest, pinned, varlen_attention, varlen_attn

# The fixed Triton kernel whatever the device (what the post-mortems and the interpreter tests mean by "our
# kernel"; on CPU tensors it runs through Triton's interpreter), and the guarded FlashAttention-4 path, each
# as one callable: `varlen-workbench audit varlen_workbench.kernels.varlen:varlen_attention_fa4`.
varlen_attention_triton = pinned("triton")
varlen_attention_fa4 = pinned("fa4")

PINNED = "varlen_attention_"


def __getattr__(name: str) -> Callable:
    """`varlen_attention_<backend>` for every registered backend, the ones registered later included."""
    backend = name.removeprefix(PINNED)
    if name.startswith(PINNED) and backend in names()[1:]:
        return pinned(backend)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DTYPES",
    "HEAD_DIMS",
    "AuxRequest",
    "VarlenMetadata",
    "varlen_attention",
    "varlen_attention_fa4",
    "varlen_attention_triton",
    "varlen_attn",
]
