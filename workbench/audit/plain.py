"""A correct varlen attention in plain PyTorch, written as a user would: the audit's fairness witness.

Per-sequence SDPA over `cu_seqlens` (and the padded layout when given), padding rows zero,
bottom-right causal, and no validation at all. It passes every correctness check of the audit,
and its missing validation shows as its own grade, never as a FAIL (tests/test_audit_fairness.py,
notebooks/audit-matrix.ipynb); tests plant faults around it (tests/test_audit_isolate.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def plain_attention(
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
):
    """Per-sequence SDPA over cu_seqlens, padding rows zero, bottom-right causal; validates nothing."""
    cu_q, cu_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    starts_q = [int(x) for x in cu_seqlens_q_padded] if cu_seqlens_q_padded is not None else cu_q
    starts_k = [int(x) for x in cu_seqlens_k_padded] if cu_seqlens_k_padded is not None else cu_k
    out = q.new_zeros((*q.shape[:2], v.shape[-1]))  # v's head dim
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if lq == 0 or lk == 0:
            continue
        qs = q[starts_q[b] : starts_q[b] + lq].transpose(0, 1)
        ks = k[starts_k[b] : starts_k[b] + lk].transpose(0, 1)
        vs = v[starts_k[b] : starts_k[b] + lk].transpose(0, 1)
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq) if causal else None
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=qs.shape[0] != ks.shape[0])
        if mask is not None:  # rows with no visible key: zero, as the contract says
            o = torch.where(mask.any(-1)[None, :, None], o, 0.0)
        out[starts_q[b] : starts_q[b] + lq] = o.transpose(0, 1)
    return out
