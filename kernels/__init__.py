"""Triton kernels: the fixed varlen attention and replicas of upstream buggy mechanisms.

`kernels._compat` is imported first: without CUDA it switches Triton to its CPU interpreter
before any `@triton.jit` below is evaluated.
"""
from kernels._compat import DEVICE, INTERPRETED, default_device  # noqa: F401  (must come first)
from kernels.contract import (  # noqa: F401
    VarlenShape,
    check_cu_seqlens,
    check_cu_seqlens_tensors,
    check_scale,
    check_varlen_inputs,
    check_varlen_tensors,
)
from kernels.varlen import varlen_attention  # noqa: F401
from kernels.fp8 import Fp8Blockwise, quantize_fp8_blockwise, varlen_attention_fp8  # noqa: F401

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
    "varlen_attention",
    "Fp8Blockwise",
    "quantize_fp8_blockwise",
    "varlen_attention_fp8",
]
