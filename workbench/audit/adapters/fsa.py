"""flash-sparse-attn's Triton varlen functions, importable by name for `varlen-workbench audit`.

    varlen-workbench audit varlen_workbench.workbench.audit.adapters.fsa:fsa_dense_varlen --device cuda

Each forwards to the library's function of the same signature, imported with the stub for its
undeclared triton_kernels import (varlen_workbench.workbench.upstream); the `fsa-varlen` adapter calls them by
parameter name.
"""

from __future__ import annotations

from varlen_workbench.workbench.upstream import import_module


def _fsa_module():
    """flash_sparse_attn, importable without OpenAI's triton_kernels.

    flash_sparse_attn 2.0.x imports `triton_kernels.matmul_ogs` at package import for its gated
    projection kernels; triton_kernels ships inside Triton's source tree, not on PyPI. The varlen
    attention functions never use it, so when it is missing a stub stands in (varlen_workbench.workbench.upstream)."""
    return import_module("flash_sparse_attn", stub={"triton_kernels": "flash_sparse_attn"})


def fsa_dense_varlen(
    query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False, softmax_scale=None
):
    """flash_sparse_attn.flash_dense_attn_varlen_func, imported through `_fsa_module`."""
    return _fsa_module().flash_dense_attn_varlen_func(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        is_causal=is_causal,
        softmax_scale=softmax_scale,
    )


def fsa_sparse_varlen(
    query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False, softmax_scale=None
):
    """flash_sparse_attn.flash_sparse_attn_varlen_func (softmax_threshold None), through `_fsa_module`."""
    return _fsa_module().flash_sparse_attn_varlen_func(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        is_causal=is_causal,
        softmax_scale=softmax_scale,
    )
