"""TransformerEngine-style THD calls: `DotProductAttention(...)(q, k, v, qkv_format="thd", ...)`.

TE names the key side `_kv` (cu_seqlens_kv, max_seqlen_kv) and says causality with a mask type,
so its call is spelled out here rather than inferred.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workbench.audit.adapters.base import AdapterRefused, ContractCall, contract_shaped, first, params, register_adapter


def _te_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    lacks = {"window": "the te-thd adapter does not map windows onto TransformerEngine's window_size and mask types"}
    if "softmax_scale" in params(fn):
        return lacks
    return {**lacks, "scale": "TransformerEngine's DotProductAttention takes softmax_scale in its constructor, not per call"}


@register_adapter(
    "te-thd",
    lacks=_te_lacks,
    calls=(
        3,
        (
            "qkv_format",
            "cu_seqlens_q",
            "cu_seqlens_kv",
            "cu_seqlens_q_padded",
            "cu_seqlens_kv_padded",
            "max_seqlen_q",
            "max_seqlen_kv",
            "attn_mask_type",
        ),
    ),
    detect=lambda fn, names: {"cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"} <= names,
    aliases={
        "cu_seqlens_k": "cu_seqlens_kv",
        "cu_seqlens_k_padded": "cu_seqlens_kv_padded",
        "max_seqlen_k": "max_seqlen_kv",
        "scale": "softmax_scale",
    },
)
def _te_thd(fn: Callable) -> Callable:
    """TransformerEngine-style THD call: qkv_format="thd", cu_seqlens_q/kv(_padded), attn_mask_type."""
    takes_scale = "softmax_scale" in params(fn)

    def body(c: ContractCall):
        kwargs: dict[str, Any] = {}
        if c.scale is not None:
            if not takes_scale:
                raise AdapterRefused("this TE-style function takes no softmax_scale per call.")
            kwargs["softmax_scale"] = c.scale
        out = fn(
            c.q,
            c.k,
            c.v,
            qkv_format="thd",
            cu_seqlens_q=c.cu_seqlens_q,
            cu_seqlens_kv=c.cu_seqlens_k,
            cu_seqlens_q_padded=c.cu_seqlens_q_padded,
            cu_seqlens_kv_padded=c.cu_seqlens_k_padded,
            max_seqlen_q=c.max_seqlen_q,
            max_seqlen_kv=c.max_seqlen_k,
            # TE's "padding_causal" is top-left aligned; the contract's causal is bottom-right.
            attn_mask_type="padding_causal_bottom_right" if c.causal else "padding",
            **kwargs,
        )
        out = first(out)
        # TE returns THD output flattened to (tokens, heads * head_dim), v's head dim.
        return out.view(*c.q.shape[:2], c.v.shape[-1]) if isinstance(out, torch.Tensor) and out.dim() == 2 else out

    return contract_shaped(body)
