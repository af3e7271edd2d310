"""Loading flash-dmattn 1.2.2 as installed (its Triton kernel file, unmodified) and its successor package."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import decorating_for_interpreter, interpreted
from varlen_workbench.workbench.upstream import import_module, installed_file, run_file

UPSTREAM_PACKAGE = "flash-dmattn"

UPSTREAM_VERSION = "1.2.2"  # the last release of flash-dmattn (its successor is flash-sparse-attn)

UPSTREAM_MODULE = "flash_dmattn.flash_dmattn_triton"

SUCCESSOR_PACKAGE = "flash-sparse-attn"

SUCCESSOR_VERSION = "2.0.6"  # the latest on the registry when this page was revised

# On CPU the interpreter's bf16 tl.dot multiplies raw bit patterns (see triton-interpreter-bf16-dot);
# upstream's kernels call tl.dot on bf16 operands like any other, so on CPU we run them in fp16,
# which 1.2.2 also accepts ("Only support fp16 and bf16"). Natively the GPU run uses bf16.
UPSTREAM_DTYPES = {"cpu": "float16", "cuda": "bfloat16"}


def upstream_dtype(device=None) -> str:
    """The dtype the upstream kernel is studied in on `device`: fp16 under the interpreter, bf16 natively."""
    device = default_device() if device is None else torch.device(device)
    return UPSTREAM_DTYPES["cpu" if interpreted(device) else device.type]


def upstream_version() -> str | None:
    """The installed flash-dmattn's version, or None (install the `upstream` extra: scripts/setup.sh does)."""
    try:
        return importlib.metadata.version(UPSTREAM_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def upstream_module(device=None):
    """flash-dmattn's own `flash_dmattn_triton` module, unmodified, as it runs on `device`
    (default: `default_device()`).

    Natively it is imported as is. For the Triton interpreter (CPU tensors) the same source file
    is compiled with Python's assertions stripped (`optimize=1`, what `python -O` does), because
    1.2.2 asserts `q.is_cuda` before every launch and the interpreter runs on CPU tensors; every
    kernel and every line of its launchers is upstream's. Its kernels are decorated for the
    interpreter (`decorating_for_interpreter`), whatever this process imported first.
    """
    return _upstream_module(interpreted(default_device() if device is None else device))


@functools.lru_cache(maxsize=2)
def _upstream_module(for_interpreter: bool):
    version = upstream_version()
    if version is None:
        raise ModuleNotFoundError(
            f"{UPSTREAM_PACKAGE} is not installed: run scripts/setup.sh, or "
            f"FLASH_DMATTN_SKIP_CUDA_BUILD=TRUE FLASH_DMATTN_FORCE_BUILD=TRUE pip install --no-deps --no-build-isolation "
            f"{UPSTREAM_PACKAGE}=={UPSTREAM_VERSION}"
        )
    if not for_interpreter:
        return importlib.import_module(UPSTREAM_MODULE)
    with decorating_for_interpreter():
        return run_file(
            installed_file(UPSTREAM_PACKAGE, UPSTREAM_MODULE.replace(".", "/") + ".py"),
            f"{UPSTREAM_MODULE}_interpreted",
            optimize=1,
        )


def upstream_triton_func(device=None):
    """1.2.2's `triton_dmattn_func(query, key, value, attn_mask=None, attn_bias=None, is_causal=False, softmax_scale=None)`,
    as it runs on `device` (`upstream_module`)."""
    return upstream_module(device).triton_dmattn_func


def import_successor():
    """flash-sparse-attn as installed. 2.0.6 imports `triton_kernels` (Triton's own kernel library,
    not on the registry and not a declared dependency) for its projection kernels only: where it is
    missing a stub stands in (`varlen_workbench.workbench.upstream`), so that the dense attention path imports; a
    stubbed name raises if ever used."""
    return import_module("flash_sparse_attn", stub={"triton_kernels": SUCCESSOR_PACKAGE})
