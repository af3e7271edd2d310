"""Launchers of the varlen attention kernels: work lists, tiles (timed natively), grids. No host sync.

Outputs are allocated with `torch.empty` and every row is written by a kernel: REAL rows by
the attention kernels, padding rows (GAP and TAIL) by `fill_padding_rows_kernel`. Nothing
relies on the allocator handing out zeros, and nothing pays for a full-buffer memset.

Launches are few because each costs tens of microseconds of host time natively, which short
documents cannot hide behind GPU work: a forward pass is three (the work lists of both sides,
attention, one fill of out and lse), a backward pass three (dQ, which also writes delta; dK/dV;
one fill of dq, dk and dv), reusing the forward pass's work lists. Fewer where the caller
knows more, as `varlen_attention` does from the device check of the boundaries
(kernels/varlen/device_check.py): the fills are left out (`fill=False`) once the check has
passed with every row real, and the work lists of the check's safe copy, which nothing writes,
are written by the check itself, for every call that runs on it (`work=`): no launch of their own.

Tiles: under the interpreter one fixed tile (every op costs a numpy call whatever its size,
so the fewest steps win). Natively `tuner()` times each kernel's candidate tiles on the first
call of a shape class and keeps the fastest; the attention kernels write disjoint rows and
never read what they write, so timing them on the caller's own tensors is harmless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from varlen_workbench.kernels._compat import device_capability
from varlen_workbench.kernels.caches import cached, instance
from varlen_workbench.kernels.interpreter import dot_upcast_needed
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen.backward_kernels import attention_backward_dkdv_kernel, attention_backward_dq_kernel
from varlen_workbench.kernels.varlen.forward_kernels import attention_forward_kernel
from varlen_workbench.kernels.varlen.hopper import (
    DEFAULT_FORWARD,
    active_forward_config,
    check_descriptor_alignment,
    ensure_descriptor_allocator,
    longest_first,
    persistent_programs,
    warp_specialize_fails,
)
from varlen_workbench.kernels.varlen.kernel_common import block_starts_kernel, fill_padding_rows_kernel
from varlen_workbench.kernels.varlen.tuner import INTERPRETER_TILE, NATIVE_TILES, Tile, TileTuner, shape_class


def lanes(head_dim: int) -> int:
    """The lanes a kernel computes a head of `head_dim` features on: the next power of two
    (`tl.arange` takes no other length), at least 16 (the smallest K of `tl.dot`). The lanes
    past the head dim are masked: they load 0 and are never stored. Plain integer arithmetic:
    `triton.next_power_of_2` is a constexpr function, microseconds of host time per call."""
    return max(16, 1 << (head_dim - 1).bit_length())


@cached  # asked at every launch; a few microseconds each, which short documents cannot hide
def native_tiles(kernel: str, head_dim: int, dtype: torch.dtype, head_dim_v: int | None = None) -> tuple[Tile, ...]:
    """The compiled-GPU candidates of `kernel` for q/k of `head_dim` and v of `head_dim_v`
    (default: the same): those of the row bucket of the wider one's lanes. A padded head dim
    (48, 96, 192) costs the registers and shared memory of its lanes (64, 128, 256), so it
    takes their tiles."""
    by_row_bytes = NATIVE_TILES[kernel]
    row_bytes = max(lanes(head_dim), lanes(head_dim if head_dim_v is None else head_dim_v)) * dtype.itemsize
    return by_row_bytes[min(b for b in by_row_bytes if b >= row_bytes)]


def candidate_tiles(
    kernel: str, head_dim: int, dtype: torch.dtype, device: torch.device, head_dim_v: int | None = None
) -> tuple[Tile, ...]:
    """The tiles `tuner()` may pick for `kernel` ('forward', 'dkdv' or 'dq') on `device`, best guess first."""
    if interpreted(device):
        return (INTERPRETER_TILE,)
    return native_tiles(kernel, head_dim, dtype, head_dim_v)


def tuner() -> TileTuner:
    """The process's tile tuner: its choices are kept in kernels/caches.py (`caches.reset()` drops them)."""
    return instance(TileTuner)


def _shape_class(
    kernel: str, q: torch.Tensor, v: torch.Tensor, total_rows: int, n_seqs: int, window: Window, group: int
) -> tuple:
    return shape_class(
        kernel, q.dtype, q.shape[1], q.shape[2], total_rows, n_seqs, window.right >= 0, group, window.left >= 0, v.shape[2]
    )


