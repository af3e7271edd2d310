"""The tile tuner of the varlen attention kernels: the launch shapes (`Tile`), each kernel's
candidates, and `TileTuner`, which picks one per shape class (`shape_class`) of a call.

Natively a tuner times each kernel's candidate tiles that do not spill on the first call of a
shape class and keeps the fastest; under the interpreter there is one fixed tile. The
launchers (kernels/varlen/launch.py) hold the process's tuner and ask it for every launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.testing
from triton.runtime.errors import OutOfResources


@dataclass(frozen=True)
class Tile:
    """One kernel's launch shape: BLOCK_M query rows x BLOCK_N key rows per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


# Under the interpreter 64x64 runs a few hundred tokens ~4x faster than 32x32, ~10x than 16x16.
INTERPRETER_TILE = Tile(64, 64, num_warps=4, num_stages=1)

# Native candidates per kernel, by the bytes of one row of lanes (`launch.lanes`: a head dim padded to a
# power of two, the wider of q/k's and v's, x itemsize); the first of each is the pick where
# timing is impossible (CUDA graph capture, sync debug mode). Chosen by compiling for sm_90
# (`python -m varlen_workbench.kernels.varlen.tiles`): all fit Hopper's 227 KB of shared memory and, in bf16 and
# fp16 at head dims 64 and 128, none spills without a window's left bound; with one (sliding),
# at 128, forward 128x128 spills 88 bytes and dK/dV 32x64 w4 16 bytes (the tuner takes no
# spilling candidate where one does not spill, timed or not). A padded head dim compiles like
# its lanes (48 like 64, 80 and 96 like 128: the same shared memory and spills, registers within
# a few); 192 with v of 128 takes the 256 bucket, where dQ's first candidate, 32x16 w4, spills
# 16-32 bytes (at 256 8-40), the next does not. Wider rows get smaller tiles. Forward and
# dQ own BLOCK_M query rows and step over BLOCK_N keys; dK/dV own BLOCK_N keys and step over
# BLOCK_M query rows.
NATIVE_TILES: dict[str, dict[int, tuple[Tile, ...]]] = {
    "forward": {
        128: (Tile(128, 64, 8, 3), Tile(128, 128, 8, 3), Tile(64, 64, 4, 3), Tile(64, 128, 4, 3)),
        256: (Tile(128, 64, 8, 3), Tile(128, 128, 8, 2), Tile(64, 64, 4, 3), Tile(128, 32, 8, 3)),
        512: (Tile(64, 32, 4, 2), Tile(64, 64, 8, 2)),
        1024: (Tile(32, 32, 4, 2),),
    },
    "dkdv": {
        128: (Tile(32, 64, 4, 3), Tile(32, 128, 8, 3), Tile(64, 128, 8, 3), Tile(64, 64, 4, 3)),
        256: (Tile(32, 64, 4, 2), Tile(32, 128, 8, 3), Tile(64, 64, 8, 3), Tile(32, 64, 8, 3)),
        512: (Tile(16, 32, 4, 2), Tile(32, 64, 8, 2)),
        1024: (Tile(16, 32, 4, 1),),
    },
    "dq": {
        128: (Tile(128, 32, 4, 3), Tile(128, 64, 8, 3), Tile(64, 32, 4, 3), Tile(64, 64, 4, 3)),
        256: (Tile(64, 32, 4, 2), Tile(128, 32, 8, 3), Tile(128, 64, 8, 2), Tile(64, 64, 8, 3)),
        512: (Tile(32, 16, 4, 2), Tile(64, 32, 8, 2)),
        1024: (Tile(32, 16, 4, 1),),
    },
}


# Below this many rows x heads a call is launch-bound and every tile ties: timing (and
# compiling every candidate) would buy nothing, so the first candidate that does not spill runs.
MIN_TIMED_WORK = 1 << 16


def _may_synchronize() -> bool:
    """Timing needs host syncs: never while a CUDA graph is captured or torch errors on syncs."""
    return not torch.cuda.is_current_stream_capturing() and torch.cuda.get_sync_debug_mode() == 0


