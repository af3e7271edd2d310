"""A correct varlen attention in plain PyTorch, written as a user would: the audit's fairness witness.

Per-document SDPA over `cu_seqlens` (and the padded layout when given), padding rows zero,
bottom-right causal, and no validation at all: the workbench's one per-document reference,
`varlen_workbench.workbench.reference.per_document_sdpa`, under the signature a user's function
has. It passes every correctness check of the audit, and its missing validation shows as its
own grade, never as a FAIL (tests/test_audit_fairness.py, notebooks/audit-matrix.ipynb); tests
plant faults around it (tests/test_audit_isolate.py).
"""

from __future__ import annotations

from varlen_workbench.workbench.reference import per_document_sdpa


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
    """Per-document SDPA over cu_seqlens, padding rows zero, bottom-right causal; validates nothing."""
    return per_document_sdpa(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_k_padded=cu_seqlens_k_padded,
        causal=causal,
        scale=scale,
    )
