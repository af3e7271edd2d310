"""Triton kernels: the fixed varlen attention and replicas of upstream buggy mechanisms.

Each launch runs compiled on CUDA tensors and through Triton's CPU interpreter on CPU tensors
(`interpreted`; `use_interpreter()` forces the interpreter): importing `kernels` sets nothing
and patches nothing, in any import order (kernels/runtime.py).
"""

import functools

from kernels._compat import DEVICE, default_device
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
from kernels.runtime import interpreted, use_interpreter
from kernels.varlen import AuxRequest, VarlenMetadata, varlen_attention, varlen_attn

# The guarded FlashAttention-4 path as one callable: `workbench audit kernels:varlen_attention_fa4`.
varlen_attention_fa4 = functools.partial(varlen_attention, backend="fa4")

__all__ = [
    "DEVICE",
    "default_device",
    "interpreted",
    "use_interpreter",
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
