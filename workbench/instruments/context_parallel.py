"""Context-parallel varlen attention over a packed (THD) batch, on `torch.distributed`.

Under context parallelism (CP) every rank holds a shard of *every* sequence of the packed batch,
split for load balance ("zig-zag"): each sequence's padded rows are cut into 2 x cp_size equal
chunks and rank r holds chunks r and 2 x cp_size - 1 - r, back to back, so under a causal mask
every rank gets the same work. Equal chunks need every padded length to be a multiple of
2 x cp_size (the requirement te-thd-2892's report states for TransformerEngine's THD CP path);
`check_cp_layout` checks it. TAIL rows (past `cu_seqlens_padded[-1]`) stay with the last rank,
after its chunks; they are never sent.

    q_local, k_local, v_local = (shard_thd(x, cu_seqlens, cu_seqlens_padded, rank, cp_size) for x in (q, k, v))
    out_local = context_parallel_attention(q_local, k_local, v_local, cu_seqlens, cu_seqlens_padded, causal=True)

Communication: one all-gather of this rank's K and V chunks (stacked, TAIL rows excluded) per
forward; its backward is one all-reduce of the gathered K/V gradient, of which each rank keeps
its own slice (a reduce-scatter written as an all-reduce, which gloo supports too). Then, for each
source rank's K/V, `varlen_workbench.kernels.varlen.varlen_attention(return_lse=True)` computes a partial result for the
local queries (the block structure of a zig-zag ring: causal on the diagonal, else the source's
first chunk for all local queries, or all of the source for the local second chunk), and the
partials merge by log-sum-exp. Rows that see no key in a block get lse = -inf there; the merge
keeps them exactly 0, never NaN, also in the backward (autograd through the merge and the
kernel's lse gradient). Self-attention only (q and k/v share the layout), causal or full: no
sliding window. Every rank passes the *global* boundary vectors.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.instruments.seqpar import TIMEOUT_S, _all_gather, _backend, _free_port, _spawn, process_group
from varlen_workbench.workbench.layout import PackedBatch, cumulative


class LayoutError(ValueError):
    """A packed layout that cannot be split into equal zig-zag chunks."""


def _check_cp_size(cp_size: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size = {cp_size!r} must be a positive int (the ranks of the context-parallel group).")


def check_cp_layout(cu_seqlens_padded: torch.Tensor, cp_size: int) -> None:
    """Every padded sequence length must be a multiple of 2 x cp_size (equal zig-zag chunks)."""
    _check_cp_size(cp_size)
    lengths = cu_seqlens_padded.diff().tolist()
    bad = [i for i, n in enumerate(lengths) if n % (2 * cp_size)]
    if bad:
        i = bad[0]
        raise LayoutError(
            f"sequence {i} has {lengths[i]} rows in the padded layout (cu_seqlens_padded[{i + 1}] - "
            f"cu_seqlens_padded[{i}]), not a multiple of 2 x cp_size = {2 * cp_size}: zig-zag chunking cuts every "
            f"sequence into {2 * cp_size} equal chunks. Pad each sequence to a multiple of {2 * cp_size} "
            "(round its padded length up; cu_seqlens keeps the real lengths)."
        )


@dataclass(frozen=True)
class ZigZag:
    """The zig-zag split of one packed layout over `cp_size` ranks (host-side integers)."""

    real: tuple[int, ...]  # real length of each sequence
    padded: tuple[int, ...]  # padded length of each sequence
    starts: tuple[int, ...]  # global padded start of each sequence
    cp_size: int

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, *, validate: bool = True) -> ZigZag:
        """`validate=False` skips the 2 x cp_size rule: chunks are then floor(padded / (2 x cp_size))
        rows and the rows left over belong to no rank (what breaking the rule costs)."""
        if validate:
            check_cp_layout(cu_seqlens_padded, cp_size)
        padded = cu_seqlens_padded.tolist()
        return cls(
            tuple(cu_seqlens.diff().tolist()),
            tuple(cu_seqlens_padded.diff().tolist()),
            tuple(padded[:-1]),
            cp_size,
        )

    def chunk(self, i: int) -> int:
        return self.padded[i] // (2 * self.cp_size)

    def chunks(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank `rank` holds."""
        return rank, 2 * self.cp_size - 1 - rank

    def real_in_chunk(self, i: int, j: int) -> int:
        """Real rows of sequence i inside its chunk j (a prefix of the chunk)."""
        c = self.chunk(i)
        return min(max(self.real[i] - j * c, 0), c)

    @property
    def sequence_rows(self) -> int:
        """Rows of every rank's sequence chunks (TAIL excluded): what the all-gather moves."""
        return sum(2 * self.chunk(i) for i in range(len(self.real)))

    def rows(self, rank: int, total_rows: int) -> torch.Tensor:
        """Global row indices of rank `rank`'s shard of a tensor of `total_rows` rows, in local
        order: per sequence chunk r then chunk 2 x cp_size - 1 - r, and on the last rank the TAIL rows."""
        index = [
            self.starts[i] + j * self.chunk(i) + t
            for i in range(len(self.real))
            for j in self.chunks(rank)
            for t in range(self.chunk(i))
        ]
        if rank == self.cp_size - 1:
            index += range(self.starts[-1] + self.padded[-1], total_rows)
        return torch.tensor(index, dtype=torch.int64)

    def local_cu(self, rank: int, halves: tuple[int, ...] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_seqlens, cu_seqlens_padded) of rank `rank`'s shard, counting only the chunks in
        `halves` (0: chunk r, 1: chunk 2 x cp_size - 1 - r) as real. A sequence's real rows are a
        prefix of its local rows: chunk r precedes the other globally."""
        chunks = self.chunks(rank)
        real = [sum(self.real_in_chunk(i, chunks[h]) for h in halves) for i in range(len(self.real))]
        return cumulative(real), cumulative([2 * self.chunk(i) for i in range(len(self.real))])

    def second_halves(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local row indices of chunk 2 x cp_size - 1 - r of every sequence, with the
        (cu_seqlens, cu_seqlens_padded) of those rows packed back to back."""
        j, offset, index = self.chunks(rank)[1], 0, list[int]()
        for i in range(len(self.real)):
            c = self.chunk(i)
            index += range(offset + c, offset + 2 * c)
            offset += 2 * c
        lengths = [self.real_in_chunk(i, j) for i in range(len(self.real))]
        return (
            torch.tensor(index, dtype=torch.int64),
            cumulative(lengths),
            cumulative([self.chunk(i) for i in range(len(self.real))]),
        )