class TileTuner:
    """Per shape class, times every candidate tile that does not spill once on the real call and
    keeps the fastest (calls under MIN_TIMED_WORK take the first candidate that does not spill,
    untimed).

    A shape class is (kernel, dtype, head_dim, causal, GQA group, log2 of the mean rows per
    sequence, log2 of rows x heads, sliding, v's head dim): short documents want smaller query
    blocks, and a small grid wants more, smaller programs. `report()` lists each choice, its timings and, natively,
    the compiled kernel's registers, spills and shared memory.
    """

    def __init__(self) -> None:
        self.chosen: dict[tuple, Tile] = {}
        self.timings: dict[tuple, dict[Tile, float]] = {}
        self.resources: dict[tuple, dict[str, int]] = {}
        self.pins: dict[str, Tile] = {}

    @contextlib.contextmanager
    def pinned(self, **tiles: Tile):
        """Inside the block, `kernel=tile` ('forward', 'dkdv', 'dq') bypasses timing: how the
        tests run every candidate tile, also under the interpreter."""
        unknown = set(tiles) - set(NATIVE_TILES)
        if unknown:
            raise ValueError(f"pinned() got {sorted(unknown)}; the kernels with tiles are {sorted(NATIVE_TILES)}")
        saved, self.pins = self.pins, {**self.pins, **tiles}
        try:
            yield
        finally:
            self.pins = saved

    def launch(self, key: tuple, candidates: tuple[Tile, ...], launch: Callable[[Tile], object], work: int) -> None:
        """Launches the kernel through `launch(tile)`; `work` = rows x heads of the call."""
        if key[0] in self.pins:
            launch(self.pins[key[0]])
            return
        tile = self.chosen.get(key)
        if tile is not None:
            launch(tile)
            return
        if len(candidates) == 1:
            tile = candidates[0]
        elif not _may_synchronize():
            launch(candidates[0])  # not remembered: a later call can still time them
            return
        elif work < MIN_TIMED_WORK:
            spills = self._spills(key, candidates, launch, stop_at_clean=True)
            tile = next((t for t, n in spills.items() if n == 0), next(iter(spills)))
        else:
            tile = self._time(key, candidates, launch)
        self.chosen[key] = tile
        compiled: Any = launch(tile)
        if hasattr(compiled, "n_regs"):  # natively; the interpreter returns no compiled kernel
            self.resources[key] = {"regs": compiled.n_regs, "spills": compiled.n_spills, "shared": compiled.metadata.shared}

    def _spills(
        self, key: tuple, candidates: tuple[Tile, ...], launch: Callable[[Tile], object], stop_at_clean: bool = False
    ) -> dict[Tile, int]:
        """Bytes spilled by each candidate that fits the device, in order, read from the compiled
        kernel (launching compiles it and runs it once, harmlessly: the chosen tile runs after)."""
        spills = {}
        for tile in candidates:
            try:
                compiled = launch(tile)
            except OutOfResources:
                continue  # more shared memory or registers than the device has
            spills[tile] = getattr(compiled, "n_spills", None) or 0  # the interpreter compiles nothing
            if stop_at_clean and spills[tile] == 0:
                break
        if not spills:
            raise RuntimeError(f"no candidate tile of {key[0]} fits this device: {', '.join(map(str, candidates))}")
        return spills

    def _time(self, key: tuple, candidates: tuple[Tile, ...], launch: Callable[[Tile], object]) -> Tile:
        """The fastest candidate that does not spill, where any does not: a spilling tile can
        win a timing by luck under contention and then run slower ever after, so spills are
        read from the compiled kernels before anything is timed. Where every candidate spills
        (GQA dK/dV at head dim 128), all are timed: spilling less is not running faster there
        (on the H200, 32x64 w4 with 78 bytes spilled took 1.72 ms, 32x64 w8 with 56 took 3.42)."""
        spills = self._spills(key, candidates, launch)
        clean = [tile for tile, n in spills.items() if n == 0]
        timings = {
            tile: triton.testing.do_bench(lambda tile=tile: launch(tile), warmup=5, rep=25, return_mode="median")
            for tile in clean or list(spills)
        }
        self.timings[key] = timings
        return min(timings, key=lambda tile: timings[tile])

    def report(self) -> list[dict]:
        return [
            {
                **dict(zip(SHAPE_CLASS_FIELDS, key)),
                "tile": str(tile),
                "timings_ms": {str(t): round(ms, 4) for t, ms in self.timings.get(key, {}).items()},
                **self.resources.get(key, {}),
            }
            for key, tile in self.chosen.items()
        ]


SHAPE_CLASS_FIELDS = ("kernel", "dtype", "head_dim", "causal", "group", "rows_per_seq_log2", "work_log2", "sliding", "head_dim_v")


def shape_class(
    kernel: str,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    total_rows: int,
    n_seqs: int,
    causal: bool,
    group: int,
    sliding: bool = False,
    head_dim_v: int | None = None,
) -> tuple:
    """The tuner's key (SHAPE_CLASS_FIELDS) of a call with `total_rows` rows in `n_seqs` sequences.
    `causal`: the window has a right bound (causal is right = 0); `sliding`: it has a left one;
    `head_dim_v`: v's head dim (None: `head_dim`)."""
    return (
        kernel,
        str(dtype).removeprefix("torch."),
        head_dim,
        causal,
        group,
        (total_rows // max(n_seqs, 1)).bit_length(),
        (total_rows * heads).bit_length(),
        sliding,
        head_dim if head_dim_v is None else head_dim_v,
    )
