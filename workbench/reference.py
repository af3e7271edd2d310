"""Reference attention, one document at a time: the source every check compares with.

`reference_attention` is the oracle: varlen attention per sequence in float64, with the kernel's
exact contract. `per_document_sdpa` is what a user would write, torch's SDPA per document in the
inputs' dtype: the real-client check's reference (float32) and bar (bf16), and the audit's
fairness witness.

The oracle has the same signature and semantics as `varlen_workbench.kernels.varlen.varlen_attention`.
Padding rows never enter its computation (real rows are gathered by index), so padding inputs
holding NaN cannot leak, and autograd gives exactly 0 on padding rows of dq, dk, dv.

`compute_dtype` other than float64 gives "PyTorch's own attention in that dtype": the
baseline of FlashAttention-style relative error bounds (see `varlen_workbench.workbench.bounds`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from varlen_workbench.kernels.contract import check_causal, check_varlen_inputs, check_window_size
from varlen_workbench.kernels.varlen.backends.torch import visible_keys
from varlen_workbench.workbench.layout import real_rows


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: tuple[int, int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q (Lq, H, D), k (Lk, H, D) and v (Lk, H, D_v) already repeated for GQA."""
    len_q, len_k = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = visible_keys(len_q, len_k, window, q.device)
    has_key = visible.any(-1)  # (Lq,)
    # Rows with no visible key are replaced by zeros *before* logsumexp so that neither the
    # forward nor autograd ever evaluates exp(-inf - (-inf)); their output is then zeroed.
    scores = scores.masked_fill(~visible, float("-inf"))
    scores = torch.where(has_key[None, :, None], scores, torch.zeros_like(scores))
    lse = torch.logsumexp(scores, dim=-1)  # (H, Lq)
    probs = torch.exp(scores - lse[..., None]) * has_key[None, :, None]
    out = torch.einsum("hqk,khd->qhd", probs, v)
    lse = torch.where(has_key[None, :], lse, torch.full_like(lse, float("-inf")))
    return out, lse


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float64,
    validate: bool = True,
):
    """Varlen attention computed sequence by sequence in `compute_dtype` (float64 by default).

    Returns out (T_q, H, D_v) in `compute_dtype` (v's head dim), padding rows exactly 0; with `return_lse`,
    also lse (H, T_q) in `compute_dtype`, -inf on padding rows and on rows with no visible key.
    `causal` and `window_size` as in `varlen_workbench.kernels.varlen.varlen_attention` (causal bounds the right at 0).
    """
    left, right = check_window_size(window_size)
    window = (left, 0 if check_causal(causal) else right)
    if validate:
        check_varlen_inputs(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_k_padded=cu_seqlens_k_padded,
            scale=scale,
        )
    total_q, heads, head_dim = q.shape
    group = heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    padded_q = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
    padded_k = cu_seqlens_k if cu_seqlens_k_padded is None else cu_seqlens_k_padded
    rows_q = real_rows(cu_seqlens_q, padded_q)
    rows_k = real_rows(cu_seqlens_k, padded_k)
    # Gather real rows first: padding values (NaN, Inf) never reach an arithmetic op.
    q_real = q.index_select(0, rows_q).to(compute_dtype)
    k_real = k.index_select(0, rows_k).to(compute_dtype).repeat_interleave(group, dim=1)
    v_real = v.index_select(0, rows_k).to(compute_dtype).repeat_interleave(group, dim=1)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(bounds_q) - 1):
        sq = slice(bounds_q[i], bounds_q[i + 1])
        sk = slice(bounds_k[i], bounds_k[i + 1])
        out_i, lse_i = _attend(q_real[sq], k_real[sk], v_real[sk], window, scale)
        outs.append(out_i)
        lses.append(lse_i)
    out = q_real.new_zeros((total_q, heads, v.shape[2])).index_copy(0, rows_q, torch.cat(outs))
    if not return_lse:
        return out
    lse = torch.full((heads, total_q), float("-inf"), dtype=compute_dtype, device=q.device)
    lse = lse.index_copy(1, rows_q, torch.cat(lses, dim=1))
    return out, lse


def per_document_sdpa(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    cu_seqlens_q_padded=None,
    cu_seqlens_k_padded=None,
    causal=False,
    scale=None,
) -> torch.Tensor:
    """Attention one document at a time with `F.scaled_dot_product_attention`, in the inputs' dtype;
    every other row 0. Validates nothing.

    No packing, so nothing of one document can reach another, and no padding row reaches
    anything. Causal is bottom-right aligned, as the contract says: a query row with no visible
    key (more queries than keys) is 0, as is every row of a document with no keys."""
    out = q.new_zeros((*q.shape[:2], v.shape[-1]))  # v's head dim
    # Boundaries as a user may hand them over: tensors, or Python sequences of ints.
    cu_q, cu_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    starts_q = cu_q if cu_seqlens_q_padded is None else [int(x) for x in cu_seqlens_q_padded]
    starts_k = cu_k if cu_seqlens_k_padded is None else [int(x) for x in cu_seqlens_k_padded]
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    for sq, sk, lq, lk in zip(starts_q, starts_k, lengths_q, lengths_k):
        if lq == 0 or lk == 0:
            continue
        # SDPA's own causal mask is top-left aligned: the same as bottom-right only for as many queries as keys.
        mask = None if not causal or lq == lk else torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        o = F.scaled_dot_product_attention(
            q[sq : sq + lq].transpose(0, 1)[None],
            k[sk : sk + lk].transpose(0, 1)[None],
            v[sk : sk + lk].transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=causal and mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )[0]
        if mask is not None:
            o = torch.where(mask.any(-1)[None, :, None], o, 0.0)
        out[sq : sq + lq] = o.transpose(0, 1)
    return out
