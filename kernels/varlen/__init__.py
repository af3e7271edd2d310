"""The fixed varlen attention: Triton kernels (`attention_kernels`), their launchers (`launch`),
the `torch.library` custom op with autograd behind `varlen_attention` (`op`), the per-step
metadata every call of a step shares (`metadata`: `VarlenMetadata`), the device check of its
boundary values (`device_check`), the choice of backend (`backends`) and the contract-keeping
path to FlashAttention-4 (`fa4`); `varlen_attn` is torch's `varlen_attn` signature on the same
kernel."""

from kernels.varlen.metadata import VarlenMetadata
from kernels.varlen.op import DTYPES, HEAD_DIMS, AuxRequest, varlen_attention, varlen_attn

__all__ = ["DTYPES", "HEAD_DIMS", "AuxRequest", "VarlenMetadata", "varlen_attention", "varlen_attn"]