def shard_thd(
    x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, rank: int, cp_size: int, *, validate: bool = True
) -> torch.Tensor:
    """Rank `rank`'s zig-zag shard of the packed tensor `x` (rows: the global layout, TAIL included)."""
    zigzag = ZigZag.of(cu_seqlens.cpu(), cu_seqlens_padded.cpu(), cp_size, validate=validate)
    return x.index_select(0, zigzag.rows(rank, x.shape[0]).to(x.device))


def unshard_thd(
    shards: list[torch.Tensor],
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    total_rows: int,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """The global tensor from every rank's shard; rows no rank holds (possible only with
    `validate=False`) come back NaN."""
    zigzag = ZigZag.of(cu_seqlens.cpu(), cu_seqlens_padded.cpu(), len(shards), validate=validate)
    out = shards[0].new_full((total_rows, *shards[0].shape[1:]), float("nan"))
    for rank, local in enumerate(shards):
        out[zigzag.rows(rank, total_rows).to(out.device)] = local
    return out


class _GatherShards(torch.autograd.Function):
    """All-gather along a new leading rank dimension; backward: all-reduce, keep this rank's slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        gathered = local.new_empty((world * local.shape[0], *local.shape[1:]))  # gloo takes the concatenated form only
        _all_gather(gathered, local.contiguous(), group)
        return gathered.view(world, *local.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # the collective writes in place
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of partial attention results over disjoint key sets.

    outs: (T, H, D) each; lses: (H, T) float32 each, -inf where a row saw no key. A row with
    -inf everywhere merges to out = 0, lse = -inf, and gradients 0: the shift is finite (0 there)
    and no exp(-inf - -inf) is ever formed.
    """
    lse = torch.stack(lses)  # (S, H, T)
    shift = lse.max(0).values.detach()  # the result does not depend on it: no gradient needed
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    weights = torch.exp(lse - shift)  # 0 exactly where lse = -inf
    total = weights.sum(0)  # (H, T)
    seen = total > 0
    denominator = torch.where(seen, total, torch.ones_like(total))
    out = sum((w / denominator).transpose(0, 1)[..., None] * o.float() for w, o in zip(weights, outs))
    merged_lse = torch.where(seen, shift + torch.log(denominator), torch.full_like(shift, float("-inf")))
    return out.to(outs[0].dtype), merged_lse


def _check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, zigzag: ZigZag, rank: int) -> None:
    """Shard sizes: the chunks' rows on every rank; the last rank may hold TAIL rows after them."""
    last = rank == zigzag.cp_size - 1
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape[0] != q.shape[0] or x.shape[0] < zigzag.sequence_rows or (x.shape[0] > zigzag.sequence_rows and not last):
            raise ValueError(
                f"{name} has {x.shape[0]} rows on rank {rank} (q: {q.shape[0]}) but the zig-zag shard of this layout has "
                f"{zigzag.sequence_rows} rows" + (" plus any TAIL rows" if last else "") + " on this rank: pass "
                "shard_thd(x, cu_seqlens, cu_seqlens_padded, rank, cp_size) for q, k and v, with the global boundary vectors."
            )


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    group=None,
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Self-attention over this rank's zig-zag shard of a packed batch (see the module docstring).

    q, k, v: this rank's shards (`shard_thd`), (T_local, H, D) and (T_local, H_kv, D).
    cu_seqlens, cu_seqlens_padded: the *global* boundaries, the same on every rank; every padded
    length a multiple of 2 x cp_size. Returns this rank's rows of out (and lse (H, T_local)
    float32): REAL rows as the single-device kernel gives them within its error bound, GAP and
    TAIL rows exactly 0 (lse -inf), with gradients exactly 0 there. `validate=False` skips the
    2 x cp_size rule (to see what breaking it does: see `ZigZag.of`).
    """
    rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    zigzag = ZigZag.of(cu_seqlens.cpu(), cu_seqlens_padded.cpu(), cp_size, validate=validate)
    _check_local(q, k, v, zigzag, rank)
    rows = zigzag.sequence_rows
    kv = _GatherShards.apply(torch.stack([k[:rows], v[:rows]]), group)  # (cp, 2, rows, H_kv, D)
    device = q.device
    cu_q, cu_q_padded = (t.to(device) for t in zigzag.local_cu(rank))
    outs, lses = [], []
    for src in range(cp_size):
        k_src, v_src = kv[src, 0], kv[src, 1]
        if not causal or src == rank:  # all of src's keys, causal on the diagonal (same positions)
            cu_k, cu_k_padded = (t.to(device) for t in zigzag.local_cu(src))
            out, lse = _block(q, k_src, v_src, cu_q, cu_k, cu_q_padded, cu_k_padded, causal, scale)
        elif src < rank:  # both local chunks see src's first chunk whole, its second not at all
            cu_k, cu_k_padded = (t.to(device) for t in zigzag.local_cu(src, halves=(0,)))
            out, lse = _block(q, k_src, v_src, cu_q, cu_k, cu_q_padded, cu_k_padded, False, scale)
        else:  # src > rank: only the local second chunk sees src, and it sees both of src's chunks
            index, cu_q2, cu_q2_padded = (t.to(device) for t in zigzag.second_halves(rank))
            cu_k, cu_k_padded = (t.to(device) for t in zigzag.local_cu(src))
            out2, lse2 = _block(q.index_select(0, index), k_src, v_src, cu_q2, cu_k, cu_q2_padded, cu_k_padded, False, scale)
            out = q.new_zeros(q.shape[0], *out2.shape[1:]).index_copy(0, index, out2)
            lse = lse2.new_full((lse2.shape[0], q.shape[0]), float("-inf")).index_copy(1, index, lse2)
        outs.append(out)
        lses.append(lse)
    out, lse = merge_partials(outs, lses)
    return (out, lse) if return_lse else out


def _block(q, k, v, cu_q, cu_k, cu_q_padded, cu_k_padded, causal: bool, scale: float | None):
    """One partial: our Triton kernel (pinned, whatever the device) on local queries against one source's keys, with lse."""
    longest_q, longest_k = int(cu_q.diff().max()), int(cu_k.diff().max())
    return varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        longest_q,
        longest_k,
        cu_seqlens_q_padded=cu_q_padded,
        cu_seqlens_k_padded=cu_k_padded,
        causal=causal,
        scale=scale,
        return_lse=True,
        backend="triton",
    )


