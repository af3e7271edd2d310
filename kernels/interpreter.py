"""Does the installed Triton interpreter compute `tl.dot` on bfloat16 correctly? The detector
our kernels consult.

Under Triton's interpreter numpy holds every tensor, and numpy has no bfloat16: the interpreter
stores bf16 as its raw uint16 bits. Its `create_dot` converts only 8-bit float operands before
`np.matmul`, so a bf16 `tl.dot` multiplies bit patterns as integers (triton-lang/triton#11584;
fix PR #11585 closed as "not supported yet"). The result is finite and wrong by ~1e9.

The workaround is a compile-time flag that upcasts bf16 `tl.dot` operands to fp32. Deciding it
here, from an observation rather than from "are we interpreted?", lets it retire itself the day
the interpreter is fixed, and it never exists in native code. A kernel consumes it as:

    from varlen_workbench.kernels.interpreter import dot_upcast_needed
    DOT_UPCAST=dot_upcast_needed(q.dtype, q.device)   # launch argument, a tl.constexpr
    if DOT_UPCAST: a, b = a.to(tl.float32), b.to(tl.float32)   # in the kernel, before tl.dot

Every answer is per device, as kernels run (kernels/runtime.py): interpreted on CPU tensors,
compiled on CUDA tensors, where `dot_upcast_needed` is False without running anything, so the
branch is compiled out. The study of the bug (its report, the attention a user's reproduction
would write, what compiled Triton does) is the post-mortem's:
`varlen_workbench.postmortems.triton_interpreter_bf16_dot.probes`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import triton.language as tl

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.caches import cached
from varlen_workbench.kernels.runtime import interpreted, jit

BLOCK = 16  # the smallest tl.dot shape every backend accepts

# A dot is "correct" when its error relative to the largest exact entry is below this: far above
# any rounding (fp32 accumulation of 16 products: ~1e-7; fp32 output of an fp64 sum) and far
# below what multiplying raw bit patterns gives (~1e9).
RELATIVE_TOLERANCE = 1e-2

# The dtypes whose tl.dot the study checks (those our attention kernels take).
DOT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@jit
def dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr, UPCAST: tl.constexpr):
    offsets = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    a = tl.load(a_ptr + offsets)
    b = tl.load(b_ptr + offsets)
    if UPCAST:  # the workaround, as our attention kernels apply it (compiled out when False)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # fp32 accumulator as in attention kernels; "ieee": fp32 operands get a true fp32 product
    # natively (not TF32), as in varlen_workbench.kernels.varlen.varlen_attention; no effect on fp16/bf16.
    tl.store(c_ptr + offsets, tl.dot(a, b, input_precision="ieee"))


@dataclass(frozen=True)
class DotCheck:
    """One 16x16 `tl.dot` in `dtype`, compared with the exact (float64) product of its inputs."""

    dtype: str
    interpreted: bool
    upcast: bool  # operands converted to fp32 in the kernel before tl.dot
    error: float  # max |tl.dot - exact product|
    scale: float  # max |exact product|

    @property
    def relative(self) -> float:
        return self.error / self.scale

    @property
    def correct(self) -> bool:
        return self.relative <= RELATIVE_TOLERANCE


def dot_operands(
    dtype: torch.dtype, device: torch.device | str | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two deterministic 16x16 standard-normal matrices in `dtype` (drawn on the CPU, then moved)."""
    generator = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, BLOCK, BLOCK, generator=generator).to(dtype).unbind(0)
    device = default_device() if device is None else torch.device(device)
    return a.to(device).contiguous(), b.to(device).contiguous()


def triton_dot(a: torch.Tensor, b: torch.Tensor, *, upcast: bool = False) -> torch.Tensor:
    """`tl.dot(a, b)` of two 16x16 matrices, accumulated and returned in float32.

    `upcast=True` converts the operands to fp32 inside the kernel first (the workaround).
    """
    for name, x in (("a", a), ("b", b)):
        if x.shape != (BLOCK, BLOCK):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; triton_dot takes {BLOCK}x{BLOCK} matrices.")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must share dtype and device; got {a.dtype}/{a.device} and {b.dtype}/{b.device}.")
    c = torch.empty(BLOCK, BLOCK, dtype=torch.float32, device=a.device)
    dot_kernel[(1,)](a.contiguous(), b.contiguous(), c, N=BLOCK, UPCAST=upcast)
    return c


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_dot(dtype: torch.dtype | str, device: torch.device | str | None = None, *, upcast: bool = False) -> DotCheck:
    """Runs one 16x16 `tl.dot` in `dtype` on `device` (default: `default_device()`), interpreted or
    compiled as kernels run there, and measures its error."""
    if isinstance(dtype, str):
        by_name = {dtype_name(d): d for d in DOT_DTYPES}
        if dtype not in by_name:
            raise ValueError(f"dtype = {dtype!r} must be one of {tuple(by_name)} (or the torch dtype).")
        dtype = by_name[dtype]
    if dtype not in DOT_DTYPES:
        raise ValueError(f"dtype = {dtype} must be one of {DOT_DTYPES}.")
    a, b = dot_operands(dtype, device)
    exact = a.double().cpu() @ b.double().cpu()
    got = triton_dot(a, b, upcast=upcast).double().cpu()
    return DotCheck(
        str(dtype).removeprefix("torch."), interpreted(a), upcast, float((got - exact).abs().max()), float(exact.abs().max())
    )


def bf16_dot_is_broken(device: torch.device | str | None = None) -> bool:
    """True when a bf16 `tl.dot` of a kernel launched on `device` (default: `default_device()`)
    comes out wrong: where kernels are interpreted, and this Triton's interpreter gets it wrong.

    Compiled kernels convert bf16 properly, so nothing is run for them; the interpreter's
    answer is one 16x16 dot, run once per process (`interpreter_bf16_dot_is_broken`).
    """
    return interpreted(default_device() if device is None else device) and interpreter_bf16_dot_is_broken()


@cached
def interpreter_bf16_dot_is_broken() -> bool:
    """Whether this Triton's interpreter gets a bf16 `tl.dot` wrong: one 16x16 dot on CPU tensors."""
    return not check_dot(torch.bfloat16, device="cpu").correct


def dot_upcast_needed(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a kernel launched on `device` must upcast `dtype` operands of `tl.dot` to fp32 to
    get a right answer."""
    return dtype == torch.bfloat16 and bf16_dot_is_broken(device)


def run_compiling_child(module: str, args: list[str], *, timeout: float = 300.0):
    """Runs `python -m module *args` in a child process that compiles (no TRITON_INTERPRET), on
    the CPU, and parses its JSON: how a process whose Triton library is interpreted compiles."""
    # The child is this interpreter: it imports varlen_workbench as this process does (installed).
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env |= {"WORKBENCH_DEVICE": "cpu"}
    child = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if child.returncode != 0:
        raise RuntimeError(f"`python -m {module}` failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
    return json.loads(child.stdout)
