"""The fixed varlen attention: Triton kernels (`attention_kernels`), their launchers (`launch`),
the `torch.library` custom op with autograd behind `varlen_attention` (`op`), the per-step
metadata every call of a step shares (`metadata`: `VarlenMetadata`), the device check of its
boundary values (`device_check`), the choice of backend (`backends`) and the contract-keeping
path to FlashAttention-4 (`fa4`); `varlen_attn` is torch's `varlen_attn` signature on the same
kernel.

`from varlen_workbench.kernels.varlen import varlen_attention` is the kernel's public import.
Importing it sets nothing and patches nothing, in any import order: each launch runs compiled on
CUDA tensors and through Triton's CPU interpreter on CPU tensors (`varlen_workbench.kernels.runtime`).
"""

import functools

from varlen_workbench.kernels.varlen.metadata import VarlenMetadata
from varlen_workbench.kernels.varlen.op import DTYPES, HEAD_DIMS, AuxRequest, varlen_attention, varlen_attn

# The guarded FlashAttention-4 path as one callable: `varlen-workbench audit varlen_workbench.kernels.varlen:varlen_attention_fa4`.
varlen_attention_fa4 = functools.partial(varlen_attention, backend="fa4")

__all__ = ["DTYPES", "HEAD_DIMS", "AuxRequest", "VarlenMetadata", "varlen_attention", "varlen_attention_fa4", "varlen_attn"]
