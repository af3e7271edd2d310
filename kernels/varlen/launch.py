"""Launchers of the varlen attention kernels: tile sizes, strides, grids. No host sync.

Outputs are allocated with `torch.empty` and every row is written by a kernel: REAL rows by
the attention kernels, padding rows (GAP and TAIL) by `fill_padding_rows_kernel`. Nothing
relies on the allocator handing out zeros, and nothing pays for a full-buffer memset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kernels._compat import INTERPRETED
from kernels.interpreter import dot_upcast_needed
from kernels.varlen.triton_kernels import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
    attention_forward_kernel,
    fill_padding_rows_kernel,
)


@dataclass(frozen=True)
class Tile:
    """One kernel's launch shape: BLOCK_M query rows x BLOCK_N key rows per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Tiles:
    forward: Tile
    dq: Tile  # also the preprocess pass, which shares its blocks of query rows
    dkdv: Tile


def choose_tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    """Tile sizes per (head_dim, dtype, device); issue 10 replaces the native ones by autotuning.

    Native choices are sized for Hopper's 228 KB of shared memory by the bytes of one row:
    wider rows get smaller tiles (all fit in <= 131 KB, checked by compiling for sm_90). Under
    the interpreter (CPU) every op costs a numpy call whatever its size, so the fewest steps
    win: 64x64 runs a few hundred tokens ~4x faster than 32x32 and ~10x faster than 16x16.
    """
    if INTERPRETED:
        tile = Tile(64, 64, num_warps=4, num_stages=1)
        return Tiles(tile, tile, tile)
    row_bytes = head_dim * dtype.itemsize
    if row_bytes <= 128:  # fp16/bf16 with d <= 64, fp32 with d <= 32
        return Tiles(Tile(128, 64, 4, 3), Tile(128, 32, 4, 3), Tile(32, 128, 4, 3))
    if row_bytes <= 256:  # fp16/bf16 d128, fp32 d64
        return Tiles(Tile(128, 64, 8, 3), Tile(64, 32, 4, 2), Tile(32, 64, 4, 2))
    if row_bytes <= 512:  # fp16/bf16 d256, fp32 d128
        return Tiles(Tile(64, 32, 4, 2), Tile(32, 16, 4, 2), Tile(16, 32, 4, 2))
    return Tiles(Tile(32, 32, 4, 2), Tile(32, 16, 4, 1), Tile(16, 32, 4, 1))  # fp32 d256


@dataclass(frozen=True)
class _Blocks:
    """(sequence, block) work list of one side: block_starts[s] = blocks before sequence s."""

    starts: torch.Tensor  # int32 (B+1,), on the device
    grid_size: int  # an upper bound of starts[-1], known without a sync
    n_seqs: int
    search_steps: int


def _blocks(cu_seqlens: torch.Tensor, total_rows: int, block: int) -> _Blocks:
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    per_seq = torch.div(lengths + (block - 1), block, rounding_mode="floor")
    starts = torch.nn.functional.pad(per_seq.cumsum(0), (1, 0)).to(torch.int32)
    n_seqs = cu_seqlens.numel() - 1
    # cdiv(len_i, block) <= len_i / block + 1 and sum_i len_i <= total_rows.
    return _Blocks(starts, triton.cdiv(total_rows, block) + n_seqs, n_seqs, _search_steps(n_seqs))


