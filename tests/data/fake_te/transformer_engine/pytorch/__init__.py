"""The stand-in's transformer_engine.pytorch: DotProductAttention, Linear, autocast, fp8_autocast, get_cudnn_version.

Tensor and sequence parallelism as TE 2.20.2 does them (module/linear.py, distributed.py): a
column-parallel Linear keeps out_features / tp_size rows of the weight and, with
sequence_parallel, all-gathers its input along the first dimension into world x the local rows
(`gather_along_first_dim`: sized from the local tensor, never from cu_seqlens, which Linear is not
given); a row-parallel Linear keeps in_features / tp_size columns and reduce-scatters its output
along the first dimension. Both through torch.distributed, so gloo runs them on the CPU.

Planted, for the tests of the runner (postmortems/te_thd_2892/seqpar_te.py), by environment:
FAKE_TE_SP_GATHER_ROWS=n makes the column-parallel gather return n rows (the report's claim: a
gather of cu_seqlens_q[-1] rows); FAKE_TE_HANG=1 makes Linear's forward sleep (a hang).
"""

import contextlib
import logging
import os
import signal
import time
import warnings

import torch
import torch.distributed as dist

from transformer_engine.common.recipe import Float8BlockScaling
from varlen_workbench.workbench.reference import reference_attention

_active = []  # the recipes of the autocast contexts entered, innermost last
_amax_groups = []  # their amax_reduction_group, alike
_log = logging.getLogger("DotProductAttention")
if os.environ.get("NVTE_DEBUG") == "1" and os.environ.get("NVTE_DEBUG_LEVEL") == "2":
    _log.setLevel(logging.DEBUG)
    _log.addHandler(logging.StreamHandler())


@contextlib.contextmanager
def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
    _active.append(recipe if enabled else None)
    _amax_groups.append(amax_reduction_group)
    try:
        yield
    finally:
        _active.pop()
        _amax_groups.pop()


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
        tp_size=1,
        tp_group=None,
        **unused,
    ):
        super().__init__()
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        assert num_attention_heads % groups == 0, "The number of attention heads must be divisible by the number of GQA groups!"
        # As TE: the heads given are the whole model's; this rank computes heads / tp_size of them.
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else tp_size
        self.heads, self.channels, self.groups = num_attention_heads // tp_size, kv_channels, groups // tp_size
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


def _fp8(x, recipe):
    """x through FP8 E4M3 and back: one scale for the whole tensor (delayed and current scaling),
    its amax reduced over the autocast's amax_reduction_group as TE reduces it, or one per 1x128
    block of a row (block scaling), as TE's recipes scale activations."""
    # Scales are constants to autograd, as in TE's backward: amax detached.
    if isinstance(recipe, Float8BlockScaling):
        blocks = x.float().reshape(x.shape[0], -1, 128)
        amax = blocks.detach().abs().amax(-1, keepdim=True).clamp_min(1e-12)
        return ((blocks * (448 / amax)).to(torch.float8_e4m3fn).float() * (amax / 448)).reshape(x.shape).to(x.dtype)
    amax = x.detach().float().abs().max().clamp_min(1e-12)
    group = _amax_groups[-1] if _amax_groups else None
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return ((x.float() * (448 / amax)).to(torch.float8_e4m3fn).float() * (amax / 448)).to(x.dtype)


def _gather(local, group):
    out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, local.contiguous(), group=group)
    return out


def _reduce_scatter(full, group):
    world = dist.get_world_size(group)
    assert full.shape[0] % world == 0, "First dimension of the tensor should be divisible by tensor parallel size"
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, full.contiguous(), group=group)
    return out


class _FirstDim(torch.autograd.Function):
    """Along the first dimension: an all-gather (TE's column-parallel SP input) whose backward
    reduce-scatters, or a reduce-scatter (its row-parallel SP output) whose backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group, gather):
        ctx.group, ctx.gather = group, gather
        return _gather(x, group) if gather else _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter(grad, ctx.group) if ctx.gather else _gather(grad, ctx.group)), None, None


class Linear(torch.nn.Module):
    """y = x W^T, the input (and weight) through FP8 when an autocast recipe is active; column- or
    row-parallel over tp_group as TE's (see the module docstring)."""

    def __init__(
        self,
        in_features,
        out_features,
        sequence_parallel=False,
        tp_group=None,
        tp_size=1,
        bias=True,
        params_dtype=None,
        parallel_mode=None,
        device=None,
        **unused,
    ):
        super().__init__()
        assert not bias, "the stand-in's Linear has no bias"
        assert parallel_mode in (None, "column", "row"), f"parallel_mode {parallel_mode} not supported"
        self.tp_group, self.parallel_mode = tp_group, parallel_mode
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else tp_size
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        assert self.tp_size == 1 or self.sequence_parallel, "the stand-in's tensor parallelism is sequence-parallel only"
        if parallel_mode == "column":
            out_features //= self.tp_size
        elif parallel_mode == "row":
            in_features //= self.tp_size
        weight = torch.randn(out_features, in_features, device=device) / in_features**0.5
        self.weight = torch.nn.Parameter(weight.to(params_dtype or torch.float32))

    def forward(self, inp):
        if os.environ.get("FAKE_TE_HANG") == "1":
            time.sleep(3600)  # planted: a hang
        if self.sequence_parallel and self.parallel_mode == "column":
            inp = _FirstDim.apply(inp, self.tp_group, True)
            planted = os.environ.get("FAKE_TE_SP_GATHER_ROWS")
            if planted:
                inp = inp[: int(planted)]  # planted: the report's gather of cu_seqlens_q[-1] rows
        recipe = _active[-1] if _active else None
        out = inp @ self.weight.T if recipe is None else _fp8(inp, recipe) @ _fp8(self.weight, recipe).T
        if self.sequence_parallel and self.parallel_mode == "row":
            out = _FirstDim.apply(out, self.tp_group, False)
        return out
