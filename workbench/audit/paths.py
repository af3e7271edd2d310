"""Adapters for every varlen attention path a PyTorch user can pick, so `workbench audit` needs no glue.

Each adapter is built the way a competent user would build the call, and its docstring says
what it decides: those choices are part of what is audited. Where a path cannot express a
feature, the adapter declares it (`lacks`) and the checks that need it are "not applicable",
with the reason. The targets:

    flex-document   torch.nn.attention.flex_attention:flex_attention
                    the packed THD batch as one (1, H, T, D) sequence with a document mask
                    built from cu_seqlens (attention-gym's recipe), compiled, shape-bucketed
    sdpa-math       torch.nn.functional:scaled_dot_product_attention, one adapter per backend
    sdpa-efficient  (sdpa_kernel(...)): a padded (B, H, S, D) batch with a boolean padding
    sdpa-flash      mask (and bottom-right causality) in attn_mask; the flash backend takes no
    sdpa-cudnn      mask, so it cannot express a padded batch: not applicable
    sdpa-nested     torch.nn.functional:scaled_dot_product_attention on nested jagged tensors
                    (torch.nested, layout=torch.jagged) built from cu_seqlens
    dmattn          flash_dmattn.flash_dmattn_triton:triton_dmattn_func and
                    flash_dmattn.flash_dmattn_flex:flex_dmattn_func (B, S, H, D) with attn_mask
    fsa-varlen      workbench.audit.paths:fsa_dense_varlen / fsa_sparse_varlen: flash-sparse-attn's
                    Triton varlen functions (THD, cu_seqlens, is_causal, softmax_scale)

    workbench audit torch.nn.attention.flex_attention:flex_attention --device cuda
    workbench audit torch.nn.functional:scaled_dot_product_attention --adapter sdpa-efficient --device cuda
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workbench.audit.adapters import AdapterRefused, _cuda_only, _first, bshd_mask, register_adapter
from workbench.layout import Fill, bshd_to_thd, pad_thd, thd_to_bshd
from workbench.upstream import import_module

CONTRACT_KEYWORDS = ("cu_seqlens_q_padded", "cu_seqlens_k_padded", "causal", "scale")


def _fill_kwargs(case) -> dict[str, Any]:
    return {"padding_fill": case.fill}


def _padded_batch(q, k, v, cu_q, cu_k, max_q, max_k, padded_q, padded_k, fill):
    """THD -> zero-or-`fill`-padded (B, S, H, D) tensors, as a user's padded batch (keeps autograd)."""
    generator = torch.Generator().manual_seed(0)

    def padded(x, cu, cu_padded, seq):
        x4, real = thd_to_bshd(x, cu, cu_padded, max(seq, 1))
        filler = Fill(fill).values(x4.shape, x4.dtype, generator).to(x4.device)
        return torch.where(real[:, :, None, None], x4, filler), real

    seq_q = max(cu_q.diff().tolist() + [1])
    seq_k = max(cu_k.diff().tolist() + [1])
    q4, real_q = padded(q, cu_q, padded_q, seq_q)
    k4, _ = padded(k, cu_k, padded_k, seq_k)
    v4, _ = padded(v, cu_k, padded_k, seq_k)
    return q4, k4, v4, real_q


def _padded_mask(cu_q, cu_k, q4, k4, causal, window_size):
    """(B, S_q, S_k) bool, True where query i of sequence b may attend key j of the padded batch
    (causality and the window bottom-right aligned, padded positions never)."""
    return bshd_mask(cu_q.diff().tolist(), cu_k.diff().tolist(), q4.shape[1], k4.shape[1], causal, q4.device, window_size)


def _back_to_thd(out4, real_q, q, cu_q, padded_q):
    flat, _, _ = bshd_to_thd(out4, real_q)
    return pad_thd(flat, cu_q, cu_q if padded_q is None else padded_q, total_rows=q.shape[0])


_GATHERED = "the adapter builds a padded (batch, seq) batch from the real rows and scatters the output back, so THD GAP/TAIL rows never reach the function"
_MASKED = "the function never receives cu_seqlens/max_seqlen: the adapter turns them into a mask"


