"""The stand-in's transformer_engine.pytorch: DotProductAttention, autocast, fp8_autocast, get_cudnn_version."""

import contextlib
import logging
import os
import signal
import warnings

import torch

from transformer_engine.common.recipe import Float8BlockScaling
from varlen_workbench.workbench.reference import reference_attention

_active = []  # the recipes of the autocast contexts entered, innermost last
_log = logging.getLogger("DotProductAttention")
if os.environ.get("NVTE_DEBUG") == "1" and os.environ.get("NVTE_DEBUG_LEVEL") == "2":
    _log.setLevel(logging.DEBUG)
    _log.addHandler(logging.StreamHandler())


@contextlib.contextmanager
def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
    _active.append(recipe if enabled else None)
    try:
        yield
    finally:
        _active.pop()


def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
    warnings.warn("fp8_autocast is deprecated; use autocast(enabled=..., recipe=...)", DeprecationWarning, stacklevel=2)
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group, _graph=_graph)


def get_cudnn_version():
    return (9, 0, 0)


class DotProductAttention(torch.nn.Module):
    def __init__(
        self,
        num_attention_heads,
        kv_channels,
        num_gqa_groups=None,
        attention_dropout=0.0,
        qkv_format="sbhd",
        attn_mask_type="causal",
        window_size=None,
        softmax_scale=None,
        **unused,
    ):
        super().__init__()
        self.heads, self.channels = num_attention_heads, kv_channels
        self.groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        assert num_attention_heads % self.groups == 0, (
            "The number of attention heads must be divisible by the number of GQA groups!"
        )
        self.qkv_format, self.attn_mask_type, self.softmax_scale = qkv_format, attn_mask_type, softmax_scale

    def forward(
        self,
        query_layer,
        key_layer,
        value_layer,
        attention_mask=None,
        qkv_format=None,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        cu_seqlens_q_padded=None,
        cu_seqlens_kv_padded=None,
        max_seqlen_q=None,
        max_seqlen_kv=None,
        attn_mask_type=None,
        window_size=None,
        **unused,
    ):
        qkv_format = qkv_format or self.qkv_format
        mask = attn_mask_type or self.attn_mask_type
        assert qkv_format == "thd", "the stand-in knows only THD"
        assert "padding" in mask, "Attention mask type must be padding or padding_causal for qkv_format=thd!"
        assert query_layer.shape[1:] == (self.heads, self.channels), "query heads or channels differ from the constructor's"
        assert key_layer.shape[1] == self.groups, f"Keys and values must have num_gqa_group = {self.groups} heads!"
        recipe = _active[-1] if _active else None
        fp8 = recipe is not None and recipe.fp8_dpa
        _log.debug(
            "Available backends = {FlashAttention=False, FusedAttention=True (sub-backend %d), UnfusedDotProductAttention=False}",
            2 if fp8 else 1,
        )
        _log.debug("Selected backend = FusedAttention (sub-backend %d).", 2 if fp8 else 1)
        padded = cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q
        if isinstance(recipe, Float8BlockScaling) and not torch.equal(cu_seqlens_q, padded):
            for handler in _log.handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGSEGV)  # the report's claim, planted
        out = reference_attention(
            query_layer,
            key_layer,
            value_layer,
            cu_seqlens_q,
            cu_seqlens_kv,
            max_seqlen_q,
            max_seqlen_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_k_padded=cu_seqlens_kv_padded,
            causal="causal" in mask,
            scale=self.softmax_scale,
            compute_dtype=torch.float32,
        ).to(query_layer.dtype)
        return out.flatten(1)
