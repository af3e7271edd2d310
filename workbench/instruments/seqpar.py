"""Sequence parallelism over a packed (THD) batch, on a real `torch.distributed` engine.

Megatron-style sequence parallelism keeps each rank's share of the token dimension between
layers and rebuilds the whole sequence only where a layer needs it: a sequence-parallel
column-parallel linear all-gathers its input along tokens, and the block's output is scattered
(split) back along tokens. In a packed batch the tokens dimension is the *padded* layout:
FP8 alignment pads every sequence (or the end of the batch) to a multiple of 16 rows, and
attention, RoPE and every linear after it index rows by `cu_seqlens_padded`. The size of the
gathered tensor must therefore be `cu_seqlens_padded[-1]`. Sizing it from `cu_seqlens[-1]`
(real tokens, which exist for attention masking) asks for the unpadded size: the collective
cannot fill it from the ranks' shards (TE#2892's "allgathered tensor gets UNPADDED size").

    out = sequence_parallel_forward(block, x_local, cu_seqlens, cu_seqlens_padded)  # on each rank
    study = run_sequence_parallel(block, x, cu_seqlens, cu_seqlens_padded)   # 2 processes, gloo on CPU
    study.runs[0].exact          # padded sizing: torch.equal with the single-process layer
    study.runs[1].error          # real sizing: SizingError naming the boundary and the fix

`run_sequence_parallel` spawns `world_size` processes (NCCL, one GPU each, when that many GPUs
exist; gloo on CPU otherwise), every rank runs the layer on the gathered batch with the
replicated weights (no tensor parallelism: the output must match one process bit for bit), and
the parent compares the reassembled shards with the same layer run in one process. This is
our own all-gather, not an engine's: it teaches the sizing rule, it tests no upstream code.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.workbench.instruments.tinylm import Block, attention_metadata, rope_positions

# Which boundary vector the gathered size is read from.
BOUNDARIES = {"padded": "cu_seqlens_padded", "real": "cu_seqlens"}
# (size_from, validate) per run: the fix, the bug caught by our check, the bug as torch sees it.
RUNS = (("padded", True), ("real", True), ("real", False))
TIMEOUT_S = 60.0


class SizingError(ValueError):
    """A sequence-parallel collective sized from the wrong boundary vector."""


def gathered_rows(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, size_from: str = "padded") -> int:
    """Rows of the all-gathered batch, read from the last entry of the chosen boundary vector."""
    if size_from not in BOUNDARIES:
        raise ValueError(f"size_from = {size_from!r} must be one of {tuple(BOUNDARIES)} ('padded' is right).")
    return int((cu_seqlens_padded if size_from == "padded" else cu_seqlens)[-1])


def shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous share of the token (first) dimension."""
    if x.shape[0] % world_size:
        raise ValueError(
            f"x has {x.shape[0]} rows, not a multiple of world_size = {world_size}: pad the packed batch "
            f"(extend cu_seqlens_padded[-1]) to a multiple of the sequence-parallel size."
        )
    return x.chunk(world_size)[rank]


def _all_gather(out: torch.Tensor, local: torch.Tensor, group) -> None:
    # torch 2.13 renames all_gather_into_tensor (deprecated) to all_gather_single; 2.11 has only the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def gather_tokens(
    local: torch.Tensor, rows: int, *, size_from: str = "padded", group=None, validate: bool = True
) -> torch.Tensor:
    """All-gathers token shards into a tensor of `rows` rows (the sequence-parallel all-gather).

    `validate=True` checks the size first and raises `SizingError` naming the boundary it was
    read from and the fix; `validate=False` hands the mis-sized buffer to the collective, to
    show what the backend itself says.
    """
    world = dist.get_world_size(group)
    if validate and rows != world * local.shape[0]:
        raise SizingError(
            f"sequence-parallel all-gather sized from {BOUNDARIES[size_from]}[-1] = {rows} rows, but the "
            f"{world} ranks hold {local.shape[0]} rows each ({world * local.shape[0]} rows of the packed layout). "
            "Size sequence-parallel communication from cu_seqlens_padded[-1] (the memory layout); "
            "cu_seqlens marks real tokens, for attention masking only."
        )
    out = local.new_empty((rows, *local.shape[1:]))
    _all_gather(out, local.contiguous(), group)
    return out


def scatter_tokens(full: torch.Tensor, *, group=None) -> torch.Tensor:
    """This rank's rows of a tensor every rank holds whole (the sequence-parallel scatter: a split)."""
    return shard(full, dist.get_rank(group), dist.get_world_size(group))


