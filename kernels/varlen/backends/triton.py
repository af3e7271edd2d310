"""The Triton kernel as a backend: `backend="triton"`, the fixed kernel of this package.

Forward and backward are two custom ops (`varlen_workbench::varlen_attention_fwd` / `_bwd`), so
autograd, `torch.compile` (fake tensors give the output shapes without running Triton) and
dispatch modes (which see one op per call) all treat the kernel as one opaque operation.

Plain eager calls (nothing compiling, no dispatch mode active) take a shorter road to the same
launchers: one `torch.autograd.Function`, without the custom ops' dispatch and their autograd
wrapper, which cost about as much host time as the kernel launches themselves. Both roads
compute bitwise the same (tested).
"""

import torch

from varlen_workbench.kernels.varlen.backends.registry import Call
from varlen_workbench.kernels.varlen.launch import attention_backward, attention_forward, work_lists_shape
from varlen_workbench.kernels.varlen.metadata import VarlenMetadata


@torch.library.custom_op("varlen_workbench::varlen_attention_fwd", mutates_args=())
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
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q_padded,
        cu_seqlens_k_padded,
        causal,
        scale,
        window_left,
        window_right,
    )


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded, *mask_and_scale):
    total_q, heads, _ = q.shape
    work = q.new_empty(work_lists_shape(cu_seqlens_q.shape[0] - 1), dtype=torch.int32)
    return q.new_empty((total_q, heads, v.shape[2])), q.new_empty((heads, total_q), dtype=torch.float32), work


@torch.library.custom_op("varlen_workbench::varlen_attention_bwd", mutates_args=())
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
    window_left: int = -1,
    window_right: int = -1,
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
        window_left,
        window_right,
    )


@_backward_op.register_fake
def _backward_fake(d_out, d_lse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *cu_seqlens, causal, scale, window_left, window_right = inputs
    out, lse, work = output
    ctx.mark_non_differentiable(work)
    # An unused output's gradient stays None: no zeros to allocate, and lse's is skipped in-kernel.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, work, *cu_seqlens)
    ctx.mask = (causal, scale, window_left, window_right)


def _backward(ctx, d_out, d_lse, _d_work):
    # d_lse is None unless the caller used lse (return_lse=True); it enters as dS += P * d_lse.
    q, k, v, out, lse, work, *cu_seqlens = ctx.saved_tensors
    if d_out is None:  # only lse was used
        d_out = torch.zeros_like(out)
    dq, dk, dv = _backward_op(d_out, d_lse, q, k, v, out, lse, work, *cu_seqlens, *ctx.mask)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _VarlenAttention(torch.autograd.Function):
    """The eager road: the launchers behind one autograd node (see the module docstring)."""

    @staticmethod
    def forward(ctx, metadata: VarlenMetadata, q, k, v, *mask):
        boundaries = metadata.boundaries
        fill = metadata.padding_to_fill()
        # metadata.work: made with the metadata (None under the interpreter: these work lists are made here)
        out, lse, work = attention_forward(q, k, v, *boundaries, *mask, fill=fill, work=metadata.work, failed=metadata.verdict)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.batch, ctx.work = mask, metadata, work
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        metadata: VarlenMetadata = ctx.batch
        if d_out is None:  # only lse was used
            d_out = torch.zeros_like(out)
        dq, dk, dv = attention_backward(
            d_out,
            d_lse,
            q,
            k,
            v,
            out,
            lse,
            ctx.work,
            *metadata.boundaries,
            *ctx.mask,
            fill=metadata.padding_to_fill(),
            failed=metadata.verdict,
        )
        # The device check, if nothing read it yet: read after the launches (the GPU keeps
        # working), before any gradient leaves.
        metadata.read_in_backward()
        return None, dq, dk, dv, *([None] * len(ctx.mask))


class Triton:
    name = "triton"
    label = "Triton kernel"
    summary = "the fixed Triton kernel of this package (kernels/varlen/forward_kernels.py, backward_kernels.py)"
    takes = "every call: compiled on CUDA tensors, through Triton's interpreter on CPU tensors"

    dtypes: tuple[torch.dtype, ...] | None = None

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def cannot_take(self, call: Call) -> str | None:
        return None

    def preference(self, call: Call) -> int:
        return 1  # the torch backend outranks it on the CPU, FA4 where the record says FA4 is faster

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        if call.eager:
            return _VarlenAttention.apply(call.metadata, call.q, call.k, call.v, *call.mask)
        out, lse, _ = _forward_op(call.q, call.k, call.v, *call.metadata.boundaries, *call.mask)
        return out, lse