def head_dim_constexprs(q: torch.Tensor, v: torch.Tensor) -> dict[str, int]:
    """The attention kernels' head-dim constexprs: q/k's and v's head dims and their lanes."""
    head_dim, head_dim_v = q.shape[2], v.shape[2]
    return {"HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim_v, "BLOCK_D": lanes(head_dim), "BLOCK_DV": lanes(head_dim_v)}


@dataclass(frozen=True)
class Window:
    """FlashAttention's (left, right) window, -1 = unbounded; causal is right = 0.

    Query i of a sequence sees key j iff i + off - left <= j <= i + off + right, with
    off = len_k - len_q (bottom-right aligned)."""

    left: int
    right: int

    @classmethod
    def of(cls, causal: bool, window_left: int, window_right: int) -> Window:
        """`causal=True` bounds the right side at 0, as FlashAttention does; other bounds stay."""
        return cls(int(window_left), 0 if causal else int(window_right))

    def kernel_args(self) -> tuple[int, int]:
        """(window_left, window_right) runtime arguments: an unbounded side passes 0, unread."""
        return max(self.left, 0), max(self.right, 0)

    def constexprs(self) -> dict[str, bool]:
        return {"WINDOW_LEFT": self.left >= 0, "WINDOW_RIGHT": self.right >= 0}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a host-side grid: `triton.cdiv` is a constexpr function, whose call costs
    about 3 us of host time (argument unwrapping, an import), this one 50 ns."""
    return -(-a // b)


# Work lists are written for every block size a tile may use, in one launch.
SMALLEST_BLOCK_LOG2 = 4
BLOCK_SIZES = tuple(1 << i for i in range(SMALLEST_BLOCK_LOG2, 8))  # 16 .. 128


@dataclass(frozen=True)
class WorkList:
    """(sequence, block) work list of one side: starts[i][s] = blocks of BLOCK_SIZES[i] before sequence s."""

    starts: torch.Tensor  # int32 (len(BLOCK_SIZES), >= B+1), on the device
    n_seqs: int
    total_rows: int

    @property
    def search_steps(self) -> int:
        """Binary-search steps over B+1 boundaries: ceil(log2(B + 1)) <= B.bit_length()."""
        return self.n_seqs.bit_length()

    def blocks(self, block: int) -> tuple[torch.Tensor, int]:
        """The block starts for `block` rows and a grid that covers them without a sync:
        cdiv(len_i, block) <= len_i / block + 1 and sum_i len_i <= total_rows."""
        return self.starts[BLOCK_SIZES.index(block)], cdiv(self.total_rows, block) + self.n_seqs


QUERIES, KEYS = 0, 1  # the sides of `work_lists`


def work_lists_shape(n_seqs):
    """(side, block size, boundary): rows padded to 4 int32 keep every row 16-byte aligned, as
    Triton specializes pointers on it. `n_seqs` may be symbolic (the op's fake implementation)."""
    return (2, len(BLOCK_SIZES), (n_seqs + 4) // 4 * 4)


def work_lists(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """Block starts of the queries and the keys for every block size, in one launch."""
    n_seqs = cu_seqlens_q.numel() - 1
    work = torch.empty(work_lists_shape(n_seqs), dtype=torch.int32, device=cu_seqlens_q.device)
    block_starts_kernel[(2,)](
        cu_seqlens_q,
        cu_seqlens_k,
        work,
        n_seqs,
        work.stride(0),
        work.stride(1),
        SMALLEST_LOG2=SMALLEST_BLOCK_LOG2,
        N_SIZES=len(BLOCK_SIZES),
        CHUNK=1024,
    )
    return work


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclass(frozen=True)
class Padding:
    """A 2-D (rows, cols) view of an output whose padding rows get `value`, and its side's metadata."""

    view: torch.Tensor
    value: float
    cu_real: torch.Tensor
    cu_padded: torch.Tensor


FILL_TARGETS = 3  # views one fill launch takes
FILL_ROWS = 64


def fill_padding_rows(*targets: Padding, failed: torch.Tensor | None = None) -> None:
    """Writes each target's `value` into its padding rows, any strides: one launch for all.
    `failed`: a device check's verdict (non-zero first entry: the boundaries failed), read on
    the device: NaN is written instead where it says so."""
    if len(targets) > FILL_TARGETS:
        raise ValueError(f"fill_padding_rows takes at most {FILL_TARGETS} targets, got {len(targets)}")
    targets = tuple(t for t in targets if t.view.numel())
    if not targets:
        return
    n_rows = max(t.view.shape[0] for t in targets)
    n_cols = max(t.view.shape[1] for t in targets)
    block_cols = min(1 << (n_cols - 1).bit_length(), 256)  # the next power of 2
    n_seqs = targets[0].cu_real.numel() - 1
    slots = targets + targets[:1] * (FILL_TARGETS - len(targets))  # unused slots: no program reaches them
    args = [
        a
        for t in slots
        for a in (t.view, t.view.stride(0), t.view.stride(1), t.view.shape[0], t.view.shape[1], t.value, t.cu_real, t.cu_padded)
    ]
    fill_padding_rows_kernel[(cdiv(n_rows, FILL_ROWS), cdiv(n_cols, block_cols), len(targets))](
        *args,
        n_seqs,
        n_seqs.bit_length(),
        targets[0].cu_real if failed is None else failed,  # an unread pointer without a verdict
        BLOCK_ROWS=FILL_ROWS,
        BLOCK_COLS=block_cols,
        POISON=failed is not None,
    )


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor,
    cu_seqlens_k_padded: torch.Tensor,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    *,
    fill: bool = True,
    work: torch.Tensor | None = None,
    failed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns out (T_q, H, D_v) in q's dtype, lse (H, T_q) float32 and the work lists of both
    sides (`work_lists`), which the backward pass reuses. The mask is `Window.of(causal,
    window_left, window_right)`. `fill=False` skips the padding fill: only for boundaries known
    to make every row real (there is then nothing to fill). `work`: the work lists of these
    boundaries, made by an earlier call on them (boundaries nothing has written since), or None.
    `failed`: the verdict of the device check whose safe copy the boundaries are (`fill_padding_rows`)."""
    window = Window.of(causal, window_left, window_right)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    total_q, heads, _ = q.shape
    head_dim_v = v.shape[2]
    group = heads // k.shape[1]
    out = torch.empty((total_q, heads, head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    work = work_lists(cu_seqlens_q, cu_seqlens_k) if work is None else work
    rows = WorkList(work[QUERIES], cu_seqlens_q.numel() - 1, total_q)

    config = active_forward_config()
    if config.descriptors:
        check_descriptor_alignment(("q", q), ("k", k), ("v", v), ("out", out))
        ensure_descriptor_allocator(q.device)
    capability = None if interpreted(q.device) else device_capability(q.device)
    dims = head_dim_constexprs(q, v)
    candidates = tuple(
        t
        for t in candidate_tiles("forward", q.shape[2], q.dtype, q.device, head_dim_v)
        if not warp_specialize_fails(config, t, capability)
    )

    def launch(tile: Tile):
        if warp_specialize_fails(config, tile, capability):
            raise ValueError(
                f"ForwardConfig(warp_specialize=True) with tile {tile}: Triton 3.6's Hopper warp-specialization pass "
                "fails on this kernel at 4 warps on sm_90; pin a tile of 8 warps or leave warp_specialize off"
            )
        starts, grid = rows.blocks(tile.block_m)
        if config.persistent:
            order = longest_first(starts, rows.n_seqs, grid, cu_seqlens_q, cu_seqlens_k, tile.block_m, window.right >= 0)
            n_items = grid * heads
            launch_grid: tuple[int, ...] = (persistent_programs(q.device, n_items),)
        else:
            order, n_items, launch_grid = starts, 0, (grid, heads)  # order, n_items: unread
        return attention_forward_kernel[launch_grid](
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            cu_seqlens_q_padded,
            cu_seqlens_k_padded,
            starts,
            order,
            n_items,
            rows.n_seqs,
            rows.search_steps,
            scale * math.log2(math.e),
            *window.kernel_args(),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            GROUP=group,
            **window.constexprs(),
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            **dims,
            DOT_UPCAST=dot_upcast_needed(q.dtype, q.device),
            DESCRIPTORS=config.descriptors,
            WARP_SPECIALIZE=config.warp_specialize,
            PERSISTENT=config.persistent,
            N_HEADS=heads,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )

    key = _shape_class("forward", q, v, total_q, rows.n_seqs, window, group)
    tuner().launch(
        key if config == DEFAULT_FORWARD else (*key, str(config)),  # each variant tunes its own tile
        candidates,
        launch,
        total_q * heads,
    )
    if fill:
        fill_padding_rows(
            Padding(out.view(total_q, heads * head_dim_v), 0.0, cu_seqlens_q, cu_seqlens_q_padded),
            Padding(lse.T, float("-inf"), cu_seqlens_q, cu_seqlens_q_padded),
            failed=failed,
        )
    return out, lse, work


def attention_backward(
    d_out: torch.Tensor,
    d_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    work: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor,
    cu_seqlens_k_padded: torch.Tensor,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    *,
    fill: bool = True,
    failed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dq, dk, dv, each exactly 0 on padding rows; reads only REAL rows of every input.
    `d_lse` None: lse was not used (its gradient is 0); `work`: the forward pass's work lists;
    `fill`, `failed`: as in `attention_forward`."""
    window = Window.of(causal, window_left, window_right)
    q, k, v, out, d_out = (_last_dim_contiguous(t) for t in (q, k, v, out, d_out))
    total_q, heads, head_dim = q.shape
    total_k, kv_heads, _ = k.shape
    head_dim_v = v.shape[2]
    group = heads // kv_heads
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty_like(lse)  # written on REAL rows by the dQ pass, read there by dK/dV
    common = dict(
        GROUP=group, **window.constexprs(), **head_dim_constexprs(q, v), DOT_UPCAST=dot_upcast_needed(q.dtype, q.device)
    )
    cu = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
    qkv_strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), d_out.stride(0), d_out.stride(1))
    qk_scale = scale * math.log2(math.e)
    n_seqs = cu_seqlens_q.numel() - 1
    rows, keys = WorkList(work[QUERIES], n_seqs, total_q), WorkList(work[KEYS], n_seqs, total_k)

    def launch_dkdv(tile: Tile):
        starts, grid = keys.blocks(tile.block_n)
        return attention_backward_dkdv_kernel[(grid, kv_heads)](
            q,
            k,
            v,
            d_out,
            lse,
            delta,
            dk,
            dv,
            *cu,
            starts,
            keys.n_seqs,
            keys.search_steps,
            qk_scale,
            scale,
            *window.kernel_args(),
            *qkv_strides,
            dk.stride(0),
            dk.stride(1),
            dv.stride(0),
            dv.stride(1),
            lse.stride(0),
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            **common,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )

    def launch_dq(tile: Tile):
        starts, grid = rows.blocks(tile.block_m)
        return attention_backward_dq_kernel[
            (grid, heads)
        ](
            q,
            k,
            v,
            out,
            d_out,
            lse,
            delta if d_lse is None else d_lse.contiguous(),  # no d_lse: an unread pointer
            delta,
            dq,
            *cu,
            starts,
            rows.n_seqs,
            rows.search_steps,
            qk_scale,
            scale,
            *window.kernel_args(),
            *qkv_strides[:6],
            out.stride(0),
            out.stride(1),
            *qkv_strides[6:],
            dq.stride(0),
            dq.stride(1),
            lse.stride(0),
            HAS_DLSE=d_lse is not None,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            **common,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )

    # dQ first: it writes delta, which the dK/dV pass reads.
    tuner().launch(
        _shape_class("dq", q, v, total_q, rows.n_seqs, window, group),
        candidate_tiles("dq", head_dim, q.dtype, q.device, head_dim_v),
        launch_dq,
        total_q * heads,
    )
    tuner().launch(
        _shape_class("dkdv", q, v, total_k, keys.n_seqs, window, group),
        candidate_tiles("dkdv", head_dim, q.dtype, q.device, head_dim_v),
        launch_dkdv,
        total_k * heads,
    )
    if fill:
        fill_padding_rows(
            Padding(dq.view(total_q, heads * head_dim), 0.0, cu_seqlens_q, cu_seqlens_q_padded),
            Padding(dk.view(total_k, kv_heads * head_dim), 0.0, cu_seqlens_k, cu_seqlens_k_padded),
            Padding(dv.view(total_k, kv_heads * head_dim_v), 0.0, cu_seqlens_k, cu_seqlens_k_padded),
            failed=failed,
        )
    return dq, dk, dv
