"""Instruments for silent numerical bugs in packed (varlen / THD) attention.

Importing `workbench` imports `kernels` first, so that without CUDA Triton runs through its
CPU interpreter.
"""

from kernels import check_cu_seqlens, check_varlen_inputs, default_device
from workbench.bounds import ErrorCheck, error_check
from workbench.explorer import Explorer, explore
from workbench.health import GradientHealth, State, Thresholds, token_norms
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
from workbench.nantrace import NaNTrace, trace_nans
from workbench.plots import attention_mask, plot_errors, plot_health, plot_layout, plot_nan_map, plot_token_norms
from workbench.poison import poisoned_memory
from workbench.probe import ProbeRecord, grad_output, probe
from workbench.reference import reference_attention
from workbench.sweep import SweepResult, sweep

__all__ = [
    "Explorer",
    "explore",
    "GradientHealth",
    "State",
    "Thresholds",
    "token_norms",
    "NaNTrace",
    "trace_nans",
    "attention_mask",
    "plot_errors",
    "plot_health",
    "plot_layout",
    "plot_nan_map",
    "plot_token_norms",
    "SweepResult",
    "sweep",
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
