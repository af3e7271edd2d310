"""Replica of flash-dmattn's Triton path (HKUSTDial/flash-sparse-attention#121, formerly SmallDoges/flash-dmattn).

flash-dmattn's Triton backend (`flash_dmattn/flash_dmattn_triton.py`, mid-2025) is Tri Dao's
`flash_attn_triton.py` plus a boolean dynamic mask and an additive bias, both (B, H_kv, Q, K).
This module (the launchers) and `dmattn_kernels` (the Triton kernels) keep its mechanism,
written by us. The released 1.2.2 differs in one respect: its `any_active` block skipping is
commented out, so it visits every key block (the post-mortem runs 1.2.2 itself for everything
but the patch and the guard below):

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
from varlen_workbench.kernels.replicas.dmattn_kernels import (
    _bwd_kernel,
    _bwd_preprocess_do_o_dot,
    _copilot_where_isfinite,
    _fwd_kernel,
)

FLASH_DMATTN_DTYPES = (torch.float16, torch.bfloat16)  # upstream asserts "Only support fp16 and bf16"
BLOCK_SIZES = (16, 32, 64, 128)
LSE_ROUND = 128  # upstream rounds the lse / delta row count up to a multiple of 128


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
