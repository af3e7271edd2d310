"""FlexAttention with a document mask: the packed THD batch as one sequence (attention-gym's recipe).

flex-document   torch.nn.attention.flex_attention:flex_attention, a (1, H, T, D) sequence with
                a document mask built from cu_seqlens, compiled on CUDA, shape-bucketed

varlen-workbench audit torch.nn.attention.flex_attention:flex_attention --device cuda
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from varlen_workbench.workbench.audit.adapters.base import ContractCall, contract_shaped, first, register_adapter
from varlen_workbench.workbench.audit.spelling import option

_COMPILED: dict[Callable, Callable] = {}


def _bucket(n: int) -> int:
    """Next power of two >= n, at least 128 (FlexAttention's block size)."""
    return max(128, 1 << max(n - 1, 0).bit_length())


def _doc_ids(cu: torch.Tensor, cu_padded: torch.Tensor | None, rows: int, bucket: int, device) -> tuple[torch.Tensor, ...]:
    """Per row of the bucket: document index (-1 for GAP/TAIL/bucket rows), position within it,
    and the document's real length."""
    starts = (cu if cu_padded is None else cu_padded).tolist()
    lengths = cu.diff().tolist()
    doc = torch.full((bucket,), -1, dtype=torch.int32)
    pos = torch.zeros(bucket, dtype=torch.int32)
    for i, (start, n) in enumerate(zip(starts, lengths)):
        doc[start : start + n] = i
        pos[start : start + n] = torch.arange(n, dtype=torch.int32)
    return doc.to(device), pos.to(device), torch.tensor(lengths + [0], dtype=torch.int32, device=device)


def _flex_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    if device.type == "cuda":
        return {}
    return {
        "backward": "FlexAttention has no backward on CPU ('FlexAttention does not support backward on CPU', "
        f"torch 2.11+): out is checked here; {option('device', 'cuda')} checks dq, dk and dv too"
    }


def _compiled(fn: Callable) -> Callable:
    if fn not in _COMPILED:
        import torch._dynamo

        # Every (head_dim, dtype, GQA) is one compilation; keep them all rather than falling back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


@register_adapter(
    "flex-document",
    lacks=_flex_lacks,
    detect=lambda fn, names: getattr(fn, "__name__", "") == "flex_attention" and "block_mask" in names,
    calls=(3, ("block_mask", "scale", "enable_gqa")),
)
def _flex_document(fn: Callable) -> Callable:
    """flex_attention with a document mask from cu_seqlens, compiled once with dynamic shapes.

    Decisions: the packed batch is one (1, H, T, D) sequence; a row's document is where
    cu_seqlens(_padded) puts it, GAP/TAIL rows belong to no document (fully masked: FlexAttention
    writes 0 there); causal is bottom-right per document (k_pos <= q_pos + len_k - len_q);
    T is padded with zero rows to a power-of-two bucket (>= 128) so compiled kernels and block
    masks are reused; padding rows are passed as given (not zeroed); enable_gqa when H_kv < H."""

    def body(c: ContractCall):
        from torch.nn.attention.flex_attention import create_block_mask

        q, k, v = c.q, c.k, c.v
        rows_q, rows_k = q.shape[0], k.shape[0]
        bucket = _bucket(max(rows_q, rows_k))
        doc_q, pos_q, len_q = _doc_ids(c.cu_seqlens_q, c.cu_seqlens_q_padded, rows_q, bucket, q.device)
        doc_k, pos_k, len_k = _doc_ids(c.cu_seqlens_k, c.cu_seqlens_k_padded, rows_k, bucket, q.device)
        # Per query row, the last key position it may see (bottom-right causal per document),
        # computed here: indexing a per-document table by doc_q inside mask_mod would read
        # table[-1] for padding rows, which wraps in eager PyTorch but is an out-of-bounds read
        # in the compiled kernel (compute-sanitizer memcheck caught exactly that in an earlier run).
        shift = (len_k - len_q)[doc_q.clamp(min=0).long()]
        limit_q = pos_q + shift
        is_causal = torch.tensor(bool(c.causal), device=q.device)

        def mask_mod(b, h, qi, ki):
            same = (doc_q[qi] == doc_k[ki]) & (doc_q[qi] >= 0)
            return same & (~is_causal | (pos_k[ki] <= limit_q[qi]))

        block_mask = create_block_mask(mask_mod, None, None, bucket, bucket, device=q.device)

        def to_flex(x, rows):
            return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, bucket - rows)).transpose(0, 1).unsqueeze(0)

        run = _compiled(fn) if q.device.type == "cuda" else fn
        out = run(
            to_flex(q, rows_q),
            to_flex(k, rows_k),
            to_flex(v, rows_k),
            block_mask=block_mask,
            scale=c.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return first(out)[0].transpose(0, 1)[:rows_q]

    return contract_shaped(body)
