"""`varlen_attention`: the public entry point, a `torch.library` custom op with autograd.

Forward and backward are two custom ops (`workbench::varlen_attention_fwd` / `_bwd`), so
autograd, `torch.compile` (fake tensors give the output shapes without running Triton) and
dispatch modes (which see one op per call) all treat the kernel as one opaque operation.
"""

import torch

from kernels._compat import check_kernel_device
from kernels.contract import (
    check_cu_seqlens_tensors,
    check_scale,
    check_varlen_inputs,
    check_varlen_tensors,
)
from kernels.varlen.launch import attention_backward, attention_forward, work_lists_shape

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)


@torch.library.custom_op("workbench::varlen_attention_fwd", mutates_args=())
def _forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor,
    cu_seqlens_k_padded: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded, causal, scale)


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded, causal, scale):
    total_q, heads, _ = q.shape
    work = q.new_empty(work_lists_shape(cu_seqlens_q.shape[0] - 1), dtype=torch.int32)
    return q.new_empty(q.shape), q.new_empty((heads, total_q), dtype=torch.float32), work


@torch.library.custom_op("workbench::varlen_attention_bwd", mutates_args=())
def _backward_op(
    d_out: torch.Tensor,
    d_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    work: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor,
    cu_seqlens_k_padded: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_backward(
        d_out,
        d_lse,
        q,
        k,
        v,
        out,
        lse,
        work,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q_padded,
        cu_seqlens_k_padded,
        causal,
        scale,
    )


@_backward_op.register_fake
def _backward_fake(d_out, d_lse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *cu_seqlens, causal, scale = inputs
    out, lse, work = output
    ctx.mark_non_differentiable(work)
    # An unused output's gradient stays None: no zeros to allocate, and lse's is skipped in-kernel.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, work, *cu_seqlens)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, d_out, d_lse, _d_work):
    # d_lse is None unless the caller used lse (return_lse=True); it enters as dS += P * d_lse.
    q, k, v, out, lse, work, *cu_seqlens = ctx.saved_tensors
    if d_out is None:  # only lse was used
        d_out = torch.zeros_like(out)
    dq, dk, dv = _backward_op(d_out, d_lse, q, k, v, out, lse, work, *cu_seqlens, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences, keeping the padding contract (DESIGN.md).

    q (T_q, H, D), k and v (T_k, H_kv, D) with H % H_kv == 0; D in 16, 32, 64, 128, 256;
    float32, float16 or bfloat16. Sequence i's real queries are rows
    [cu_seqlens_q_padded[i], cu_seqlens_q_padded[i] + len_i) (padded defaults to cu_seqlens_q);
    all other rows are padding, and padding never influences a real row.

    Returns out (T_q, H, D) in q's dtype, exactly 0 on padding rows and on rows with no visible
    key; with `return_lse`, also lse (H, T_q) float32 (flash-attn's varlen layout), -inf on
    those rows. Gradients of q, k, v are exactly 0 on padding rows. Causal masking is
    bottom-right aligned: query i of a sequence sees key j iff j <= i + len_k - len_q.

    `validate=True` checks the metadata on the host (a device sync); `validate=False` keeps
    only sync-free checks, for CUDA graphs and `torch.compile(fullgraph=True)`. `max_seqlen_*`
    are only validated: the grid is bounded by the row counts, so no value goes unprocessed.
    """
    if validate:
        check_varlen_inputs(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_k_padded=cu_seqlens_k_padded,
            scale=scale,
            dtypes=DTYPES,
            head_dims=HEAD_DIMS,
        )
    else:
        check_varlen_tensors(q, k, v, dtypes=DTYPES, head_dims=HEAD_DIMS)
        check_cu_seqlens_tensors(
            cu_seqlens_q,
            cu_seqlens_k,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_k_padded=cu_seqlens_k_padded,
            device=q.device,
        )
    check_kernel_device("q", q)  # after the type checks: a list has no device to report
    out, lse, _ = _forward_op(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded,
        cu_seqlens_k if cu_seqlens_k_padded is None else cu_seqlens_k_padded,
        causal,
        check_scale(scale, q.shape[-1]),
    )
    return (out, lse) if return_lse else out
