"""`varlen_attention`: the public entry point, a `torch.library` custom op with autograd.

Forward and backward are two custom ops (`kernels::varlen_attention_fwd` / `_bwd`), so
autograd, `torch.compile` (fake tensors give the output shapes without running Triton) and
dispatch modes (which see one op per call) all treat the kernel as one opaque operation.

Plain eager calls (nothing compiling, no dispatch mode active) take a shorter road to the same
launchers: one `torch.autograd.Function`, without the custom ops' dispatch and their autograd
wrapper, which cost about as much host time as the kernel launches themselves. Both roads
compute bitwise the same (tested).
"""

import weakref
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from kernels._compat import INTERPRETED, check_kernel_device
from kernels.contract import (
    check_causal,
    check_cu_seqlens_tensors,
    check_max_seqlen,
    check_scale,
    check_varlen_inputs,
    check_varlen_tensors,
    check_window_size,
)
from kernels.varlen.device_check import DeviceCheck, DeviceChecked, PendingChecks, check_on_device
from kernels.varlen.fa4 import BACKENDS, fa4_attention, unsupported
from kernels.varlen.launch import attention_backward, attention_forward, work_lists_shape

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# q/k and v each: every multiple of 8 up to 256, as FlashAttention-2/3 (the kernels pad the lanes
# to a power of two and mask them, kernels/varlen/attention_kernels.py).
HEAD_DIMS = range(8, 257, 8)


@torch.library.custom_op("kernels::varlen_attention_fwd", mutates_args=())
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


@torch.library.custom_op("kernels::varlen_attention_bwd", mutates_args=())
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


def _eager() -> bool:
    """Nothing traces the call: the custom op's opaque node is not needed."""
    return not torch.compiler.is_compiling() and _current_dispatch_mode() is None


class _VarlenAttention(torch.autograd.Function):
    """The eager road: the launchers behind one autograd node (see the module docstring)."""

    @staticmethod
    def forward(ctx, check, work, q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded, *mask):
        metadata = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
        out, lse, work = attention_forward(q, k, v, *metadata, *mask, fill=_padding_to_fill(check), work=work)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, work, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
        ctx.mask, ctx.check = mask, check
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, work, *cu_seqlens = ctx.saved_tensors
        if d_out is None:  # only lse was used
            d_out = torch.zeros_like(out)
        dq, dk, dv = attention_backward(
            d_out, d_lse, q, k, v, out, lse, work, *cu_seqlens, *ctx.mask, fill=_padding_to_fill(ctx.check)
        )
        # The forward's device check, if it was left unread: read after the launches (the GPU
        # keeps working), before any gradient leaves.
        if ctx.check is not None:
            ctx.check.raise_if_failed(_BACKWARD)
        return None, None, dq, dk, dv, *([None] * (4 + len(ctx.mask)))


def _padding_to_fill(check: DeviceCheck | None) -> bool:
    """Whether the padding rows must be filled: unless the device check of these boundaries is
    known, without a wait, to have passed with every row real (the layers of a step after the
    first, an unpadded batch). Skipping the fill saves a launch, tens of microseconds of host time."""
    return check is None or not check.all_rows_real()


_BACKWARD = "the backward of a varlen_attention call whose metadata is malformed (its check ran on the device, read here): "