def layer_forward(block: Block, x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """One causal transformer layer on a whole packed batch: RoPE positions and attention
    boundaries from the layout (positions from the padded starts, masking from the real ones)."""
    positions = rope_positions(cu_seqlens, cu_seqlens_padded, x.shape[0])
    return block(x, positions, attention_metadata(cu_seqlens.to(x.device), cu_seqlens_padded.to(x.device)))


def sequence_parallel_forward(
    block: Block,
    x_local: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    size_from: str = "padded",
    group=None,
    validate: bool = True,
) -> torch.Tensor:
    """`layer_forward` under sequence parallelism: gather the shards (on `x_local`'s device, the
    communication device), run the layer where `block` lives, scatter. What every rank runs."""
    rows = gathered_rows(cu_seqlens, cu_seqlens_padded, size_from)
    x = gather_tokens(x_local, rows, size_from=size_from, group=group, validate=validate)
    device = next(block.parameters()).device
    return scatter_tokens(layer_forward(block, x.to(device), cu_seqlens, cu_seqlens_padded), group=group)


@dataclass(frozen=True)
class SeqParRun:
    """One sizing choice, run on every rank."""

    size_from: str
    validate: bool
    rows: int  # the size the all-gather was asked for
    out: torch.Tensor | None  # the ranks' output shards, concatenated (None when a rank raised)
    errors: tuple[str | None, ...]  # per rank: "ExceptionType: message", or None
    exact: bool  # out is torch.equal to the single-process layer's output

    @property
    def error(self) -> str | None:
        return next((e for e in self.errors if e), None)


@dataclass(frozen=True)
class SeqParStudy:
    backend: str
    world_size: int
    layout_rows: int  # cu_seqlens_padded[-1]
    real_rows: int  # cu_seqlens[-1]
    reference: torch.Tensor  # the layer in one process
    runs: tuple[SeqParRun, ...]
    seconds: float

    def run(self, size_from: str, validate: bool = True) -> SeqParRun:
        return next(r for r in self.runs if (r.size_from, r.validate) == (size_from, validate))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(world_size: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int, backend: str, timeout_s: float, device: str) -> Iterator[torch.device]:
    """This spawned rank's process group; yields where it computes: its own GPU under NCCL, `device` under gloo."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the parent's single-process run uses one thread too: same kernels, same bits
    where = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device(device)
    if backend == "nccl":
        # NVLink multicast (NVLS) off unless set otherwise: a few ranks gain nothing from it, and on
        # shared multi-GPU hosts a program using it can take every GPU of the host out of service.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(where)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield where
        # Every rank past its last collective before any tears the group down: a gloo rank whose
        # peer has already destroyed it can abort in teardown (SIGABRT, "terminate called without
        # an active exception"), seen once in a loaded CI-like run.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, port: int, workdir: str, backend: str, timeout_s: float) -> None:
    job = torch.load(Path(workdir) / "job.pt", weights_only=False)
    with process_group(rank, world_size, port, backend, timeout_s, job["device"]) as device:
        comm = device if backend == "nccl" else torch.device("cpu")
        block = job["block"].to(device)
        cu, cu_padded = job["cu_seqlens"].to(device), job["cu_seqlens_padded"].to(device)
        x_local = shard(job["x"], rank, world_size).to(comm)
        outcomes = []
        # Runs that raise do so before any byte moves, on every rank alike: the group stays usable.
        for size_from, validate in job["runs"]:
            try:
                with torch.no_grad():
                    out = sequence_parallel_forward(block, x_local, cu, cu_padded, size_from=size_from, validate=validate)
                outcomes.append({"out": out.cpu(), "error": None})
            except (ValueError, RuntimeError) as exc:
                outcomes.append({"out": None, "error": f"{type(exc).__name__}: {exc}"})
        torch.save(outcomes, Path(workdir) / f"rank{rank}.pt")


def _spawn(fn, args: tuple, world_size: int, timeout_s: float) -> None:
    """Runs `fn(rank, *args)` on `world_size` spawned processes; always joins them, kills them on timeout."""
    context = mp.start_processes(fn, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):  # raises ProcessRaisedException / ProcessExitedException
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the {world_size} ranks did not finish within {timeout_s:g} s; raise timeout_s on a slow machine."
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
            process.join()


def run_sequence_parallel(
    block: Block,
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    world_size: int = 2,
    runs=RUNS,
    device=None,
    timeout_s: float = TIMEOUT_S,
) -> SeqParStudy:
    """Runs `block` on the packed batch `x` (rows = the padded layout) sequence-parallel over
    `world_size` processes once per (size_from, validate) in `runs`, and in one process.

    `device` is where the layer computes (default: `varlen_workbench.kernels._compat.default_device()`); ranks talk
    over NCCL with one GPU each when there are `world_size` GPUs, over gloo on CPU otherwise.
    """
    device = torch.device(device) if device is not None else default_device()
    if x.shape[0] != int(cu_seqlens_padded[-1]):
        raise ValueError(
            f"x has {x.shape[0]} rows but cu_seqlens_padded[-1] = {int(cu_seqlens_padded[-1])}: x must hold the "
            "packed batch in its padded layout, one row per position of cu_seqlens_padded."
        )
    backend = _backend(world_size)
    block = copy.deepcopy(block).cpu()  # the caller's module stays where it is
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            reference = layer_forward(
                copy.deepcopy(block).to(device), x.to(device), cu_seqlens.to(device), cu_seqlens_padded.to(device)
            ).cpu()
    finally:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wb-seqpar-") as workdir:
        job = dict(
            block=block,
            x=x.detach().cpu(),
            cu_seqlens=cu_seqlens.cpu(),
            cu_seqlens_padded=cu_seqlens_padded.cpu(),
            runs=tuple(runs),
            device=str(device),
        )
        torch.save(job, Path(workdir) / "job.pt")
        _spawn(_worker, (world_size, _free_port(), workdir, backend, timeout_s), world_size, timeout_s)
        per_rank = [torch.load(Path(workdir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    seconds = time.perf_counter() - start
    results = []
    for i, (size_from, validate) in enumerate(runs):
        outcomes = [rank[i] for rank in per_rank]
        failed = any(o["out"] is None for o in outcomes)
        out = None if failed else torch.cat([o["out"] for o in outcomes])
        results.append(
            SeqParRun(
                size_from,
                validate,
                gathered_rows(cu_seqlens, cu_seqlens_padded, size_from),
                out,
                tuple(o["error"] for o in outcomes),
                out is not None and torch.equal(out, reference),
            )
        )
    return SeqParStudy(backend, world_size, int(cu_seqlens_padded[-1]), int(cu_seqlens[-1]), reference, tuple(results), seconds)
