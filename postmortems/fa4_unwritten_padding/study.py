"""The study of fa4-unwritten-padding: the H200 records, and the mechanism and workaround on the CPU replica.

FA4 runs on sm90/sm100 GPUs only. On the CPU the replica of torch's varlen_attn
(`kernels/replicas/torch_varlen.py`) stands in for it: the same mechanism (out, dq, dk, dv from
torch.empty; only rows inside a sequence are written), given FA4's call shape here, `seqused`
included: TAIL rows and GAP rows (past seqused inside a slot) both come back unwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from varlen_workbench.kernels.replicas.torch_varlen import replica_varlen_attn
from varlen_workbench.postmortems.fa4_unwritten_padding.cases import AUDIT, CASES, REAL_CLIENT, TAIL, TAIL_NAN
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.postmortem import Results
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import read_record


def replica_flash_attn_varlen_func(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
    seqused_k=None, softmax_scale=None, causal=False, window_size=(None, None), return_lse=False,
):  # fmt: skip
    """FA4's `flash_attn_varlen_func` call shape (qv fourth: call it with keywords, as FA4) over the
    replica: sequence i's slot starts at cu_seqlens[i] and uses its first seqused[i] rows (all of
    them without seqused); grouped K/V as FA4 takes them; window_size (left, right), None unbounded.
    Returns (out, lse), lse (H, T_q) where asked for, else None."""
    if qv is not None:
        raise ValueError("the replica takes no qv (FA4's MLA-absorbed query): pass q, k, v only.")
    if (seqused_q is None) != (seqused_k is None):  # FA4 takes one alone; the replica reads both sides or neither
        rows = [(cu_seqlens_q, seqused_q), (cu_seqlens_k, seqused_k)]
        seqused_q, seqused_k = (cu.diff() if used is None else used for cu, used in rows)
    window = tuple(-1 if side is None else side for side in window_size)
    out, lse = replica_varlen_attn(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale=softmax_scale, window_size=window,
        enable_gqa=True, return_lse=True, seqused_q=seqused_q, seqused_k=seqused_k,
    )  # fmt: skip
    return out, (lse if return_lse else None)


def real_rows(cu_seqlens: torch.Tensor, rows: int, seqused: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, 1, 1) bool, True on REAL rows of FA4's layout: sequence i starts at cu_seqlens[i] and
    uses seqused[i] rows (default: its whole slot). On the device, no host sync."""
    row = torch.arange(rows, device=cu_seqlens.device)
    seq = (torch.searchsorted(cu_seqlens, row, right=True) - 1).clamp(max=cu_seqlens.numel() - 2)
    used = cu_seqlens.diff() if seqused is None else seqused
    return ((row - cu_seqlens[seq] < used[seq]) & (row < cu_seqlens[-1]))[:, None, None]


def with_padding_zeroed(attn):
    """`attn` (FA4's call shape) with the workaround: padding rows of q, k, v replaced by 0 before the
    call (finite K/V rows: no 0 x NaN; torch.where's backward gives them exactly 0 gradient) and of
    out after it."""

    def call(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None, **kwargs):
        keep_q, keep_k = real_rows(cu_seqlens_q, q.shape[0], seqused_q), real_rows(cu_seqlens_k, k.shape[0], seqused_k)
        q, k, v = torch.where(keep_q, q, 0), torch.where(keep_k, k, 0), torch.where(keep_k, v, 0)
        out, lse = attn(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k, **kwargs,
        )  # fmt: skip
        return torch.where(keep_q, out, 0), lse

    return call


def contract(attn):
    """An FA4-shaped function behind the contract's signature, for `probe`: FA4's layout takes the
    padded starts as cu_seqlens and the real lengths as seqused (given only where they differ)."""

    def call(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, causal=False, scale=None):
        starts_q = cu_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
        starts_k = cu_k if cu_seqlens_k_padded is None else cu_seqlens_k_padded
        used_q = None if torch.equal(starts_q, cu_q) else cu_q.diff()
        used_k = None if torch.equal(starts_k, cu_k) else cu_k.diff()
        out, _ = attn(
            q, k, v, cu_seqlens_q=starts_q, cu_seqlens_k=starts_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            seqused_q=used_q, seqused_k=used_k, softmax_scale=scale, causal=causal,
        )  # fmt: skip
        return out

    return call


@dataclass
class Fa4PaddingResults(Results):
    """The H200 audit and real-client records, and the replica probes (bare and with the workaround)."""

    audit: dict[str, Any]
    real_client: dict[str, Any]
    replica: dict[Case, Any]
    workaround: dict[Case, Any]


def gpu_record(name: str) -> dict[str, Any]:
    """One committed H200 record under data/gpu, with its file name."""
    return {**read_record(GPU_DATA / name), "file": name}


def reproduce(device=None) -> Fa4PaddingResults:
    bare = contract(replica_flash_attn_varlen_func)
    fixed = contract(with_padding_zeroed(replica_flash_attn_varlen_func))
    return Fa4PaddingResults(
        audit=gpu_record(AUDIT),
        real_client=gpu_record(REAL_CLIENT),
        replica={c: probe(bare, pack(c, device), name="replica", poisoned=True) for c in (TAIL,)},
        workaround={c: probe(fixed, pack(c, device), name="replica + workaround", poisoned=True) for c in CASES},
    )


__all__ = [
    "CASES",
    "Fa4PaddingResults",
    "TAIL_NAN",
    "contract",
    "gpu_record",
    "real_rows",
    "replica_flash_attn_varlen_func",
    "reproduce",
    "with_padding_zeroed",
]
