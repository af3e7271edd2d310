"""Where the kernels run: natively on CUDA, or through Triton's CPU interpreter.

This is the one helper `kernels` shares with `workbench`. It must be imported before any
`@triton.jit` is evaluated, because Triton decides at decoration time whether a function is
compiled or interpreted.

`WORKBENCH_DEVICE=cpu|cuda` overrides the automatic choice (CUDA when available).
"""

from __future__ import annotations

import functools
import os

import torch

_CHOICES = ("cpu", "cuda")


def _requested_device() -> str:
    requested = os.environ.get("WORKBENCH_DEVICE", "").strip().lower()
    if requested and requested not in _CHOICES:
        raise ValueError(
            f"WORKBENCH_DEVICE={os.environ['WORKBENCH_DEVICE']!r} is not one of {_CHOICES}; "
            "unset it to pick CUDA when available, or set it to 'cpu' or 'cuda'."
        )
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "WORKBENCH_DEVICE=cuda but torch sees no CUDA device "
            f"(torch {torch.__version__}); unset it or set WORKBENCH_DEVICE=cpu."
        )
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


DEVICE: str = _requested_device()

if DEVICE == "cpu":
    # No GPU: every @triton.jit below becomes an interpreted function running on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _backport_interpreter_index_fix() -> None:
    """Lets interpreted kernels use runtime loop bounds (`range(lo, hi)`) under numpy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with `int(array)`,
    which numpy 2.4 rejects ("only 0-dimensional arrays can be converted"), so every loop
    with a tensor bound fails (triton-lang/triton#9171; fixed upstream after triton 3.6 by
    squeezing first). `while` loops would dodge it but forfeit native software pipelining.
    """
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int32))
        return  # this numpy still converts 1-element arrays: nothing to fix
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_squeezing_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_tensor_squeezing_index


if INTERPRETED:
    _backport_interpreter_index_fix()


def default_device() -> torch.device:
    """The device packed batches and kernels use unless told otherwise."""
    return torch.device(DEVICE)


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int]:
    """`torch.cuda.get_device_capability(device)`, asked once per device: it costs a few
    microseconds of host time, which a call on short documents cannot hide."""
    return torch.cuda.get_device_capability(device)


def check_kernel_device(name: str, tensor: torch.Tensor) -> None:
    """Natively, Triton reads only CUDA memory: say so instead of crashing inside the launcher."""
    if not INTERPRETED and tensor.device.type != "cuda":
        raise ValueError(
            f"{name} is on {tensor.device}, but the Triton kernels run natively on CUDA here; "
            f"move the tensors with .to('cuda'), or set WORKBENCH_DEVICE=cpu to use the CPU interpreter."
        )