class _ValidatedMetadata:
    """The last metadata that passed the host check or went through the device check, so that
    the layers of one step, which all pass the same cu_seqlens tensors, pay for the check once.
    A device check's safe copy and outcome are kept with it: a later call on the same metadata
    runs on that copy and shares that outcome, read or pending (a failed one is never reused).

    It holds weak references: a tensor that is freed can never match, even if a new one gets
    its memory. A match needs the very same tensor objects, each with the version counter
    it had when checked (any in-place write bumps it), the same row counts of q and k, the
    same max_seqlen and scale. Anything else runs the whole check again. (A write that bypasses
    torch's version counter, such as a raw kernel writing into the tensor's memory, is not seen:
    pass validate=True with new tensors, as each new batch brings, to be sure.)"""

    def __init__(self) -> None:
        self.refs: tuple = ()
        self.key: tuple = ()
        self.device: DeviceChecked | None = None  # the device check's safe copy and outcome; None after the host check

    @staticmethod
    def _key(metadata, q, k, max_seqlen_q, max_seqlen_k, scale) -> tuple:
        versions = tuple(None if t is None else t._version for t in metadata)
        return (versions, q.shape[0], k.shape[0], q.device, max_seqlen_q, max_seqlen_k, scale)

    def holds(self, metadata, q, k, max_seqlen_q, max_seqlen_k, scale) -> bool:
        if len(self.refs) != len(metadata) or not all(isinstance(t, torch.Tensor) for t in metadata[:2]):
            return False
        if any((ref is None) != (t is None) or (ref is not None and ref() is not t) for ref, t in zip(self.refs, metadata)):
            return False
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
            return False
        if self.device is not None and self.device[1].done() and self.device[1].failed():
            return False  # checked again, and raised, by the call
        return self.key == self._key(metadata, q, k, max_seqlen_q, max_seqlen_k, scale)

    def remember(self, metadata, q, k, max_seqlen_q, max_seqlen_k, scale, device: DeviceChecked | None = None) -> None:
        self.refs = tuple(None if t is None else weakref.ref(t) for t in metadata)
        self.key = self._key(metadata, q, k, max_seqlen_q, max_seqlen_k, scale)
        self.device = device


_VALIDATED = _ValidatedMetadata()
_PENDING = PendingChecks()


def raise_pending() -> None:
    """Waits for the device checks of earlier `varlen_attention` calls that have not been read
    yet (calls whose output was to be differentiated, whose backward has not run), and raises
    the first failure's error, naming it as an earlier call's. Returns if all passed."""
    _PENDING.raise_all()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _checks_on_device() -> bool:
    """The metadata's values are checked by a kernel natively in eager mode (device_check);
    under the interpreter they are host memory already, and a traced call keeps the host check."""
    return not INTERPRETED and _eager()


def _sync_free_checks_pass(q, k, v, metadata, limits, scale) -> bool:
    """Whether the checks that need no host read pass. A call that fails one takes the host
    check, which raises the first failure in the order a CPU call reports it."""
    try:
        check_varlen_tensors(q, k, v, dtypes=DTYPES, head_dims=HEAD_DIMS)
        check_cu_seqlens_tensors(*metadata[:2], cu_seqlens_q_padded=metadata[2], cu_seqlens_k_padded=metadata[3], device=q.device)
        for side, limit in zip("qk", limits):
            check_max_seqlen(f"max_seqlen_{side}", limit, f"cu_seqlens_{side}")
        check_scale(scale, q.shape[-1])
    except (TypeError, ValueError):
        return False
    return True


def check_backend(backend: object) -> str:
    if backend not in BACKENDS:
        raise ValueError(
            f'backend = {backend!r} is not one of {", ".join(map(repr, BACKENDS))}; pass "auto" (FlashAttention-4 where '
            'it can run the call, else the Triton kernel), "triton" or "fa4".'
        )
    return str(backend)


