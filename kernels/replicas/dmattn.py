"""Replica of flash-dmattn's Triton path (HKUSTDial/flash-sparse-attention#121, formerly SmallDoges/flash-dmattn).

flash-dmattn's Triton backend (`flash_dmattn/flash_dmattn_triton.py`, mid-2025) is Tri Dao's
`flash_attn_triton.py` plus a boolean dynamic mask and an additive bias, both (B, H_kv, Q, K).
This module keeps its mechanism, written by us. The released 1.2.2 differs in one respect: its
`any_active` block skipping is commented out, so it visits every key block (the post-mortem runs
1.2.2 itself for everything but the patch and the guard below):

* forward: one program per (query tile, batch x head); online softmax over key blocks, masked
  scores set to -inf, `m_ij = max(rowmax(scores), lse_i)`, and a key block skipped when the mask
  is all False over the whole tile (`any_active = reduce_or(mask)`). Out-of-range query rows of
  the last tile load the mask with `other=False`, so they are fully masked rows too;
* backward: one program per batch x head looping over every key block (Tri Dao's
  `SEQUENCE_PARALLEL=False`), dq accumulated in fp32, dk/dv stored once per key block; the
  causal early exit stores zeros, so every dk/dv row below seqlen_k is written.

The bug: a query row whose first *visited* key block is fully masked for it has
`m_ij = max(-inf, -inf) = -inf`, so `p = exp(-inf - (-inf)) = NaN`. Its lse and output are NaN,
and in the backward `p = exp(s - NaN)` is NaN for every key the tile visits, so dV (and dK, dQ,
dbias) turn NaN — on real keys too, through the other rows of the tile.

Two compile-time switches replay two answers:

* `guard` — our guard for rows with no visible key: `m_ij = where(m_ij > -inf, m_ij, 0)`, the
  running sum and the output scale guarded the same way, and the backward's lse read as 0 where it
  is -inf. A row with no visible key then has output 0, lse -inf and gradient 0. (No flash-dmattn
  release has a guard; a later, undated version of the successor repository guards the lse it
  subtracts instead: HKUSTDial/flash-sparse-attention@0b8d052, read, not run.)
* `patch` — a working equivalent of Copilot's PR #122 for #121 (commit 9969738, not merged): `zeros_like` dk/dv buffers and
  `tl.where(isfinite(x), x, 0.0)` on the loaded dO, on each dv/dk accumulation delta and on the
  final dk/dv store. `tl.isfinite` does not exist in Triton (the PR as written cannot compile);
  `_finite_or_zero` spells it with operations that do.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from varlen_workbench.kernels.contract import check_scale
from varlen_workbench.kernels.interpreter import dot_upcast_needed
from varlen_workbench.kernels.runtime import jit

FLASH_DMATTN_DTYPES = (torch.float16, torch.bfloat16)  # upstream asserts "Only support fp16 and bf16"
BLOCK_SIZES = (16, 32, 64, 128)
LSE_ROUND = 128  # upstream rounds the lse / delta row count up to a multiple of 128


@jit
def _finite_or_zero(x):
    """The Copilot patch's `tl.where(tl.isfinite(x), x, 0.0)`: NaN fails x == x, +-inf fails |x| < inf."""
    return tl.where((x == x) & (tl.abs(x) < float("inf")), x, 0.0)


@jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The Triton interpreter multiplies the raw bits of bf16 operands (triton-lang/triton#11584):
    # there only (UPCAST comes from varlen_workbench.kernels.interpreter.dot_upcast_needed), operands already
    # rounded to the input dtype are upcast to fp32. Native code never takes this branch.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b)


@jit
def _scores(
    q,
    k,
    Mask,
    Bias,
    offs_m,
    offs_n,
    stride_mm,
    stride_bm,
    seqlen_q,
    seqlen_k,
    softmax_scale,
    mask,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Scaled scores plus bias for one (query tile, key block), masked entries at -inf (as upstream)."""
    acc_s = _dot(q, tl.trans(k), UPCAST) * softmax_scale
    if HAS_BIAS:
        bias = tl.load(
            Bias + offs_m[:, None] * stride_bm + offs_n[None, :],
            mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k),
            other=0.0,
        )
        acc_s += bias.to(tl.float32)
    acc_s += tl.where(offs_n[None, :] < seqlen_k, 0.0, float("-inf"))
    if IS_CAUSAL:  # top-left aligned, as upstream at the time of the report
        acc_s += tl.where(offs_m[:, None] >= offs_n[None, :], 0.0, float("-inf"))
    if HAS_MASK:
        acc_s += tl.where(mask, 0.0, float("-inf"))
    return acc_s


@jit
def _load_mask(Mask, offs_m, offs_n, stride_mm, seqlen_q, seqlen_k, HAS_MASK: tl.constexpr):
    """The tile's mask and whether any entry is True; rows/keys out of range load as False (upstream's other=False)."""
    if HAS_MASK:
        mask = tl.load(
            Mask + offs_m[:, None] * stride_mm + offs_n[None, :],
            mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k),
            other=False,
        )
        # upstream: tl.reduce_or(mask, axis=None). A max is the same test, and the interpreter runs
        # it in numpy instead of calling the combine function once per element (seconds per tile).
        any_active = tl.max(tl.max(mask.to(tl.int32), 1), 0) > 0
    else:
        mask = offs_n[None, :] >= 0  # unused: HAS_MASK=False compiles the mask term out
        any_active = True
    return mask, any_active


@jit
def _fwd_kernel(
    Q,
    K,
    V,
    Mask,
    Bias,
    Out,
    Lse,
    softmax_scale,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_ob,
    stride_om,
    stride_oh,
    nheads,
    group,
    seqlen_q,
    seqlen_k,
    seqlen_q_rounded,
    headdim,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GUARD: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_HEADDIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_hb = tl.program_id(1)
    off_b = off_hb // nheads
    off_h = off_hb % nheads
    off_hk = off_h // group
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_HEADDIM)
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_kb + off_hk * stride_kh
    Mask += off_b * stride_mb + off_hk * stride_mh
    Bias += off_b * stride_bb + off_hk * stride_bh

    lse_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_M, BLOCK_HEADDIM], dtype=tl.float32)
    q = tl.load(
        Q + offs_m[:, None] * stride_qm + offs_d[None, :],
        mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < headdim),
        other=0.0,
    )
    end_n = seqlen_k if not IS_CAUSAL else tl.minimum((start_m + 1) * BLOCK_M, seqlen_k)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        mask, any_active = _load_mask(Mask, offs_m, cols, stride_mm, seqlen_q, seqlen_k, HAS_MASK)
        if any_active:  # dynamic-mask block skipping: no True entry in the whole tile
            kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < headdim)
            k = tl.load(K + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            acc_s = _scores(
                q,
                k,
                Mask,
                Bias,
                offs_m,
                cols,
                stride_mm,
                stride_bm,
                seqlen_q,
                seqlen_k,
                softmax_scale,
                mask,
                IS_CAUSAL,
                HAS_MASK,
                HAS_BIAS,
                UPCAST,
            )
            # THE BUG: a row fully masked in the first block it visits has m_ij = -inf here,
            # and exp(-inf - (-inf)) = NaN below.
            m_ij = tl.maximum(tl.max(acc_s, 1), lse_i)
            if GUARD:
                m_ij = tl.where(m_ij > float("-inf"), m_ij, 0.0)
            p = tl.exp(acc_s - m_ij[:, None])
            l_ij = tl.sum(p, 1)
            acc_o = acc_o * tl.exp(m_i - m_ij)[:, None]
            v = tl.load(V + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            acc_o += _dot(p.to(v.dtype), v, UPCAST)
            m_i = m_ij
            l_i_new = tl.exp(lse_i - m_ij) + l_ij
            if GUARD:
                l_i_new = tl.where(lse_i > float("-inf"), l_i_new, l_ij)
            lse_i = m_ij + tl.log(l_i_new)

    o_scale = tl.exp(m_i - lse_i)  # also NaN for a row that never visited a block: exp(-inf - (-inf))
    if GUARD:
        o_scale = tl.where(lse_i > float("-inf"), o_scale, 0.0)
    acc_o = acc_o * o_scale[:, None]
    tl.store(Lse + off_hb * seqlen_q_rounded + offs_m, lse_i)
    tl.store(
        Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
        acc_o.to(Out.dtype.element_ty),
        mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < headdim),
    )


@jit
def _bwd_preprocess_do_o_dot(
    Out,
    DO,
    Delta,
    stride_ob,
    stride_om,
    stride_oh,
    stride_dob,
    stride_dom,
    stride_doh,
    nheads,
    seqlen_q,
    seqlen_q_rounded,
    headdim,
    BLOCK_M: tl.constexpr,
    BLOCK_HEADDIM: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_hb = tl.program_id(1)
    off_b = off_hb // nheads
    off_h = off_hb % nheads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_HEADDIM)
    inside = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < headdim)
    o = tl.load(
        Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], mask=inside, other=0.0
    ).to(tl.float32)
    do = tl.load(
        DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :], mask=inside, other=0.0
    ).to(tl.float32)
    tl.store(Delta + off_hb * seqlen_q_rounded + offs_m, tl.sum(o * do, axis=1))


@jit
def _bwd_kernel(
    Q,
    K,
    V,
    Mask,
    Bias,
    DO,
    DQ,
    DK,
    DV,
    DBias,
    LSE,
    D,
    Written,
    softmax_scale,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_dob,
    stride_dom,
    stride_doh,
    stride_dqb,
    stride_dqm,
    stride_dqh,
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dbb,
    stride_dbh,
    stride_dbm,
    nheads,
    group,
    seqlen_q,
    seqlen_k,
    seqlen_q_rounded,
    headdim,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GUARD: tl.constexpr,
    PATCH: tl.constexpr,
    RECORD_WRITES: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_HEADDIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    off_hb = tl.program_id(1)
    off_b = off_hb // nheads
    off_h = off_hb % nheads
    off_hk = off_h // group
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_kb + off_hk * stride_kh
    Mask += off_b * stride_mb + off_hk * stride_mh
    Bias += off_b * stride_bb + off_hk * stride_bh
    DO += off_b * stride_dob + off_h * stride_doh
    DQ += off_b * stride_dqb + off_h * stride_dqh
    DK += off_b * stride_dkb + off_h * stride_dkh  # per query head; the wrapper sums GQA groups
    DV += off_b * stride_dkb + off_h * stride_dkh
    DBias += off_b * stride_dbb + off_h * stride_dbh
    LSE += off_hb * seqlen_q_rounded
    D += off_hb * seqlen_q_rounded
    Written += off_hb * seqlen_k
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_HEADDIM)
    num_block_m = tl.cdiv(seqlen_q, BLOCK_M)
    for start_n in range(0, tl.cdiv(seqlen_k, BLOCK_N)):
        # Tri Dao's _bwd_kernel_one_col_block, inlined: one key block, every query tile below it.
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < headdim)
        dv = tl.zeros([BLOCK_N, BLOCK_HEADDIM], dtype=tl.float32)
        dk = tl.zeros([BLOCK_N, BLOCK_HEADDIM], dtype=tl.float32)
        begin_m = 0 if not IS_CAUSAL else ((start_n * BLOCK_N) // BLOCK_M) * BLOCK_M
        # Upstream's causal early exit (`if begin_m >= seqlen_q: store zeros; return`) as an
        # empty loop: dk/dv of this block stay zero and are stored below, like every other block.
        k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        for start_m in range(begin_m, num_block_m * BLOCK_M, BLOCK_M):
            rows = start_m + offs_m
            mask, any_active = _load_mask(Mask, rows, offs_n, stride_mm, seqlen_q, seqlen_k, HAS_MASK)
            if any_active:
                q_mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < headdim)
                q = tl.load(Q + rows[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
                acc_s = _scores(
                    q,
                    k,
                    Mask,
                    Bias,
                    rows,
                    offs_n,
                    stride_mm,
                    stride_bm,
                    seqlen_q,
                    seqlen_k,
                    softmax_scale,
                    mask,
                    IS_CAUSAL,
                    HAS_MASK,
                    HAS_BIAS,
                    UPCAST,
                )
                lse_i = tl.load(LSE + rows)
                if GUARD:
                    lse_i = tl.where(lse_i > float("-inf"), lse_i, 0.0)
                p = tl.exp(acc_s - lse_i[:, None])  # NaN lse: NaN for every key of the block
                do = tl.load(DO + rows[:, None] * stride_dom + offs_d[None, :], mask=q_mask, other=0.0)
                if PATCH:
                    do = _finite_or_zero(do)
                dv_delta = _dot(tl.trans(p.to(do.dtype)), do, UPCAST)
                if PATCH:  # one NaN row of p makes the whole delta NaN: the tile's contribution is dropped
                    dv_delta = _finite_or_zero(dv_delta)
                dv += dv_delta
                dp = _dot(do, tl.trans(v), UPCAST)
                Di = tl.load(D + rows)
                dbias = p * (dp - Di[:, None])
                ds = (dbias * softmax_scale).to(q.dtype)
                if HAS_BIAS:
                    tl.store(
                        DBias + rows[:, None] * stride_dbm + offs_n[None, :],
                        dbias,
                        mask=(rows[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k),
                    )
                dk_delta = _dot(tl.trans(ds), q, UPCAST)
                if PATCH:
                    dk_delta = _finite_or_zero(dk_delta)
                dk += dk_delta
                dq_ptrs = DQ + rows[:, None] * stride_dqm + offs_d[None, :]
                dq = tl.load(dq_ptrs, mask=q_mask, other=0.0)
                tl.store(dq_ptrs, dq + _dot(ds, k, UPCAST), mask=q_mask)
        if PATCH:
            dv = _finite_or_zero(dv)
            dk = _finite_or_zero(dk)
        tl.store(DV + offs_n[:, None] * stride_dkn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)
        tl.store(DK + offs_n[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
        if RECORD_WRITES:  # instrumentation: which dk/dv rows the store above covered
            tl.store(Written + offs_n, tl.full([BLOCK_N], 1, tl.int8), mask=offs_n < seqlen_k)


@jit
def _copilot_where_isfinite(X, Y, N: tl.constexpr):
    """The Copilot PR's masking exactly as written: `tl.where(tl.isfinite(x), x, 0.0)`."""
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, tl.where(tl.isfinite(x), x, 0.0))


