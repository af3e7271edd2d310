"""The workbench's default device, and the device questions `kernels` and `workbench` share.

`WORKBENCH_DEVICE=cpu|cuda` sets the default device (CUDA when available, else the CPU) where
packed batches are made and post-mortems run, read each time `default_device()` is asked (not
at import): a change takes effect without a re-import. It does not choose how a kernel runs:
that is decided per launch by the tensors' device (kernels/runtime.py).
"""

from __future__ import annotations

import os

import torch

from varlen_workbench.kernels.caches import cached

_CHOICES = ("cpu", "cuda")


def default_device() -> torch.device:
    """The device packed batches and kernels use unless told otherwise: WORKBENCH_DEVICE as it is
    now, else CUDA when available, else the CPU."""
    return torch.device(_requested_device())


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


@cached
def device_capability(device: torch.device) -> tuple[int, int]:
    """`torch.cuda.get_device_capability(device)`, asked once per device: it costs a few
    microseconds of host time, which a call on short documents cannot hide."""
    return torch.cuda.get_device_capability(device)


def check_kernel_device(name: str, tensor: torch.Tensor) -> None:
    """The Triton kernels take CUDA tensors (compiled) and CPU tensors (through Triton's
    interpreter): say so for any other device instead of crashing inside the launcher."""
    if not (tensor.is_cuda or tensor.is_cpu):
        raise ValueError(
            f"{name} is on {tensor.device}, but the Triton kernels run on CUDA tensors (compiled) or on CPU "
            "tensors (through Triton's interpreter); move the tensors with .to('cuda') or .to('cpu')."
        )
