"""Replica of torch's `varlen_attn` padding mechanism (pytorch/pytorch#176793).

Upstream (`torch.nn.attention.varlen`, 2.10+) is a custom op over FlashAttention-2's
`mha_varlen_fwd/bwd`, which allocate `out = empty_like(q)` and `dq, dk, dv = empty_like(...)`
and launch a grid of (query blocks of max_seqlen, batch, heads): every program finds its
sequence through `cu_seqlens` and writes only rows inside it. Rows at or beyond
`cu_seqlens[-1]` (TAIL rows, legal memory of a padded token budget) are visited by nobody and
return whatever the allocator left there: zeros in a fresh process, stale activations in
training, NaN under `varlen_workbench.workbench.instruments.poison.poisoned_memory()`.

These kernels keep exactly that mechanism — same allocation, same grid, same "only covered rows"
stores — with a small FlashAttention-2 forward and a three-kernel backward (delta, dk/dv, dq)
of our own. Real rows are computed correctly: the bug is what is *not* written.

`replica_varlen_attn` has torch 2.10's call shape (`is_causal` positional), plus 2.11's keywords
`scale`, `window_size` and `return_aux` and 2.12's `enable_gqa`, so the workbench's "torch-varlen"
adapter (`varlen_workbench.workbench.audit.adapt`) and a reader's call drive the replica and torch's own function
alike. `seqused_q`/`seqused_k` (FlashAttention's: sequence i uses the first seqused[i] rows of its
slot) let it stand in for FlashAttention-4's varlen call too, whose unwritten GAP rows are the rows
of a slot past seqused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from varlen_workbench.kernels.contract import check_window_size
from varlen_workbench.kernels.interpreter import dot_upcast_needed
from varlen_workbench.kernels.runtime import jit

BLOCK_M = 64  # query rows per program
BLOCK_N = 64  # key rows per inner step
VARLEN_ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what torch varlen_attn takes

# `stale_memory()`: while active, the replica's upstream-style allocations (out, dq, dk, dv) come
# back filled with finite, seeded values, as a caching allocator hands back the stale
# activations of earlier ops in training. Process-wide, not per thread: on CUDA the backward
# runs in autograd's device thread. [seed, scale, allocations so far], or None.
_STALE: list = [None]


@contextlib.contextmanager
def stale_memory(scale: float = 1.0, seed: int = 0) -> Iterator[None]:
    """Within the block the replica's `empty_like` buffers hold finite garbage (normal values times
    `scale`, seeded, different for every allocation): the commonest state of reused memory in
    training, where nothing turns NaN and nothing warns. Deterministic, unlike the allocator."""
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(f"stale_memory(scale={scale!r}): give a finite scale > 0, the size of the stale values.")
    saved = _STALE[0]
    _STALE[0] = [seed, float(scale), 0]
    try:
        yield
    finally:
        _STALE[0] = saved


def _uninitialised_like(t: torch.Tensor) -> torch.Tensor:
    """`torch.empty_like(t)`, upstream's allocation; under `stale_memory()`, stale finite values."""
    out = torch.empty_like(t)
    state = _STALE[0]
    if state is not None:
        seed, scale, count = state
        state[2] += 1
        generator = torch.Generator().manual_seed(seed * 1_000_003 + count)
        out.copy_(torch.randn(out.shape, generator=generator) * scale)
    return out


@jit
def _visible(rows, cols, len_q, len_k, left, right):
    """Query `rows` see key `cols` (broadcast): in range and inside the window (left, right) around
    the bottom-right aligned diagonal, -1 = unbounded (causal: right = 0), as FlashAttention has it."""
    ok = (rows[:, None] < len_q) & (cols[None, :] < len_k)
    diagonal = rows[:, None] + (len_k - len_q)
    return ok & ((right < 0) | (cols[None, :] <= diagonal + right)) & ((left < 0) | (cols[None, :] >= diagonal - left))


