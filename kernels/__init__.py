"""Triton kernels: the fixed varlen attention and replicas of upstream buggy mechanisms.

`kernels._compat` is imported first: without CUDA it switches Triton to its CPU interpreter
before any `@triton.jit` below is evaluated.
"""

import functools

from kernels._compat import DEVICE, INTERPRETED, default_device  # first: it picks interpreter or native
from kernels.contract import (
    VarlenShape,
    check_causal,
    check_cu_seqlens,
    check_cu_seqlens_tensors,
    check_scale,
    check_varlen_inputs,
    check_varlen_tensors,
    check_window_size,
)
from kernels.fp8 import Fp8Blockwise, quantize_fp8_blockwise, varlen_attention_fp8
from kernels.varlen import AuxRequest, VarlenMetadata, varlen_attention, varlen_attn

# The guarded FlashAttention-4 path as one callable: `workbench audit kernels:varlen_attention_fa4`.
varlen_attention_fa4 = functools.partial(varlen_attention, backend="fa4")

__all__ = [
    "DEVICE",
    "INTERPRETED",
    "default_device",
    "VarlenShape",
    "check_cu_seqlens",
    "check_cu_seqlens_tensors",
    "check_scale",
    "check_varlen_inputs",
    "check_varlen_tensors",
    "check_causal",
    "check_window_size",
    "VarlenMetadata",
    "varlen_attention",
    "varlen_attention_fa4",
    "varlen_attn",
    "AuxRequest",
    "Fp8Blockwise",
    "quantize_fp8_blockwise",
    "varlen_attention_fp8",
]
