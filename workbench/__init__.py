"""Instruments for silent numerical bugs in packed (varlen / THD) attention.

Importing `workbench` imports `kernels` first, so that without CUDA Triton runs through its
CPU interpreter.
"""
from kernels import check_cu_seqlens, check_varlen_inputs, default_device  # noqa: F401
from workbench.bounds import ErrorCheck, error_check
from workbench.layout import (
    Case,
    Fill,
    PackedBatch,
    Region,
    bshd_to_thd,
    cumulative,
    pack,
    pad_thd,
    real_rows,
    region_labels,
    thd_to_bshd,
    unpad_thd,
)
from workbench.poison import poisoned_memory
from workbench.probe import ProbeRecord, grad_output, probe
from workbench.reference import reference_attention

__all__ = [
    "Case",
    "ErrorCheck",
    "Fill",
    "PackedBatch",
    "ProbeRecord",
    "Region",
    "bshd_to_thd",
    "check_cu_seqlens",
    "check_varlen_inputs",
    "cumulative",
    "default_device",
    "error_check",
    "grad_output",
    "pack",
    "pad_thd",
    "poisoned_memory",
    "probe",
    "real_rows",
    "reference_attention",
    "region_labels",
    "thd_to_bshd",
    "unpad_thd",
]