@jit
def _sequence(cu, used, seq, HAS_USED: tl.constexpr):
    """(first row, rows used) of sequence `seq`: its slot starts at cu[seq]; it uses the whole slot,
    or with seqused its first used[seq] rows. Rows of no sequence are visited by no program."""
    start = tl.load(cu + seq).to(tl.int64)
    if HAS_USED:
        length = tl.load(used + seq).to(tl.int32)
    else:
        length = (tl.load(cu + seq + 1) - start).to(tl.int32)
    return start, length


@jit
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    cu_q,
    cu_k,
    used_q,
    used_k,
    scale,
    left,
    right,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_USED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, len_q = _sequence(cu_q, used_q, seq, HAS_USED)
    k_start, len_k = _sequence(cu_k, used_k, seq, HAS_USED)
    if block * BLOCK_M >= len_q:
        return  # the grid is sized by max_seqlen: shorter sequences leave programs idle
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HEAD_DIM
    q = tl.load(
        Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=(rows[:, None] < len_q) & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    kv_head = head // GROUP
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, len_k, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols[:, None] < len_k) & dmask[None, :]
        offs = (k_start + cols)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        k = tl.load(K + offs, mask=kv_mask, other=0.0)
        v = tl.load(V + offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(_visible(rows, cols, len_q, len_k, left, right), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.log(tl.where(has_key, l_i, 1.0)), float("-inf"))
    tl.store(
        Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=(rows[:, None] < len_q) & dmask[None, :],
    )
    tl.store(Lse + head * stride_lh + q_start + rows, lse, mask=rows < len_q)


@jit
def _bwd_delta_kernel(
    Out,
    dOut,
    Delta,
    cu_q,
    used_q,
    stride_ot,
    stride_oh,
    stride_dh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_USED: tl.constexpr,
):
    """delta = rowsum(O * dO), FlashAttention-2's backward preprocess, on covered rows only."""
    block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, len_q = _sequence(cu_q, used_q, seq, HAS_USED)
    if block * BLOCK_M >= len_q:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < len_q) & (dims[None, :] < HEAD_DIM)
    offs = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    o = tl.load(Out + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dOut + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + head * stride_dh + q_start + rows, tl.sum(o * do, 1), mask=rows < len_q)


@jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    dOut,
    Lse,
    Delta,
    dK,
    dV,
    cu_q,
    cu_k,
    used_q,
    used_k,
    scale,
    left,
    right,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_USED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One key block of one kv head: sums over its GROUP query heads and every query block."""
    block, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, len_q = _sequence(cu_q, used_q, seq, HAS_USED)
    k_start, len_k = _sequence(cu_k, used_k, seq, HAS_USED)
    if block * BLOCK_N >= len_k:
        return
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HEAD_DIM
    kv_mask = (cols[:, None] < len_k) & dmask[None, :]
    kv_offs = (k_start + cols)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
    k = tl.load(K + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_offs, mask=kv_mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for m0 in range(0, len_q, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            q_mask = (rows[:, None] < len_q) & dmask[None, :]
            q_offs = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
            q = tl.load(Q + q_offs, mask=q_mask, other=0.0)
            do = tl.load(dOut + q_offs, mask=q_mask, other=0.0)
            if UPCAST:
                q, do = q.to(tl.float32), do.to(tl.float32)
            lse = tl.load(Lse + head * stride_lh + q_start + rows, mask=rows < len_q, other=float("inf"))
            delta = tl.load(Delta + head * stride_lh + q_start + rows, mask=rows < len_q, other=0.0)
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # no visible key: p = 0
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = _visible(rows, cols, len_q, len_k, left, right)
            p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    tl.store(dK + kv_offs, (dk * scale).to(dK.dtype.element_ty), mask=kv_mask)
    tl.store(dV + kv_offs, dv.to(dV.dtype.element_ty), mask=kv_mask)


@jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    dOut,
    Lse,
    Delta,
    dQ,
    cu_q,
    cu_k,
    used_q,
    used_k,
    scale,
    left,
    right,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_USED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, len_q = _sequence(cu_q, used_q, seq, HAS_USED)
    k_start, len_k = _sequence(cu_k, used_k, seq, HAS_USED)
    if block * BLOCK_M >= len_q:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HEAD_DIM
    q_mask = (rows[:, None] < len_q) & dmask[None, :]
    q_offs = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(Q + q_offs, mask=q_mask, other=0.0)
    do = tl.load(dOut + q_offs, mask=q_mask, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse = tl.load(Lse + head * stride_lh + q_start + rows, mask=rows < len_q, other=float("inf"))
    delta = tl.load(Delta + head * stride_lh + q_start + rows, mask=rows < len_q, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    kv_head = head // GROUP
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, len_k, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols[:, None] < len_k) & dmask[None, :]
        kv_offs = (k_start + cols)[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        k = tl.load(K + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p = tl.where(_visible(rows, cols, len_q, len_k, left, right), tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(dQ + q_offs, (dq * scale).to(dQ.dtype.element_ty), mask=q_mask)


def _launch_options(q: torch.Tensor, used: torch.Tensor | None) -> dict:
    upcast = dot_upcast_needed(q.dtype, q.device)
    fp32_operands = upcast or q.dtype == torch.float32
    return {
        "HEAD_DIM": q.shape[2],
        "BLOCK_D": max(16, triton.next_power_of_2(q.shape[2])),
        "HAS_USED": used is not None,
        "UPCAST": upcast,
        # fp32 operands natively default to TF32 (10-bit mantissa): ask for IEEE so fp32 runs
        # match PyTorch's fp32 baseline, as the interpreter does anyway.
        "PRECISION": "ieee" if fp32_operands else "tf32",
    }


def _check(query, key, value, cu_seq_q, cu_seq_k) -> None:
    """Shape and dtype checks only: upstream reads no metadata on the host, nor do we."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D (total_tokens, heads, head_dim), got shape {tuple(t.shape)}; "
                "varlen_attn takes packed THD tensors (view a (T, H*D) projection as (T, H, D))."
            )
        if t.dtype not in VARLEN_ATTN_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; the replica supports {VARLEN_ATTN_DTYPES}.")
    if key.shape != value.shape or query.shape[2] != key.shape[2] or query.dtype != key.dtype or key.dtype != value.dtype:
        raise ValueError(
            f"query {tuple(query.shape)} {query.dtype}, key {tuple(key.shape)} {key.dtype}, value "
            f"{tuple(value.shape)} {value.dtype}: key and value must match, and all three need one "
            "head_dim and one dtype."
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of key heads {key.shape[1]}.")
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 tensor of batch+1 boundaries, got {cu.dtype} {tuple(cu.shape)}.")
    if cu_seq_q.numel() != cu_seq_k.numel():
        raise ValueError(
            f"cu_seq_q has {cu_seq_q.numel()} boundaries but cu_seq_k has {cu_seq_k.numel()}; one batch, one length."
        )


@torch.library.custom_op("replicas::torch_varlen_fwd", mutates_args=())
def _fwd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    used_q: torch.Tensor | None,
    used_k: torch.Tensor | None,
    max_q: int,
    window: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    out = _uninitialised_like(q)  # the upstream allocation: rows nobody writes keep old memory
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(max_q, BLOCK_M), cu_seq_q.numel() - 1, q.shape[1])
    _fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_seq_q,
        cu_seq_k,
        cu_seq_q if used_q is None else used_q,
        cu_seq_k if used_k is None else used_k,
        scale,
        *window,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        GROUP=q.shape[1] // k.shape[1],
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        **_launch_options(q, used_q),
    )
    return out, lse


