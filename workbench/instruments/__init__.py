"""Instruments for silent numerical bugs in packed (varlen / THD) attention, under one name:

    from varlen_workbench.workbench import instruments as wb

    wb.probe(...), wb.poisoned_memory(), wb.plot_layout(...)

Each name is defined in its own module (the values of `_EXPORTS`) and imported from there on
first use (PEP 562), so that importing this module costs nothing until a name is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "check_cu_seqlens": "varlen_workbench.kernels.contract",
    "check_varlen_inputs": "varlen_workbench.kernels.contract",
    "default_device": "varlen_workbench.kernels._compat",
    "ErrorCheck": "varlen_workbench.workbench.bounds",
    "error_check": "varlen_workbench.workbench.bounds",
    "Explorer": "varlen_workbench.workbench.instruments.explorer",
    "explore": "varlen_workbench.workbench.instruments.explorer",
    "GradientHealth": "varlen_workbench.workbench.instruments.health",
    "State": "varlen_workbench.workbench.instruments.health",
    "Thresholds": "varlen_workbench.workbench.instruments.health",
    "token_norms": "varlen_workbench.workbench.instruments.health",
    "Case": "varlen_workbench.workbench.layout",
    "Fill": "varlen_workbench.workbench.layout",
    "PackedBatch": "varlen_workbench.workbench.layout",
    "Region": "varlen_workbench.workbench.layout",
    "bshd_to_thd": "varlen_workbench.workbench.layout",
    "cumulative": "varlen_workbench.workbench.layout",
    "pack": "varlen_workbench.workbench.layout",
    "pad_thd": "varlen_workbench.workbench.layout",
    "real_rows": "varlen_workbench.workbench.layout",
    "region_labels": "varlen_workbench.workbench.layout",
    "thd_to_bshd": "varlen_workbench.workbench.layout",
    "unpad_thd": "varlen_workbench.workbench.layout",
    "NaNTrace": "varlen_workbench.workbench.instruments.nantrace",
    "trace_nans": "varlen_workbench.workbench.instruments.nantrace",
    "attention_mask": "varlen_workbench.workbench.plots",
    "plot_errors": "varlen_workbench.workbench.plots",
    "plot_health": "varlen_workbench.workbench.plots",
    "plot_layout": "varlen_workbench.workbench.plots",
    "plot_nan_map": "varlen_workbench.workbench.plots",
    "plot_token_norms": "varlen_workbench.workbench.plots",
    "poisoned_memory": "varlen_workbench.workbench.instruments.poison",
    "ProbeRecord": "varlen_workbench.workbench.probes",
    "grad_output": "varlen_workbench.workbench.probes",
    "probe": "varlen_workbench.workbench.probes",
    "reference_attention": "varlen_workbench.workbench.reference",
    "SweepResult": "varlen_workbench.workbench.sweeps",
    "sweep": "varlen_workbench.workbench.sweeps",
}

__all__ = [
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
        raise AttributeError(f"module 'varlen_workbench.workbench.instruments' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
    from varlen_workbench.kernels._compat import default_device
    from varlen_workbench.kernels.contract import check_cu_seqlens, check_varlen_inputs
    from varlen_workbench.workbench.bounds import ErrorCheck, error_check
    from varlen_workbench.workbench.instruments.explorer import Explorer, explore
    from varlen_workbench.workbench.instruments.health import GradientHealth, State, Thresholds, token_norms
    from varlen_workbench.workbench.instruments.nantrace import NaNTrace, trace_nans
    from varlen_workbench.workbench.instruments.poison import poisoned_memory
    from varlen_workbench.workbench.layout import (
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
    from varlen_workbench.workbench.plots import (
        attention_mask,
        plot_errors,
        plot_health,
        plot_layout,
        plot_nan_map,
        plot_token_norms,
    )
    from varlen_workbench.workbench.probes import ProbeRecord, grad_output, probe
    from varlen_workbench.workbench.reference import reference_attention
    from varlen_workbench.workbench.sweeps import SweepResult, sweep