def _runs_on_fa4(backend, eager, q, k, v, metadata, return_lse, validate) -> bool:
    """Whether FA4 computes the call: "fa4" refuses, with the reason, a call FA4 cannot run."""
    if backend == "triton":
        return False
    reason = (
        "traced (torch.compile or a dispatch mode): the FA4 path runs eagerly only"
        if not eager
        else unsupported(q, k, v, metadata, return_lse=return_lse, validate=validate)
    )
    if reason and backend == "fa4":
        raise ValueError(f'backend="fa4" cannot run this call: {reason}. Pass backend="auto" to run it on the Triton kernel.')
    return reason is None


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
    window_size: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    return_lse: bool = False,
    validate: bool = True,
    backend: str = "triton",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Attention over packed variable-length sequences, keeping the padding contract (docs/contract.md).

    Sequence i's real queries are rows [cu_seqlens_q_padded[i], cu_seqlens_q_padded[i] + len_i)
    of q, len_i = cu_seqlens_q[i + 1] - cu_seqlens_q[i] (the padded boundaries default to
    cu_seqlens_q); the same for keys. Every other row is padding, and padding never influences
    a real row.

    Args:
        q: queries, (T_q, H, D).
        k, v: keys (T_k, H_kv, D) and values (T_k, H_kv, D_v); H % H_kv == 0 (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) real boundaries, (N + 1,), starting at 0.
        max_seqlen_q, max_seqlen_k: the longest real sequence of each side (only validated: the
            grid is bounded by the row counts, so no row goes unprocessed).
        cu_seqlens_q_padded, cu_seqlens_k_padded: where each sequence starts in memory, (N + 1,),
            for layouts with padding between sequences (THD with cu_seqlens_padded).
        causal: a bool; True is ``window_size=(left, 0)``, bottom-right aligned.
        window_size: FlashAttention's ``(left, right)``, -1 = unbounded: query i of a sequence
            sees key j iff ``i + len_k - len_q - left <= j <= i + len_k - len_q + right``
            (bottom-right aligned when len_q != len_k). ``(-1, 0)`` is causal, ``(4096, 0)`` a
            causal sliding window. Key blocks wholly outside the window are skipped.
        scale: softmax scale, 1/sqrt(D) by default.
        return_lse: return ``(out, lse)`` instead of ``out``.
        validate: check the boundary values too (docs/contract.md, Validation). On the CPU,
            or traced, the host checks them before launching: a malformed call raises at once.
            Natively a kernel checks them on the GPU and the attention kernels run on its safe
            copy (all padding if a check fails: zeros, nothing read out of bounds); reading its
            verdict waits for all the work queued before it. So a call whose output will be
            differentiated (grad enabled, q, k or v requiring grad; the Triton backend) returns
            without waiting, and a malformed one raises at the first of: a later
            ``varlen_attention`` call that finds the check done (it never waits),
            ``kernels.varlen.raise_pending()``, and this call's backward, before it returns any
            gradient. Until then its output is zeros, and a value read from it first (a loss
            printed before ``backward``) is computed from them. Every other call waits for the
            check and raises before it returns. Skipped when the very same, unmodified metadata
            tensors were checked last, as in the layers of one step (which then share that
            check). False keeps only the checks that need no wait on the device, for CUDA
            graphs and ``torch.compile(fullgraph=True)``.

        backend: which kernel computes the call. "triton": ours. "fa4": FlashAttention-4
            (the optional extra ``fa4``) with the contract kept by a thin wrapper
            (kernels/varlen/fa4.py); a call it cannot express is refused with the reason.
            "auto": FA4 where it can run the call, ours elsewhere. "triton" is the default: the
            wrapper keeps the contract (its H200 audit passes) but its copies make it slower
            than ours on batches with GAP rows. Since FA4's tiles read rows past a
            sequence's end, the wrapper hands FA4 views that end at the last real row on a
            side with TAIL rows only, and copies with the padding rows zeroed on a side with
            GAP rows (docs/contract.md, Backends). FA4 runs a
            call eagerly on an sm90 or sm100 GPU, float16/bfloat16, the head dims FA4 takes
            there (every one of ours on sm90; on sm100 up to 128, or 192/128), int32
            boundaries, with ``validate=True`` (FA4 bounds its work by max_seqlen) and no
            gradient through lse (``return_lse=True`` while q, k or v require grad). Every
            other call (CPU, other GPUs, float32, other head dims, ``torch.compile``) runs
            on the Triton kernel.

    Returns:
        out (T_q, H, D_v) in q's dtype, exactly 0 on padding rows and on rows that see no key;
        with ``return_lse``, also lse (H, T_q) float32 (flash-attn's varlen layout), -inf on
        those rows. Gradients of q, k, v are exactly 0 on padding rows, never NaN.

    Shape legend:
        N: sequences in the batch; T_q, T_k: rows of q and of k/v (real rows plus any padding);
        H: query heads; H_kv: key/value heads; D, D_v: head dims of q/k and of v, each a multiple
        of 8 up to 256 (D_v = D but for DeepSeek-style attention, e.g. 192 and 128);
        dtypes float32, float16, bfloat16.

    Example::

        >>> import torch
        >>> from kernels import default_device, varlen_attention
        >>> device = default_device()
        >>> lengths = torch.tensor([5, 3])
        >>> cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(device)
        >>> q, k, v = (torch.randn(8, 2, 16, device=device) for _ in range(3))
        >>> out = varlen_attention(q, k, v, cu, cu, 5, 5, window_size=(2, 0))
        >>> out.shape
        torch.Size([8, 2, 16])
    """
    _PENDING.raise_finished()  # an earlier call's failed check the device has reported: no wait
    check_causal(causal)
    left, right = check_window_size(window_size)
    check_backend(backend)
    metadata = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
    limits = (max_seqlen_q, max_seqlen_k)
    asked_to_validate = validate
    reused = validate and _VALIDATED.holds(metadata, q, k, *limits, scale)
    if reused:
        validate = False  # the same metadata, unchanged, was checked: tensor checks only
    if validate and _capturing():
        raise ValueError(
            "validate=True checks the boundary values, which waits on the device, and a CUDA graph capture allows no "
            "wait; pass validate=False inside the capture (check the metadata once before capturing)."
        )
    on_device = validate and _checks_on_device() and _sync_free_checks_pass(q, k, v, metadata, limits, scale)
    if validate and not on_device:
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
        _VALIDATED.remember(metadata, q, k, *limits, scale)
    elif not validate:
        check_varlen_tensors(q, k, v, dtypes=DTYPES, head_dims=HEAD_DIMS)
        check_cu_seqlens_tensors(
            cu_seqlens_q,
            cu_seqlens_k,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_k_padded=cu_seqlens_k_padded,
            device=q.device,
        )
    check_kernel_device("q", q)  # after the type checks: a list has no device to report
    kernel_metadata = (
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded,
        cu_seqlens_k if cu_seqlens_k_padded is None else cu_seqlens_k_padded,
    )
    device_check = None
    if reused and _VALIDATED.device is not None:  # the device check of these tensors: its safe copy, its outcome
        kernel_metadata, device_check = _VALIDATED.device
    if on_device:  # the kernels run on the check's safe copy: all padding if the check fails
        checked = check_on_device(*metadata, q.shape[0], k.shape[0], *limits)
        kernel_metadata, device_check = checked
        _VALIDATED.remember(metadata, q, k, *limits, scale, checked)
    mask = (causal, check_scale(scale, q.shape[-1]), left, right)
    eager = _eager()  # asked once: it reads torch.compile's state and the dispatch mode stack
    backward_reads_check = False  # whether out's backward is ours and reads device_check
    if _runs_on_fa4(backend, eager, q, k, v, metadata, return_lse, asked_to_validate):
        if device_check is not None:
            # FA4 needs the layout, read with the verdict (one wait): a malformed call raises
            # before FA4 runs on anything.
            device_check.raise_if_failed()
        out, lse = fa4_attention(q, k, v, *kernel_metadata, int(max_seqlen_q), int(max_seqlen_k), *mask, return_lse, device_check)
    elif eager:
        # kernel_metadata is the check's safe copy, whose work lists the check wrote
        work = None if device_check is None else device_check.work
        out, lse = _VarlenAttention.apply(device_check, work, q, k, v, *kernel_metadata, *mask)
        backward_reads_check = out.grad_fn is not None
    else:
        out, lse, _ = _forward_op(q, k, v, *kernel_metadata, *mask)
    if device_check is not None:
        # Reading the check's flag waits for all the work queued before it. A call whose output
        # will be differentiated leaves it to its backward (which reads it before returning any
        # gradient), to later calls and to raise_pending; every other call reads it now.
        if backward_reads_check and not device_check.done():
            _PENDING.add(device_check)
        else:
            device_check.raise_if_failed()
    return (out, lse) if return_lse else out


class AuxRequest(NamedTuple):
    """Which auxiliary outputs `varlen_attn` returns (torch.nn.attention.varlen.AuxRequest's fields)."""

    lse: bool = False


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    return_aux: AuxRequest | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch 2.11's `torch.nn.attention.varlen.varlen_attn`, same signature and return
    convention, on the fixed kernel: the fix is one import away::

        from kernels import varlen_attn  # instead of: from torch.nn.attention.varlen import varlen_attn

    Returns out (T_q, H, D), or (out, lse) with lse (H, T_q) float32 when `return_aux.lse`
    (torch's own AuxRequest works too). `window_size=(-1, 0)` is causal. Unlike torch's, rows
    of q past cu_seq_q[-1] (trailing padding) come back exactly 0 with zero gradients, and GQA
    needs no flag. Metadata is validated when eager (`varlen_attention`'s ``validate=True``); inside
    `torch.compile` or CUDA graph capture only the checks that need no wait on the device run.
    """
    want_lse = return_aux is not None and bool(return_aux.lse)
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return varlen_attention(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        window_size=window_size,
        scale=scale,
        return_lse=want_lse,
        validate=not (torch.compiler.is_compiling() or capturing),
    )
