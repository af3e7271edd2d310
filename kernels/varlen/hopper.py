"""The forward kernel's Hopper machinery: its switches (`ForwardConfig`, off by default), how a
forward pass selects them, and what the launcher needs for each (descriptor scratch and
alignment, which tiles warp specialization refuses, the persistent grid and its order)."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from varlen_workbench.kernels.runtime import interpreted

if TYPE_CHECKING:
    from varlen_workbench.kernels.varlen.tuner import Tile


@dataclass(frozen=True)
class ForwardConfig:
    """Hopper machinery of the forward kernel, each a constexpr switch, all off by default.

    - `descriptors`: q, k, v, out through device-side tensor descriptors (TMA on sm_90+), one per
      program over its own sequence's rows, so rows past the sequence's end read as zero and
      are never written. Needs 16-byte aligned rows (`check_descriptor_alignment`).
    - `warp_specialize`: `tl.range(..., warp_specialize=True)` on the key loops. Triton 3.6
      compiles it for sm_90 (its Hopper pipeline runs `add_hopper_warpspec`,
      triton/backends/nvidia/compiler.py:274), but compiled for sm_90 on the CPU
      (`varlen_workbench.kernels.varlen.tiles.compile_tile`, 128x64 w8 s3, d128 bf16) the loop gets no partitions:
      no `ttg.warp_specialize` op, no `setmaxnreg`, the registers and shared memory of the
      default, with or without descriptors; at 4 warps the pass fails (`warp_specialize_fails`),
      so those tiles are dropped or refused. The interpreter ignores it.
    - `persistent`: about one program per SM, walking (query block, head) tiles longest first
      (at 128x64 w8 s3 d128 bf16 it spills 8 bytes on sm_90: the tuner's clean-tile rule applies).
    """

    descriptors: bool = False
    warp_specialize: bool = False
    persistent: bool = False

    def __str__(self) -> str:
        on = [name for name in ("descriptors", "warp_specialize", "persistent") if getattr(self, name)]
        return "+".join(on) or "default"


DEFAULT_FORWARD = ForwardConfig()
# Set only by `forward_config()`, for its block: a context variable, so a block in one thread (or
# asyncio task) leaves every other one on its own config, and leaving the block restores the last.
_ACTIVE: contextvars.ContextVar[ForwardConfig] = contextvars.ContextVar("forward_config", default=DEFAULT_FORWARD)


@contextlib.contextmanager
def forward_config(config: ForwardConfig):
    """Inside the block, forward passes run with `config` (how benchmarks and tests select a
    variant), in this thread (or task) only."""
    if not isinstance(config, ForwardConfig):
        raise TypeError(f"forward_config() takes a ForwardConfig, got {type(config).__name__}")
    token = _ACTIVE.set(config)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_forward_config() -> ForwardConfig:
    """The config forward passes run with now (`forward_config`)."""
    return _ACTIVE.get()


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator(device: torch.device) -> None:
    """Device-side descriptors live in global scratch that Triton asks an allocator for. Triton
    keeps it in a ContextVar (triton/runtime/_allocation.py), so one set in the main thread is
    unset in another: set ours wherever none is, and never replace a caller's. The interpreter
    (kernels launched on `device` interpreted) needs none."""
    from triton.runtime import _allocation

    if not interpreted(device) and isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_descriptor_scratch)


def check_descriptor_alignment(*named: tuple[str, torch.Tensor]) -> None:
    """TMA needs a 16-byte aligned base and row stride and a contiguous last dim of >= 16 bytes."""
    for name, x in named:
        row_bytes = x.stride(0) * x.element_size()
        if x.data_ptr() % 16 or row_bytes % 16 or x.stride(1) * x.element_size() % 16 or x.shape[-1] * x.element_size() < 16:
            raise ValueError(
                f"ForwardConfig(descriptors=True) needs {name} with 16-byte aligned storage, row and head strides and "
                f"rows of >= 16 bytes (got data_ptr % 16 = {x.data_ptr() % 16}, strides {tuple(x.stride())}, "
                f"{x.element_size()}-byte elements): pass a contiguous tensor or leave descriptors off"
            )


def warp_specialize_fails(config: ForwardConfig, tile: Tile, capability: tuple[int, int] | None) -> bool:
    """Triton 3.6's Hopper warp-specialization pass (`NVGPUWarpSpecialization`) fails on this
    kernel's key loop at 4 warps: compiled for sm_90 on the CPU, 64x64 and 128x64 tiles, causal
    or not, 2 or 3 stages, all end in `PassManager::run failed`; at 8 warps it compiles and
    leaves the loop unpartitioned. `capability` None: the interpreter, which ignores the flag."""
    return config.warp_specialize and capability is not None and capability[0] == 9 and tile.num_warps < 8


def persistent_programs(device: torch.device, n_items: int) -> int:
    """About one program per SM (4 under the interpreter: enough to exercise the tile walk)."""
    sms = 4 if interpreted(device) else torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(sms, n_items))


def longest_first(
    starts: torch.Tensor, n_seqs: int, grid: int, cu_q: torch.Tensor, cu_k: torch.Tensor, block_m: int, causal: bool
) -> torch.Tensor:
    """Work items 0 .. grid-1 (query blocks, as `_work_item` maps them) ordered by the keys
    each visits, most first; surplus items last. Torch ops on the device, no host sync. The
    cost ignores a window's left bound: an order, not a promise."""
    items = torch.arange(grid, device=starts.device, dtype=torch.int32)
    seq = torch.searchsorted(starts[: n_seqs + 1].contiguous(), items, right=True) - 1
    real = seq < n_seqs
    seq = seq.clamp(max=max(n_seqs - 1, 0))
    len_q = (cu_q[1:] - cu_q[:-1])[seq]
    len_k = (cu_k[1:] - cu_k[:-1])[seq]
    cost = len_k.to(torch.int64)
    if causal:
        last_row = (items - starts[seq] + 1) * block_m  # past the block's last row
        cost = torch.minimum(cost, (last_row + len_k - len_q).clamp(min=0))
    cost = torch.where(real, cost, -1)
    return torch.argsort(cost, descending=True, stable=True).to(torch.int32)