@_fwd.register_fake
def _(query, key, value, cu_seq_q, cu_seq_k, used_q, used_k, max_q, window, scale):
    return torch.empty_like(query), query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)


@torch.library.custom_op("replicas::torch_varlen_bwd", mutates_args=())
def _bwd(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    used_q: torch.Tensor | None,
    used_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    window: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, o, do = (t.contiguous() for t in (query, key, value, out, grad_out))
    # The upstream allocation (mha_varlen_bwd): uncovered rows are never written.
    dq, dk, dv = _uninitialised_like(q), _uninitialised_like(k), _uninitialised_like(v)
    delta = torch.empty_like(lse)
    batch, heads, kv_heads = cu_seq_q.numel() - 1, q.shape[1], k.shape[1]
    used_q_or_cu, used_k_or_cu = cu_seq_q if used_q is None else used_q, cu_seq_k if used_k is None else used_k
    options = _launch_options(q, used_q)
    _bwd_delta_kernel[(triton.cdiv(max_q, BLOCK_M), batch, heads)](
        o,
        do,
        delta,
        cu_seq_q,
        used_q_or_cu,
        o.stride(0),
        o.stride(1),
        delta.stride(0),
        HEAD_DIM=options["HEAD_DIM"],
        BLOCK_D=options["BLOCK_D"],
        BLOCK_M=BLOCK_M,
        HAS_USED=options["HAS_USED"],
    )
    sequences = (cu_seq_q, cu_seq_k, used_q_or_cu, used_k_or_cu, scale, *window)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0))
    common = dict(GROUP=heads // kv_heads, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, **options)
    _bwd_dkdv_kernel[(triton.cdiv(max_k, BLOCK_N), batch, kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *sequences, *strides, **common
    )
    _bwd_dq_kernel[(triton.cdiv(max_q, BLOCK_M), batch, heads)](q, k, v, do, lse, delta, dq, *sequences, *strides, **common)
    return dq, dk, dv


@_bwd.register_fake
def _(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, used_q, used_k, max_q, max_k, window, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


class _ReplicaVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, cu_seq_q, cu_seq_k, used_q, used_k, max_q, max_k, window, scale):
        out, lse = _fwd(query, key, value, cu_seq_q, cu_seq_k, used_q, used_k, max_q, window, scale)
        ctx.save_for_backward(query, key, value, out, lse, cu_seq_q, cu_seq_k, used_q, used_k)
        ctx.meta = (max_q, max_k, window, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        dq, dk, dv = _bwd(grad_out, *ctx.saved_tensors, *ctx.meta)
        return dq, dk, dv, *(None,) * 8


def replica_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    return_lse: bool = False,
    return_aux=None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
):
    """torch 2.10's `varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal)`,
    bug included: rows at or beyond `cu_seq_q[-1]` (`cu_seq_k[-1]` for dk, dv) of the output and
    of the gradients are never written; with `seqused_q`/`seqused_k`, neither are the rows of a
    slot past its used length. `window_size=(-1, 0)` is causal, as in torch >= 2.11; `return_aux`
    with `.lse` true (torch >= 2.11's AuxRequest) or `return_lse` returns (out, lse (H, T_q)).
    """
    _check(query, key, value, cu_seq_q, cu_seq_k)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}; pass enable_gqa=True for "
            "grouped-query attention (as torch >= 2.12 requires)."
        )
    if (seqused_q is None) != (seqused_k is None):
        raise ValueError("pass seqused_q and seqused_k together (the replica reads both sides' used lengths or neither).")
    left, right = check_window_size(window_size)
    window = [left, 0 if is_causal else right]
    scale = query.shape[2] ** -0.5 if scale is None else float(scale)
    out, lse = _ReplicaVarlen.apply(
        query, key, value, cu_seq_q, cu_seq_k, seqused_q, seqused_k, int(max_q), int(max_k), window, scale
    )
    return (out, lse) if return_lse or getattr(return_aux, "lse", False) else out