def isfinite_exists() -> bool:
    """Whether the installed Triton has `tl.isfinite` (checked: 2.3.1, 3.2, 3.4, 3.6, 3.9 do not)."""
    return hasattr(tl, "isfinite")


def launch_patch_as_written(device: torch.device | str = "cpu") -> torch.Tensor:
    """Launches the PR's masking on [1, nan, inf, -inf] x 4; raises where `tl.isfinite` does not exist
    (AttributeError under the interpreter, a CompilationError wrapping it natively)."""
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf] * 4, device=device)
    y = torch.empty_like(x)
    _copilot_where_isfinite[(1,)](x, y, N=x.numel())
    return y


class DmattnGrads(NamedTuple):
    """Gradients of one backward; `rows_written` (B, H, S_k) bool when recorded, else None."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor | None
    rows_written: torch.Tensor | None


def _broadcast(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], q: torch.Tensor):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}.")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; it must be one of {dtypes}.")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but query is on {q.device}; move it with .to(query.device).")
    try:
        return t.expand(shape)
    except RuntimeError:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, which does not broadcast to (batch, kv_heads, seqlen_q, seqlen_k) "
            f"= {shape}; build it as (B, H_kv, Q, K) or with size-1 dimensions to broadcast."
        ) from None


def _check(query, key, value, attn_mask, attn_bias, block_m, block_n):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor (batch, seqlen, heads, head_dim), got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}."
            )
        if t.dtype not in FLASH_DMATTN_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; flash-dmattn's Triton path takes {FLASH_DMATTN_DTYPES} (cast with .to())."
            )
    batch, seqlen_q, heads, head_dim = query.shape
    if key.shape != value.shape or key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must match each other and query "
            f"{tuple(query.shape)} in batch and head_dim."
        )
    if not (query.dtype == key.dtype == value.dtype) or not (query.device == key.device == value.device):
        raise ValueError("query, key and value must share one dtype and one device.")
    if heads % key.shape[2]:
        raise ValueError(f"query has {heads} heads, key {key.shape[2]}: the query heads must be a multiple of the kv heads.")
    if head_dim > 128:
        raise ValueError(f"head_dim = {head_dim}; flash-dmattn supports head dimensions up to 128.")
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block not in BLOCK_SIZES:
            raise ValueError(f"{name} = {block!r} must be one of {BLOCK_SIZES}.")
    shape = (batch, key.shape[2], seqlen_q, key.shape[1])
    mask = _broadcast("attn_mask", attn_mask, shape, (torch.bool,), query)
    bias = _broadcast("attn_bias", attn_bias, shape, (query.dtype, torch.float32), query)
    return mask, bias


def _strides(t: torch.Tensor | None, n: int = 3) -> tuple[int, ...]:
    return tuple(t.stride()[:n]) if t is not None else (0,) * n


def _forward(q, k, v, mask, bias, causal, scale, guard, block_m, block_n):
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    seqlen_q_rounded = math.ceil(seqlen_q / LSE_ROUND) * LSE_ROUND
    lse = torch.empty((batch, heads, seqlen_q_rounded), device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    dummy = q.new_empty(0)
    grid = (triton.cdiv(seqlen_q, block_m), batch * heads)
    _fwd_kernel[grid](
        q,
        k,
        v,
        dummy if mask is None else mask,
        dummy if bias is None else bias,
        out,
        lse,
        scale,
        *_strides(q),
        *_strides(k),
        *_strides(mask),
        *_strides(bias),
        *_strides(out),
        heads,
        heads // kv_heads,
        seqlen_q,
        seqlen_k,
        seqlen_q_rounded,
        head_dim,
        IS_CAUSAL=causal,
        HAS_MASK=mask is not None,
        HAS_BIAS=bias is not None,
        GUARD=guard,
        UPCAST=dot_upcast_needed(q.dtype, q.device),
        BLOCK_HEADDIM=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out, lse


def _backward(
    do, q, k, v, out, lse, mask, bias, causal, scale, guard, patch, block_m, block_n, record_writes=False, zero_init=None
):
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    do = do.contiguous()
    seqlen_q_rounded = lse.shape[-1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    delta = torch.empty_like(lse)
    _bwd_preprocess_do_o_dot[(triton.cdiv(seqlen_q_rounded, block_m), batch * heads)](
        out,
        do,
        delta,
        *_strides(out),
        *_strides(do),
        heads,
        seqlen_q,
        seqlen_q_rounded,
        head_dim,
        BLOCK_M=block_m,
        BLOCK_HEADDIM=block_d,
    )
    dq_accum = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # upstream: init_to_zero("DQ")
    # Upstream: dk, dv = torch.empty_like(k), torch.empty_like(v) (the Copilot PR: zeros_like).
    # One buffer per query head so GQA groups can be summed; with group == 1 it is k's shape.
    alloc = torch.zeros if (patch if zero_init is None else zero_init) else torch.empty
    dk = alloc((batch, seqlen_k, heads, head_dim), device=q.device, dtype=q.dtype)
    dv = alloc((batch, seqlen_k, heads, head_dim), device=q.device, dtype=q.dtype)
    dbias = None if bias is None else torch.zeros((batch, heads, seqlen_q, seqlen_k), device=q.device, dtype=torch.float32)
    written = torch.zeros((batch, heads, seqlen_k), device=q.device, dtype=torch.int8) if record_writes else q.new_empty(0)
    dummy = q.new_empty(0)
    _bwd_kernel[(1, batch * heads)](
        q,
        k,
        v,
        dummy if mask is None else mask,
        dummy if bias is None else bias,
        do,
        dq_accum,
        dk,
        dv,
        dummy if dbias is None else dbias,
        lse,
        delta,
        written,
        scale,
        *_strides(q),
        *_strides(k),
        *_strides(mask),
        *_strides(bias),
        *_strides(do),
        *_strides(dq_accum),
        *_strides(dk),
        *_strides(dbias),
        heads,
        group,
        seqlen_q,
        seqlen_k,
        seqlen_q_rounded,
        head_dim,
        IS_CAUSAL=causal,
        HAS_MASK=mask is not None,
        HAS_BIAS=bias is not None,
        GUARD=guard,
        PATCH=patch,
        RECORD_WRITES=record_writes,
        UPCAST=dot_upcast_needed(q.dtype, q.device),
        BLOCK_HEADDIM=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    if group > 1:
        dk = dk.view(batch, seqlen_k, kv_heads, group, head_dim).sum(3)
        dv = dv.view(batch, seqlen_k, kv_heads, group, head_dim).sum(3)
    if dbias is not None:
        dbias = dbias.view(batch, kv_heads, group, seqlen_q, seqlen_k).sum(2)
    return DmattnGrads(dq_accum.to(q.dtype), dk, dv, dbias, written.bool() if record_writes else None)


class _DmattnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, causal, scale, guard, patch, block_m, block_n):
        out, lse = _forward(q, k, v, mask, bias, causal, scale, guard, block_m, block_n)
        ctx.save_for_backward(q, k, v, out, lse, mask, bias)
        ctx.options = (causal, scale, guard, patch, block_m, block_n)
        ctx.mark_non_differentiable(lse)
        return out, lse[:, :, : q.shape[1]]

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        grads = _backward(d_out, q, k, v, out, lse, mask, bias, *ctx.options)
        dbias = grads.dbias
        if dbias is not None and ctx.needs_input_grad[4]:
            dbias = dbias.to(bias.dtype)
        return grads.dq, grads.dk, grads.dv, None, dbias, None, None, None, None, None, None


def triton_dmattn_func(
    query,
    key,
    value,
    attn_mask=None,
    attn_bias=None,
    is_causal=False,
    scale=None,
    *,
    guard=False,
    patch=False,
    block_m=64,
    block_n=64,
    return_lse=False,
):
    """flash-dmattn's `triton_dmattn_func`: q (B, Q, H, D), k/v (B, K, H_kv, D); mask (bool) and bias
    broadcastable to (B, H_kv, Q, K); returns out (B, Q, H, D) (and lse (B, H, Q) with `return_lse`).

    Differentiable in query, key, value and attn_bias. `guard` applies our guard for rows with no visible key,
    `patch` the Copilot PR's masking; `block_m`/`block_n` set the tile sizes (upstream autotunes).
    """
    mask, bias = _check(query, key, value, attn_mask, attn_bias, block_m, block_n)
    scale = check_scale(scale, query.shape[-1])
    out, lse = _DmattnFunction.apply(
        query, key, value, mask, bias, bool(is_causal), scale, bool(guard), bool(patch), block_m, block_n
    )
    return (out, lse) if return_lse else out


def dmattn_backward(
    query,
    key,
    value,
    d_out,
    attn_mask=None,
    attn_bias=None,
    is_causal=False,
    scale=None,
    *,
    guard=False,
    patch=False,
    block_m=64,
    block_n=64,
    record_writes=True,
    zero_init=None,
) -> DmattnGrads:
    """Forward then backward with the kernels' own buffers, recording which dk/dv rows were stored.

    The instrument for the `empty_like -> zeros_like` half of the patch: with `record_writes`,
    `rows_written[b, h, n]` is True when the dk/dv store covered key row n; `zero_init` picks the
    dk/dv allocation alone (default: zeros with `patch`, empty without, as upstream).
    """
    mask, bias = _check(query, key, value, attn_mask, attn_bias, block_m, block_n)
    scale = check_scale(scale, query.shape[-1])
    if d_out.shape != query.shape or d_out.dtype != query.dtype:
        raise ValueError(
            f"d_out {tuple(d_out.shape)} {d_out.dtype} must have query's shape and dtype {tuple(query.shape)} {query.dtype}."
        )
    with torch.no_grad():
        out, lse = _forward(query, key, value, mask, bias, bool(is_causal), scale, guard, block_m, block_n)
        return _backward(
            d_out,
            query,
            key,
            value,
            out,
            lse,
            mask,
            bias,
            bool(is_causal),
            scale,
            guard,
            patch,
            block_m,
            block_n,
            record_writes=record_writes,
            zero_init=zero_init,
        )