def _search_steps(n_seqs: int) -> int:
    """Binary-search steps over B+1 boundaries: ceil(log2(B + 1)) <= B.bit_length()."""
    return n_seqs.bit_length()


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fill_padding_rows(x: torch.Tensor, value: float, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> None:
    """Writes `value` into the padding rows of the 2-D (rows, cols) view `x`, any strides."""
    n_rows, n_cols = x.shape
    if n_rows == 0 or n_cols == 0:
        return
    block_rows = 64
    block_cols = min(triton.next_power_of_2(n_cols), 256)
    n_seqs = cu_seqlens.numel() - 1
    fill_padding_rows_kernel[(triton.cdiv(n_rows, block_rows), triton.cdiv(n_cols, block_cols))](
        x, x.stride(0), x.stride(1), n_rows, n_cols, value,
        cu_seqlens, cu_seqlens_padded, n_seqs, _search_steps(n_seqs),
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out (T_q, H, D) in q's dtype and lse (H, T_q) float32."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    total_q, heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    tile = choose_tiles(head_dim, q.dtype).forward
    blocks = _blocks(cu_seqlens_q, total_q, tile.block_m)
    attention_forward_kernel[(blocks.grid_size, heads)](
        q, k, v, out, lse,
        cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded,
        blocks.starts, blocks.n_seqs, blocks.search_steps,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        GROUP=heads // k.shape[1], CAUSAL=causal, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        HEAD_DIM=head_dim, DOT_UPCAST=dot_upcast_needed(q.dtype),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    fill_padding_rows(out.view(total_q, heads * head_dim), 0.0, cu_seqlens_q, cu_seqlens_q_padded)
    fill_padding_rows(lse.T, float("-inf"), cu_seqlens_q, cu_seqlens_q_padded)
    return out, lse


def attention_backward(
    d_out: torch.Tensor,
    d_lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor,
    cu_seqlens_k_padded: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dq, dk, dv, each exactly 0 on padding rows; reads only REAL rows of every input."""
    q, k, v, out, d_out = (_last_dim_contiguous(t) for t in (q, k, v, out, d_out))
    d_lse = d_lse.contiguous()
    total_q, heads, head_dim = q.shape
    total_k, kv_heads, _ = k.shape
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty_like(lse)  # only REAL rows are written, and only they are read
    tiles = choose_tiles(head_dim, q.dtype)
    common = dict(GROUP=heads // kv_heads, CAUSAL=causal, HEAD_DIM=head_dim, DOT_UPCAST=dot_upcast_needed(q.dtype))
    cu = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
    qkv_strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   d_out.stride(0), d_out.stride(1))
    qk_scale = scale * math.log2(math.e)

    rows = _blocks(cu_seqlens_q, total_q, tiles.dq.block_m)
    attention_backward_preprocess_kernel[(rows.grid_size, heads)](
        out, d_out, d_lse, delta,
        cu_seqlens_q, cu_seqlens_q_padded, rows.starts, rows.n_seqs, rows.search_steps,
        out.stride(0), out.stride(1), d_out.stride(0), d_out.stride(1), lse.stride(0),
        BLOCK_M=tiles.dq.block_m, HEAD_DIM=head_dim,
    )
    keys = _blocks(cu_seqlens_k, total_k, tiles.dkdv.block_n)
    attention_backward_dkdv_kernel[(keys.grid_size, kv_heads)](
        q, k, v, d_out, lse, delta, dk, dv,
        *cu, keys.starts, keys.n_seqs, keys.search_steps, qk_scale, scale,
        *qkv_strides, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
        BLOCK_M=tiles.dkdv.block_m, BLOCK_N=tiles.dkdv.block_n, **common,
        num_warps=tiles.dkdv.num_warps, num_stages=tiles.dkdv.num_stages,
    )
    attention_backward_dq_kernel[(rows.grid_size, heads)](
        q, k, v, d_out, lse, delta, dq,
        *cu, rows.starts, rows.n_seqs, rows.search_steps, qk_scale, scale,
        *qkv_strides, dq.stride(0), dq.stride(1), lse.stride(0),
        BLOCK_M=tiles.dq.block_m, BLOCK_N=tiles.dq.block_n, **common,
        num_warps=tiles.dq.num_warps, num_stages=tiles.dq.num_stages,
    )
    fill_padding_rows(dq.view(total_q, heads * head_dim), 0.0, cu_seqlens_q, cu_seqlens_q_padded)
    fill_padding_rows(dk.view(total_k, kv_heads * head_dim), 0.0, cu_seqlens_k, cu_seqlens_k_padded)
    fill_padding_rows(dv.view(total_k, kv_heads * head_dim), 0.0, cu_seqlens_k, cu_seqlens_k_padded)
    return dq, dk, dv
