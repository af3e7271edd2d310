"""TransformerEngine's THD calls: the `te-thd` adapter, and DotProductAttention itself for the audit matrix.

The adapter calls any function with `DotProductAttention(...)(q, k, v, qkv_format="thd", ...)`'s
keywords. TE names the key side `_kv` (cu_seqlens_kv, max_seqlen_kv) and says causality with a
mask type, so its call is spelled out here rather than inferred.

TE's `DotProductAttention` is a module configured at construction (heads, kv_channels, GQA groups,
mask type, softmax scale), where the audit hands over tensors call by call. So the matrix audits
two functions with the forward's keywords that build the module from each call's tensors
(`dot_product_attention`) and run it once:

    te_dot_product_attention        in the inputs' dtype (TE's fused cuDNN path for FP16/BF16)
    te_dot_product_attention_fp8    under te.autocast(recipe=DelayedScaling(fp8_dpa=True)): FP8
                                    attention, the recipe TE's fused FP8 attention takes on Hopper
                                    (Float8CurrentScaling's needs sm100; Float8BlockScaling refuses
                                    fp8_dpa)

A fresh module per call keeps calls independent: DelayedScaling scales each call by the amax
history of the module's earlier calls, so a module reused across the audit's calls would answer
the same call differently later on. TE itself is imported at the first call; it needs CUDA and
TE 2.20's wheels with its PyTorch extension built (scripts/te_pack.sh, scripts/te_install.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from varlen_workbench.workbench.audit.adapters.base import (
    AdapterRefused,
    ContractCall,
    contract_shaped,
    cuda_only,
    first,
    params,
    register_adapter,
)
from varlen_workbench.workbench.upstream import import_module

TE_INSTALL = "TransformerEngine 2.20 with its PyTorch extension: scripts/te_pack.sh here, scripts/te_install.py on the GPU"


def _te():
    return import_module("transformer_engine.pytorch", install=TE_INSTALL)


def _recipes():
    return import_module("transformer_engine.common.recipe", install=TE_INSTALL)


def dot_product_attention(query: torch.Tensor, key: torch.Tensor, *, attn_mask_type: str, softmax_scale: float | None = None):
    """`DotProductAttention` for THD tensors shaped like `query` (T, H, D) and `key` (T, H_kv, D):
    H heads of D channels, H_kv GQA groups, THD format, this mask type and scale (None: 1/sqrt(D))."""
    return _te().DotProductAttention(
        num_attention_heads=query.shape[1],
        kv_channels=query.shape[2],
        num_gqa_groups=key.shape[1],
        qkv_format="thd",
        attn_mask_type=attn_mask_type,
        softmax_scale=softmax_scale,
    )


def fp8_delayed_recipe():
    """FP8 attention on Hopper: delayed scaling with fp8_dpa (the GEMMs' recipe, extended to attention)."""
    return _recipes().DelayedScaling(fp8_dpa=True)


def te_dot_product_attention(
    query_layer,
    key_layer,
    value_layer,
    *,
    qkv_format="thd",
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    cu_seqlens_q_padded=None,
    cu_seqlens_kv_padded=None,
    max_seqlen_q=None,
    max_seqlen_kv=None,
    attn_mask_type="padding",
    softmax_scale=None,
):
    """TransformerEngine's DotProductAttention, built for this call and run in the inputs' dtype."""
    module = dot_product_attention(query_layer, key_layer, attn_mask_type=attn_mask_type, softmax_scale=softmax_scale)
    return module(
        query_layer,
        key_layer,
        value_layer,
        qkv_format=qkv_format,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        attn_mask_type=attn_mask_type,
    )


def with_recipe(recipe, fn: Callable = te_dot_product_attention) -> Callable:
    """`fn` (te_dot_product_attention's call) run under `te.autocast(enabled=True, recipe=recipe)`;
    with recipe None, `fn` itself."""
    if recipe is None:
        return fn

    @functools.wraps(fn)
    def under_recipe(query_layer, key_layer, value_layer, **keywords):
        with _te().autocast(enabled=True, recipe=recipe):
            return fn(query_layer, key_layer, value_layer, **keywords)

    return under_recipe


def te_dot_product_attention_fp8(query_layer, key_layer, value_layer, **keywords):
    """TransformerEngine's DotProductAttention, built for this call and run in FP8 (`fp8_delayed_recipe`)."""
    return with_recipe(fp8_delayed_recipe())(query_layer, key_layer, value_layer, **keywords)


# The same call as te_dot_product_attention: what the adapter reads (softmax_scale among them).
te_dot_product_attention_fp8.__signature__ = inspect.signature(te_dot_product_attention)  # type: ignore[attr-defined]

TE_FUNCTIONS = (te_dot_product_attention, te_dot_product_attention_fp8)


def _te_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    lacks = {"window": "the te-thd adapter does not map windows onto TransformerEngine's window_size and mask types"}
    if fn in TE_FUNCTIONS:
        lacks |= cuda_only("TransformerEngine", device)
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
