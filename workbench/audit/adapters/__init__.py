"""Adapters: any varlen attention behind the padding contract's signature.

The audit drives every implementation through one call shape, `varlen_workbench.kernels.varlen.varlen_attention`'s:

    impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
         cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, causal=False, scale=None)

plus `window_size=(left, right)` for a case with a window (`Case.window`), and only then: an
adapter that takes it says so by not lacking "window". Likewise `return_lse=True`, asked by the
lse check of an adapter that takes it (not lacking "lse"), returns `(out, lse)`.

An adapter wraps a function of another shape into that one and says what the function cannot
express (no padded layout, no GQA, CUDA only...): checks that need it are "not applicable",
with the adapter's reason, instead of failing. Each is built the way a competent user would
build the call, and its docstring says what it decides: those choices are part of what is
audited.

A varlen function (THD tensors and cu_seqlens) needs no adapter of its own: its call is read off
its parameter names (`varlen`: cu_seqlens_q or cu_q, max_seqlen_q or max_q, softmax_scale or
scale, causal or is_causal, window_size, *_padded, seqused_*). Which adapter `detect` picks:

    ours            varlen_workbench.kernels.varlen.varlen_attention (its declared dtypes and head dims)
    ours-fa4        varlen_workbench.kernels.varlen.varlen_attention_fa4, the guarded FlashAttention-4 path (CUDA only; fp16/bf16, d64/d128)
    torch-varlen    torch.nn.attention.varlen.varlen_attn (CUDA only; 2.10's is_causal, 2.11's window_size)
    flash-attn      FlashAttention 2/3's flash_attn_varlen_func (CUDA only)
    fa4             FlashAttention-4's flash_attn.cute.flash_attn_varlen_func (CUDA only; seqused_* for GAP rows)
    fsa-varlen      flash-sparse-attn's varlen functions (`fsa`: fsa_dense_varlen, fsa_sparse_varlen)
    cudnn-ragged    cuDNN's ragged SDPA through our thin function (`cudnn_ragged`)
    contract        any other varlen function: a user's own, varlen_workbench.workbench.reference.reference_attention...
    te-thd          TransformerEngine-style THD: qkv_format="thd", cu_seqlens_q/kv(_padded) (`te`; TE's own
                    DotProductAttention, built per call: te_dot_product_attention, te_dot_product_attention_fp8)
    flex-document   FlexAttention with a document mask (`flex`)
    dmattn          flash-dmattn's Triton and Flex functions (`padded`)
    context-parallel  a context-parallel attention: each rank's zig-zag shards (`context_parallel`)

and never guessed (one target, several backends or choices; pass --adapter): bshd, sdpa-math,
sdpa-efficient, sdpa-flash, sdpa-cudnn, sdpa-nested, dmattn-nobias.

Registering your own takes a few lines (`REGISTER_EXAMPLE`): a function that wraps `fn` into the
contract's shape, and what it lacks (a dict, or a function of (fn, device) returning one).

Features an adapter can lack (`FEATURES`): padded, tail, gqa, causal, unequal, scale, metadata,
window, lse, backward, one-process (a context-parallel attention), context-parallel (any other), and
`run` (the function cannot run here at all, e.g. CUDA-only code on a CPU).
"""

from __future__ import annotations

from varlen_workbench.workbench.adapter_example import REGISTER_EXAMPLE

# Registration order is detection order: the library adapters before `contract`, which takes any varlen function.
from varlen_workbench.workbench.audit.adapters import context_parallel, flex, nested, te, varlen  # noqa: F401
from varlen_workbench.workbench.audit.adapters.base import (
    ADAPTERS,
    FEATURES,
    Adapted,
    Adapter,
    AdapterRefused,
    NoOutput,
    load,
    register_adapter,
)
from varlen_workbench.workbench.audit.adapters.fsa import fsa_dense_varlen, fsa_sparse_varlen
from varlen_workbench.workbench.audit.adapters.padded import SDPA_BACKENDS, bshd_mask
from varlen_workbench.workbench.audit.adapters.resolve import adapt, detect
from varlen_workbench.workbench.audit_catalog import ADAPTERS as ADAPTER_NAMES
from varlen_workbench.workbench.audit_catalog import BACKEND_ADAPTER_PREFIX, registered_as_declared

registered_as_declared("adapters", [n for n in ADAPTERS if not n.startswith(BACKEND_ADAPTER_PREFIX)], ADAPTER_NAMES)

# The audit matrix: (row name, target, adapter), every path above plus ours and torch's.
MATRIX = (
    ("ours", "varlen_workbench.kernels.varlen:varlen_attention", "ours"),
    ("ours-fa4", "varlen_workbench.kernels.varlen:varlen_attention_fa4", "ours-fa4"),
    ("torch-varlen", "torch.nn.attention.varlen:varlen_attn", "torch-varlen"),
    ("flex-document", "torch.nn.attention.flex_attention:flex_attention", "flex-document"),
    *((name, "torch.nn.functional:scaled_dot_product_attention", name) for name in SDPA_BACKENDS),
    ("sdpa-nested", "torch.nn.functional:scaled_dot_product_attention", "sdpa-nested"),
    ("dmattn-triton", "flash_dmattn.flash_dmattn_triton:triton_dmattn_func", "dmattn"),
    ("dmattn-triton-nobias", "flash_dmattn.flash_dmattn_triton:triton_dmattn_func", "dmattn-nobias"),
    ("dmattn-flex", "flash_dmattn.flash_dmattn_flex:flex_dmattn_func", "dmattn"),
    ("fsa-dense-varlen", "varlen_workbench.workbench.audit.adapters.fsa:fsa_dense_varlen", "fsa-varlen"),
    ("fsa-sparse-varlen", "varlen_workbench.workbench.audit.adapters.fsa:fsa_sparse_varlen", "fsa-varlen"),
    ("fa4", "flash_attn.cute:flash_attn_varlen_func", "fa4"),
    ("cudnn-ragged", "varlen_workbench.workbench.audit.adapters.cudnn_ragged:cudnn_ragged_attention", "cudnn-ragged"),
    ("te", "varlen_workbench.workbench.audit.adapters.te:te_dot_product_attention", "te-thd"),
    ("te-fp8", "varlen_workbench.workbench.audit.adapters.te:te_dot_product_attention_fp8", "te-thd"),
)

__all__ = [
    "ADAPTERS",
    "FEATURES",
    "MATRIX",
    "REGISTER_EXAMPLE",
    "SDPA_BACKENDS",
    "Adapted",
    "Adapter",
    "AdapterRefused",
    "NoOutput",
    "adapt",
    "bshd_mask",
    "detect",
    "fsa_dense_varlen",
    "fsa_sparse_varlen",
    "load",
    "register_adapter",
]