# -- running it on spawned processes --------------------------------------------------------


@dataclass(frozen=True)
class RankResult:
    """One rank's shard of out, dq, dk, dv (CPU), or the error it raised."""

    rank: int
    tensors: dict[str, torch.Tensor] | None
    error: str | None


def _job(batch: PackedBatch, d_out: torch.Tensor) -> dict[str, Any]:
    same = (
        torch.equal(batch.cu_seqlens_q.cpu(), batch.cu_seqlens_k.cpu())
        and torch.equal(batch.cu_seqlens_q_padded.cpu(), batch.cu_seqlens_k_padded.cpu())
        and batch.q.shape[0] == batch.k.shape[0]
    )
    if not same:
        raise ValueError(
            f"{batch.case.label()}: q and k/v have different layouts; context-parallel attention here is "
            "self-attention over one packed layout (give the Case padded_k = padded_q and tail_k = tail_q)."
        )
    return {
        "q": batch.q.detach().cpu(),
        "k": batch.k.detach().cpu(),
        "v": batch.v.detach().cpu(),
        "d_out": d_out.detach().cpu(),
        "cu_seqlens": batch.cu_seqlens_q.cpu(),
        "cu_seqlens_padded": batch.cu_seqlens_q_padded.cpu(),
        "causal": batch.case.causal,
    }