# -- FlexAttention with a document mask -------------------------------------------------------

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
        "torch 2.11+): out is checked here; --device cuda checks dq, dk and dv too"
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

    def call(
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
        from torch.nn.attention.flex_attention import create_block_mask

        rows_q, rows_k = q.shape[0], k.shape[0]
        bucket = _bucket(max(rows_q, rows_k))
        doc_q, pos_q, len_q = _doc_ids(cu_seqlens_q, cu_seqlens_q_padded, rows_q, bucket, q.device)
        doc_k, pos_k, len_k = _doc_ids(cu_seqlens_k, cu_seqlens_k_padded, rows_k, bucket, q.device)
        # Per query row, the last key position it may see (bottom-right causal per document),
        # computed here: indexing a per-document table by doc_q inside mask_mod would read
        # table[-1] for padding rows, which wraps in eager PyTorch but is an out-of-bounds read
        # in the compiled kernel (compute-sanitizer memcheck caught exactly that in an earlier run).
        shift = (len_k - len_q)[doc_q.clamp(min=0).long()]
        limit_q = pos_q + shift
        is_causal = torch.tensor(bool(causal), device=q.device)

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
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return _first(out)[0].transpose(0, 1)[:rows_q]

    return call


# -- SDPA on padded batches, one adapter per backend ------------------------------------------

SDPA_BACKENDS = {
    "sdpa-math": "MATH",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}


def _sdpa_lacks(backend: str) -> Callable[[Callable, torch.device], dict[str, str]]:
    def lacks(fn: Callable, device: torch.device) -> dict[str, str]:
        out = {"padded": _GATHERED, "tail": _GATHERED, "metadata": _MASKED}
        if backend == "FLASH_ATTENTION":
            out["run"] = (
                "SDPA's flash backend takes no attn_mask, and a padded batch of unequal lengths needs one "
                "(sequences of equal length need no padding): not applicable"
            )
        elif backend == "CUDNN_ATTENTION" and device.type != "cuda":
            out["run"] = "SDPA's cuDNN backend runs on CUDA only"
        elif backend == "EFFICIENT_ATTENTION" and device.type != "cuda":
            out["run"] = "SDPA's memory-efficient backend has no CPU kernel"
        return out

    return lacks


def _make_sdpa(name: str, backend: str) -> None:
    @register_adapter(name, lacks=_sdpa_lacks(backend), case_kwargs=_fill_kwargs, calls=(3, ("attn_mask", "scale")))
    def wrap(fn: Callable) -> Callable:
        def call(
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
            padding_fill: Fill | str = Fill.ZEROS,
            window_size=(-1, -1),
        ):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q4, k4, v4, real_q = _padded_batch(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                cu_seqlens_q_padded,
                cu_seqlens_k_padded,
                padding_fill,
            )
            mask = _padded_mask(cu_seqlens_q, cu_seqlens_k, q4, k4, causal, window_size)
            kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    out4 = fn(
                        q4.transpose(1, 2),
                        k4.transpose(1, 2),
                        v4.transpose(1, 2),
                        attn_mask=mask[:, None],
                        scale=scale,
                        **kwargs,
                    ).transpose(1, 2)
            except RuntimeError as exc:
                if "No available kernel" in str(exc):  # the backend cannot take this call: not its bug
                    raise AdapterRefused(f"SDPA backend {backend} refused this call: {str(exc).splitlines()[0]}") from exc
                raise
            return _back_to_thd(out4, real_q, q, cu_seqlens_q, cu_seqlens_q_padded)

        return call

    wrap.__doc__ = (
        f"scaled_dot_product_attention under sdpa_kernel({backend}) on a padded batch. Decisions: q, k, v padded "
        "to (B, S, H, D) with the case's padding fill, attn_mask (B, 1, S_q, S_k) bool True where a query may attend "
        "(real keys of its own sequence; causal and the window bottom-right), padded query rows fully masked; the output's real rows "
        "are scattered back to THD (padding rows 0); enable_gqa when H_kv < H; a 'No available kernel' refusal is "
        "'not applicable', not a failure."
    )


for _name, _backend in SDPA_BACKENDS.items():
    _make_sdpa(_name, _backend)


# -- nested jagged tensors into SDPA ----------------------------------------------------------


def _nested_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    return {
        "padded": _GATHERED,
        "tail": _GATHERED,
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

    def call(
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
        from workbench.layout import real_rows

        # One offsets tensor per distinct boundary vector: NJTs sharing it share their ragged
        # dimension, as a user's q, k, v from one packed batch do (separate offsets would be
        # "broadcast" NJTs, which the fused kernels refuse).
        offsets_q = cu_seqlens_q.to(torch.int64)
        same = cu_seqlens_k is cu_seqlens_q or torch.equal(cu_seqlens_k, cu_seqlens_q)
        offsets_k = offsets_q if same else cu_seqlens_k.to(torch.int64)

        def jagged(x, cu, cu_padded, offsets):
            values = x.index_select(0, real_rows(cu, cu if cu_padded is None else cu_padded))
            return torch.nested.nested_tensor_from_jagged(values, offsets=offsets).transpose(1, 2)

        try:
            out = fn(
                jagged(q, cu_seqlens_q, cu_seqlens_q_padded, offsets_q),
                jagged(k, cu_seqlens_k, cu_seqlens_k_padded, offsets_k),
                jagged(v, cu_seqlens_k, cu_seqlens_k_padded, offsets_k),
                is_causal=bool(causal),
                scale=scale,
            )
        except RuntimeError as exc:
            if "No viable backend" in str(exc):  # e.g. is_causal on CPU: no kernel takes the call
                raise AdapterRefused(f"jagged SDPA refused this call: {str(exc).splitlines()[0]}") from exc
            raise
        flat = out.transpose(1, 2).values()
        return pad_thd(
            flat, cu_seqlens_q, cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded, total_rows=q.shape[0]
        )

    return call


# -- flash-dmattn (Triton and Flex backends): (B, S, H, D) with attn_mask ---------------------


def _dmattn_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    return {
        **_cuda_only("flash-dmattn's Triton and Flex backends", device),
        "padded": _GATHERED,
        "tail": _GATHERED,
        "metadata": _MASKED,
        "gqa": (
            "flash-dmattn's Flex backend calls flex_attention without enable_gqa: grouped K/V raise ValueError"
            if "flex" in getattr(fn, "__module__", "")
            else "flash-dmattn's Triton backend asserts k.shape == (batch, seqlen_k, nheads, d): no GQA"
        ),
    }


def _make_dmattn(name: str, zero_bias: bool) -> None:
    @register_adapter(
        name,
        lacks=_dmattn_lacks,
        detect=(lambda fn, names: {"attn_mask", "attn_bias", "is_causal", "softmax_scale"} <= names) if zero_bias else None,
        case_kwargs=_fill_kwargs,
        calls=(3, ("attn_mask", "attn_bias", "is_causal", "softmax_scale")),
        dtypes=("float16", "bfloat16"),
        head_dims=(16, 32, 64, 128),
    )
    def wrap(fn: Callable) -> Callable:
        def call(
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
            padding_fill: Fill | str = Fill.ZEROS,
            window_size=(-1, -1),
        ):
            q4, k4, v4, real_q = _padded_batch(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                cu_seqlens_q_padded,
                cu_seqlens_k_padded,
                padding_fill,
            )
            mask = _padded_mask(cu_seqlens_q, cu_seqlens_k, q4, k4, causal, window_size)
            mask = mask[:, None].expand(-1, q.shape[1], -1, -1).to(q.dtype).contiguous()
            bias = torch.zeros_like(mask) if zero_bias else None
            out4 = _first(fn(q4, k4, v4, attn_mask=mask, attn_bias=bias, is_causal=False, softmax_scale=scale))
            return _back_to_thd(out4, real_q, q, cu_seqlens_q, cu_seqlens_q_padded)

        return call

    wrap.__doc__ = (
        "flash-dmattn's triton_dmattn_func / flex_dmattn_func(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale). "
        "Decisions: q, k, v padded to (B, S, H, D) with the case's padding fill; attn_mask (B, H, S_q, S_k) in q's dtype, "
        "1 where a query may attend (real keys of its sequence; causality and the window bottom-right, inside the mask), so is_causal=False "
        "(the Triton kernel's own causal is top-left in padded coordinates, and the Flex backend turns is_causal=None into "
        "True); "
        + (
            "attn_bias explicit zeros (B, H, S_q, S_k): with attn_bias=None, 1.2.2's Triton backward returns a bias gradient "
            "for a None input and autograd raises (adapter dmattn-nobias shows it)"
            if zero_bias
            else "attn_bias=None, the signature's default"
        )
        + "; the output's real rows scattered back to THD."
    )


_make_dmattn("dmattn", zero_bias=True)
_make_dmattn("dmattn-nobias", zero_bias=False)


# -- flash-sparse-attn's Triton varlen functions ----------------------------------------------


def _fsa_module():
    """flash_sparse_attn, importable without OpenAI's triton_kernels.

    flash_sparse_attn 2.0.x imports `triton_kernels.matmul_ogs` at package import for its gated
    projection kernels; triton_kernels ships inside Triton's source tree, not on PyPI. The varlen
    attention functions never use it, so when it is missing a stub stands in (workbench.upstream)."""
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


def _fsa_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    return {
        **_cuda_only("flash-sparse-attn's Triton kernels", device),
        "padded": "flash-sparse-attn's varlen functions have no padded layout (no cu_seqlens_*_padded), so GAP rows cannot be expressed",
    }


@register_adapter(
    "fsa-varlen",
    lacks=_fsa_lacks,
    detect=lambda fn, names: (
        {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "is_causal", "softmax_scale"} <= names and "dropout_p" not in names
    ),
    aliases={"scale": "softmax_scale"},
    calls=(7, ("is_causal", "softmax_scale")),
    dtypes=("float16", "bfloat16"),
)
def _fsa_varlen(fn: Callable) -> Callable:
    """flash-sparse-attn's *_varlen_func(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, softmax_scale).

    Decisions: THD tensors passed as they are (TAIL rows included); causal is is_causal=True;
    GQA by passing fewer key/value heads (the function takes H_kv from k)."""

    def call(
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
        from workbench.audit.adapters import _refuse_padded

        _refuse_padded("flash-sparse-attn varlen", cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
        return _first(fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=causal, softmax_scale=scale))

    return call


# The audit matrix: (row name, target, adapter), every path this module wraps plus ours and torch's.
MATRIX = (
    ("ours", "kernels:varlen_attention", "ours"),
    ("torch-varlen", "torch.nn.attention.varlen:varlen_attn", "torch-varlen"),
    ("flex-document", "torch.nn.attention.flex_attention:flex_attention", "flex-document"),
    *((name, "torch.nn.functional:scaled_dot_product_attention", name) for name in SDPA_BACKENDS),
    ("sdpa-nested", "torch.nn.functional:scaled_dot_product_attention", "sdpa-nested"),
    ("dmattn-triton", "flash_dmattn.flash_dmattn_triton:triton_dmattn_func", "dmattn"),
    ("dmattn-triton-nobias", "flash_dmattn.flash_dmattn_triton:triton_dmattn_func", "dmattn-nobias"),
    ("dmattn-flex", "flash_dmattn.flash_dmattn_flex:flex_dmattn_func", "dmattn"),
    ("fsa-dense-varlen", "workbench.audit.paths:fsa_dense_varlen", "fsa-varlen"),
    ("fsa-sparse-varlen", "workbench.audit.paths:fsa_sparse_varlen", "fsa-varlen"),
)

__all__ = ["MATRIX", "SDPA_BACKENDS", "fsa_dense_varlen", "fsa_sparse_varlen"]
