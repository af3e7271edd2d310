"""Instruments for silent numerical bugs in packed (varlen / THD) attention.

The names below are imported on first use (PEP 562), so that `import workbench` and the
command line's quick commands (`workbench --help`, `list`) do not pay for torch, Triton and
matplotlib. In any import order the kernels run compiled on CUDA tensors and through
Triton's CPU interpreter on CPU tensors (kernels/runtime.py).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("varlen-postmortem-workbench")
except PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
    __version__ = "0+unknown"

# public name -> the module that defines it
_EXPORTS = {
    "check_cu_seqlens": "kernels",
    "check_varlen_inputs": "kernels",
    "default_device": "kernels",
    "ErrorCheck": "workbench.bounds",
    "error_check": "workbench.bounds",
    "Explorer": "workbench.explorer",
    "explore": "workbench.explorer",
    "GradientHealth": "workbench.health",
    "State": "workbench.health",
    "Thresholds": "workbench.health",
    "token_norms": "workbench.health",
    "Case": "workbench.layout",
    "Fill": "workbench.layout",
    "PackedBatch": "workbench.layout",
    "Region": "workbench.layout",
    "bshd_to_thd": "workbench.layout",
    "cumulative": "workbench.layout",
    "pack": "workbench.layout",
    "pad_thd": "workbench.layout",
    "real_rows": "workbench.layout",
    "region_labels": "workbench.layout",
    "thd_to_bshd": "workbench.layout",
    "unpad_thd": "workbench.layout",
    "NaNTrace": "workbench.nantrace",
    "trace_nans": "workbench.nantrace",
    "attention_mask": "workbench.plots",
    "plot_errors": "workbench.plots",
    "plot_health": "workbench.plots",
    "plot_layout": "workbench.plots",
    "plot_nan_map": "workbench.plots",
    "plot_token_norms": "workbench.plots",
    "poisoned_memory": "workbench.poison",
    "ProbeRecord": "workbench.probes",
    "grad_output": "workbench.probes",
    "probe": "workbench.probes",
    "reference_attention": "workbench.reference",
    "SweepResult": "workbench.sweeps",
    "sweep": "workbench.sweeps",
}

__all__ = [
    "__version__",
    "check_cu_seqlens",
    "check_varlen_inputs",
    "default_device",
    "ErrorCheck",
    "error_check",
    "Explorer",
    "explore",
    "GradientHealth",
    "State",
    "Thresholds",
    "token_norms",
    "Case",
    "Fill",
    "PackedBatch",
    "Region",
    "bshd_to_thd",
    "cumulative",
    "pack",
    "pad_thd",
    "real_rows",
    "region_labels",
    "thd_to_bshd",
    "unpad_thd",
    "NaNTrace",
    "trace_nans",
    "attention_mask",
    "plot_errors",
    "plot_health",
    "plot_layout",
    "plot_nan_map",
    "plot_token_norms",
    "poisoned_memory",
    "ProbeRecord",
    "grad_output",
    "probe",
    "reference_attention",
    "SweepResult",
    "sweep",
]


def __getattr__(name: str) -> Any:
    """Imports the module that defines `name` the first time it is asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
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
    from workbench.probes import ProbeRecord, grad_output, probe
    from workbench.reference import reference_attention
    from workbench.sweeps import SweepResult, sweep