def _run_rank(impl: Callable, job: dict[str, Any], rank: int, cp_size: int, device: torch.device, validate: bool) -> RankResult:
    """Forward and backward of `impl` on this rank's shard, in NaN-poisoned memory."""
    cu, cu_padded = job["cu_seqlens"], job["cu_seqlens_padded"]
    try:
        local = {
            n: shard_thd(job[n], cu, cu_padded, rank, cp_size, validate=validate).to(device) for n in ("q", "k", "v", "d_out")
        }
        leaves = {n: local[n].requires_grad_() for n in ("q", "k", "v")}
        with poisoned_memory():
            out = impl(*leaves.values(), cu.to(device), cu_padded.to(device), causal=job["causal"], validate=validate)
            out.backward(local["d_out"])
    except (ValueError, RuntimeError) as exc:  # raised before any collective, on every rank alike
        return RankResult(rank, None, f"{type(exc).__name__}: {exc}")
    grads = {f"d{n}": leaf.grad.detach().cpu() for n, leaf in leaves.items()}
    return RankResult(rank, {"out": out.detach().cpu(), **grads}, None)


def _worker(rank: int, cp_size: int, port: int, workdir: str, backend: str, timeout_s: float) -> None:
    job = torch.load(Path(workdir) / "job.pt", weights_only=False)
    with process_group(rank, cp_size, port, backend, timeout_s, job["device"]) as device:
        results = [_run_rank(job["impl"], one, rank, cp_size, device, job["validate"]) for one in job["batches"]]
    torch.save(results, Path(workdir) / f"rank{rank}.pt")


def cp_backend(cp_size: int) -> str:
    """The backend `cp_size` ranks use here: NCCL with one GPU each, or gloo on a CPU-only machine
    (the Triton interpreter); a GPU machine with fewer GPUs than ranks is an error, not a gloo run."""
    _check_cp_size(cp_size)
    backend = _backend(cp_size)
    if backend == "gloo" and torch.cuda.is_available():
        raise ValueError(
            f"cp_size = {cp_size} needs {cp_size} GPUs for NCCL, and this machine has {torch.cuda.device_count()}: "
            f"run with cp_size <= {torch.cuda.device_count()}, or on a CPU-only machine (gloo, Triton interpreter)."
        )
    return backend


@contextlib.contextmanager
def _children_on_cpu() -> Iterator[None]:
    """Processes spawned inside default to the CPU (`WORKBENCH_DEVICE`, read when a child imports
    `kernels`), where the kernels run through the Triton interpreter; this process keeps its own."""
    saved = os.environ.get("WORKBENCH_DEVICE")
    os.environ["WORKBENCH_DEVICE"] = "cpu"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("WORKBENCH_DEVICE", None)
        else:
            os.environ["WORKBENCH_DEVICE"] = saved


def run_context_parallel(
    batches: Sequence[tuple[PackedBatch, torch.Tensor]],
    *,
    cp_size: int = 2,
    impl: Callable = context_parallel_attention,
    validate: bool = True,
    on_cpu: bool = False,
    timeout_s: float = TIMEOUT_S,
) -> tuple[str, list[list[RankResult]]]:
    """Runs `impl` context-parallel over `cp_size` spawned processes on each (batch, dO) pair:
    forward, then backward with dO's shard, under NaN-poisoned memory. Returns the backend and,
    per batch, every rank's `RankResult`.

    `impl` has `context_parallel_attention`'s signature and must be importable by name (the
    ranks are spawned). Ranks use NCCL with one GPU each when there are `cp_size` GPUs, gloo on
    CPU (the Triton interpreter) on a CPU-only machine (`cp_backend`); `on_cpu=True` runs them
    on gloo and the interpreter on any machine (a study whose answer must not depend on it).
    """
    backend = "gloo" if on_cpu else cp_backend(cp_size)
    with tempfile.TemporaryDirectory(prefix="wb-cp-") as workdir:
        jobs = [_job(batch, d_out) for batch, d_out in batches]
        torch.save({"batches": jobs, "impl": impl, "validate": validate, "device": "cpu"}, Path(workdir) / "job.pt")
        with _children_on_cpu() if on_cpu else contextlib.nullcontext():
            _spawn(_worker, (cp_size, _free_port(), workdir, backend, timeout_s), cp_size, timeout_s)
        per_rank = [torch.load(Path(workdir) / f"rank{r}.pt", weights_only=False) for r in range(cp_size)]
    return backend, [[rank[i] for rank in per_rank] for i in range(len(batches))]
