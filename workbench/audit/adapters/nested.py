"""SDPA on nested jagged tensors (torch.nested, layout=torch.jagged) built from cu_seqlens.

sdpa-nested     torch.nn.functional:scaled_dot_product_attention, one NJT per q, k, v
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from varlen_workbench.workbench.audit.adapters.base import AdapterRefused, ContractCall, contract_shaped, register_adapter
from varlen_workbench.workbench.audit.adapters.padded import GATHERED
from varlen_workbench.workbench.layout import pad_thd


def _nested_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    return {
        "padded": GATHERED,
        "tail": GATHERED,
        "metadata": "the function receives nested tensors built from cu_seqlens, never cu_seqlens itself",
        "unequal": "SDPA's is_causal is top-left aligned and jagged SDPA takes no attn_mask, so the contract's "
        "bottom-right causal attention with len_q != len_k cannot be expressed",
        "gqa": "jagged SDPA has no GQA: with H_kv < H it raises 'batch dimensions must have the same sizes' (torch 2.13)",
    }


@register_adapter("sdpa-nested", lacks=_nested_lacks, calls=(3, ("is_causal", "scale")))
def _sdpa_nested(fn: Callable) -> Callable:
    """scaled_dot_product_attention on nested jagged tensors (torch.nested, layout=torch.jagged).

    Decisions: the real rows of q, k, v are gathered and wrapped with
    torch.nested.nested_tensor_from_jagged(values, offsets=cu_seqlens) (B, j, H, D), transposed to
    (B, H, j, D), q, k and v sharing one offsets tensor when their boundaries agree; causal is
    is_causal=True (equal lengths only: see lacks); "No viable backend" is a refusal (n/a); the
    output's values are scattered back to THD (padding rows 0)."""

    def body(c: ContractCall):
        from varlen_workbench.workbench.layout import real_rows

        # One offsets tensor per distinct boundary vector: NJTs sharing it share their ragged
        # dimension, as a user's q, k, v from one packed batch do (separate offsets would be
        # "broadcast" NJTs, which the fused kernels refuse).
        offsets_q = c.cu_seqlens_q.to(torch.int64)
        same = c.cu_seqlens_k is c.cu_seqlens_q or torch.equal(c.cu_seqlens_k, c.cu_seqlens_q)
        offsets_k = offsets_q if same else c.cu_seqlens_k.to(torch.int64)

        def jagged(x, cu, cu_padded, offsets):
            values = x.index_select(0, real_rows(cu, cu if cu_padded is None else cu_padded))
            return torch.nested.nested_tensor_from_jagged(values, offsets=offsets).transpose(1, 2)

        try:
            out = fn(
                jagged(c.q, c.cu_seqlens_q, c.cu_seqlens_q_padded, offsets_q),
                jagged(c.k, c.cu_seqlens_k, c.cu_seqlens_k_padded, offsets_k),
                jagged(c.v, c.cu_seqlens_k, c.cu_seqlens_k_padded, offsets_k),
                is_causal=bool(c.causal),
                scale=c.scale,
            )
        except RuntimeError as exc:
            if "No viable backend" in str(exc):  # e.g. is_causal on CPU: no kernel takes the call
                raise AdapterRefused(f"jagged SDPA refused this call: {str(exc).splitlines()[0]}") from exc
            raise
        flat = out.transpose(1, 2).values()
        padded = c.cu_seqlens_q if c.cu_seqlens_q_padded is None else c.cu_seqlens_q_padded
        return pad_thd(flat, c.cu_seqlens_q, padded, total_rows=c.q.shape[0])

    return contract_shaped(body)
