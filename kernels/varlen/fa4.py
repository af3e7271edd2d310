"""FlashAttention-4 behind the padding contract: `varlen_attention(..., backend="fa4")`.

FA4 (`flash-attn-4`, CuTe DSL, Hopper and Blackwell) computes the REAL rows; this wrapper adds
only what the contract needs beyond them, and nothing on a batch without padding rows:

- which FA4: its forward and backward functions `_flash_attn_fwd` and `_flash_attn_bwd`
  (flash_attn/cute/interface.py), which write into buffers the caller provides (`out=`, `lse=`,
  `dq=`, `dk=`, `dv=`). They are private, so the path runs on the one release whose signatures
  it was written against (`FA4_VERSION`); any other installed version is refused with that reason;
- layout: FA4's `cu_seqlens_*` are where sequences start in memory (our padded boundaries) and
  its `seqused_*` how many of their rows are real (given on a side with padding between
  sequences only), so every padded layout of the contract is said as it is (a sequence's real
  rows start its slot in both);
- what FA4 reads: its tiles run past a sequence's last real row into whatever follows (GAP and
  TAIL rows included) and give those rows zero weight, which NaN or inf there turns into NaN on
  REAL rows. Upstream source (flash_attn/cute, the same in the 4.0.0b36 wheel and at commit
  0251105a, tag fa4-v4.0.0.beta27): `SeqlenInfoQK.offset_batch_Q/K` (seqlen_info.py) move the
  start of q, k, v and dO by `cute.domain_offset` and keep the whole tensor's extent, which is
  how flash_fwd_sm90.py (q, k, v) and flash_bwd_sm90.py (q, k, v, dO) load their tiles, while
  a tile past the tensor's end is zero-filled by TMA. So a side whose only padding is TAIL rows
  (after `cu_seqlens[-1]`, none between sequences) reaches FA4 as a view that ends at its last
  real row, with no copy (an empty view when no row is real: FA4 then answers 0 and -inf, and
  zero gradients, without running its kernels); a side with GAP rows reaches it as a copy of q
  (or of k and v) and of dO with its padding rows zeroed. Which side has which
  (`fa4_layout`) is read once per batch, in the same device->host copy as its device check's
  verdict, and kept per metadata object (kernels/caches.py `derived`): the layers of one step pay
  nothing;
- `out`, `lse` and the gradients are full-size buffers of which FA4 writes the rows it sees (a
  view of their leading rows): their TAIL rows are written 0 (lse -inf) once, nothing is
  appended or copied. FA4 stores no row past a sequence's real ones (4.0.0b36: the stores go
  through `offset_batch_Q/K(..., ragged=True)`, bounded by the sequence's length, or are
  predicated on it) nor past the view's end (TMA), so it leaves GAP rows as it found them
  (`torch.empty`), and one launch of
  `fill_padding_rows` writes 0 and -inf there (one more zeroes the gradients' GAP rows). A
  returned lse says -inf (not FA's +inf) on rows that see no key, in a copy, since FA4's
  backward reads its own.

Everything else (rows that see no key, windows, GQA, bottom-right causal alignment) is FA4's
own; the H200 audit checks the wrapped function against the whole contract. What FA4 cannot
express (`unsupported`) runs on the Triton kernel under backend="auto" and is refused, with
the reason, under backend="fa4".
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from varlen_workbench.kernels._compat import device_capability
from varlen_workbench.kernels.caches import cached, derived
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen.launch import Padding, fill_padding_rows

if TYPE_CHECKING:
    from varlen_workbench.kernels.varlen.metadata import VarlenMetadata

FA4_DTYPES = (torch.float16, torch.bfloat16)
FA4_ARCHS = (9, 10)  # compute capability majors: Hopper (sm90), Blackwell (sm100)
# FA4's own rule, `_validate_head_dims` in flash_attn/cute/interface.py (the 4.0.0b36 wheel, line
# 121, called by _flash_attn_fwd and _flash_attn_bwd; the same at commit 0251105a): q/k's and v's
# head dims each a multiple of 8 (16 bytes of fp16/bf16), 8 to 256 on sm90; on sm100 8 to 128,
# or the pairs below (DeepSeek's 192/128, and 256/256).
FA4_SM100_PAIRS = ((192, 128), (256, 256))


def fa4_takes_head_dims(head_dim: int, head_dim_v: int, major: int) -> bool:
    """Whether FA4 runs q/k of `head_dim` with v of `head_dim_v` on compute capability `major`."""
    dims = (head_dim, head_dim_v)
    if any(d < 8 or d % 8 for d in dims):
        return False
    return max(dims) <= 256 if major == 9 else max(dims) <= 128 or dims in FA4_SM100_PAIRS


FA4_VERSION = "4.0.0b36"  # the release whose private _flash_attn_fwd/_flash_attn_bwd this module calls
INSTALL = "pip install 'varlen-postmortem-workbench[fa4]' (flash-attn-4, on an sm90/sm100 GPU)"


class Fa4Layout(NamedTuple):
    """What FA4 is told of a batch, per side: how many leading rows hold every real row
    (`cu_seqlens[-1]`), and FA4's `seqused` (the real rows of each padded slot) where padding
    lies between sequences (GAP rows), None where none does."""

    real_q: int
    real_k: int
    seqused_q: torch.Tensor | None
    seqused_k: torch.Tensor | None


def fa4_layout(metadata: VarlenMetadata) -> Fa4Layout:
    """The layout FA4 is told of `metadata`'s batch, built once per object: from the host check,
    or read with the device check's verdict (`check()` has read it). FA4 runs on validated
    batches only (`unsupported`)."""

    def build() -> Fa4Layout:
        layout = metadata.known_layout()
        if layout is None:
            raise RuntimeError("fa4_layout() of a batch whose check is unread or absent: call metadata.check() first")
        q, k = metadata.boundaries[:2]
        return Fa4Layout(
            layout.real_q,
            layout.real_k,
            _real_lengths(q) if layout.gap_q else None,
            _real_lengths(k) if layout.gap_k else None,
        )

    return derived("fa4", metadata, build)


def _real_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)


class Kernels(NamedTuple):
    """FA4's `flash_attn.cute.interface._flash_attn_fwd` and `_flash_attn_bwd`."""

    forward: Callable
    backward: Callable


def installed_version() -> str | None:
    """The installed flash-attn-4's version, or None."""
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


@cached
def load() -> Kernels | str:
    """FA4's forward and backward, or (a string) why they cannot be used."""
    version = installed_version()
    if version is None:
        return f"flash-attn-4 is not installed ({INSTALL})"
    if version != FA4_VERSION:
        return (
            f"flash-attn-4 {version} is installed; the FA4 path is built on {FA4_VERSION}'s private "
            f"_flash_attn_fwd/_flash_attn_bwd, whose signatures may change between releases: "
            f"pip install 'flash-attn-4=={FA4_VERSION}'"
        )
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except ImportError as error:
        return f"flash-attn-4 {version} is installed but does not import ({error})"
    return Kernels(_flash_attn_fwd, _flash_attn_bwd)


def platform_reason(where: torch.Tensor | torch.device) -> str | None:
    """Why FA4 cannot run on q's device (`where`: q or its device; None: it can)."""
    device = where.device if isinstance(where, torch.Tensor) else where
    if interpreted(device):
        return f"FA4 runs natively on CUDA only, q is on {device} (the Triton interpreter)"
    return _device_reason(device)


@cached
def _device_reason(device: torch.device) -> str | None:
    """`platform_reason` per device, asked once: a device's kind and compute capability stay."""
    if device.type != "cuda":
        return f"FA4 runs natively on CUDA only, q is on {device}"
    major, minor = device_capability(device)
    if major not in FA4_ARCHS:
        return f"FA4 runs on sm90 and sm100 GPUs, this one is sm{major}{minor}"
    return None


def _head_dims_reason(head_dim: int, head_dim_v: int, device: torch.device) -> str | None:
    """Why FA4 on `device` cannot run these head dims (None: it can). What sm100 takes sm90 takes
    too: only the rest needs the device's compute capability."""
    if fa4_takes_head_dims(head_dim, head_dim_v, 10):
        return None
    major = device_capability(device)[0]
    if fa4_takes_head_dims(head_dim, head_dim_v, major):
        return None
    pairs = " or ".join(f"{a}/{b}" for a, b in FA4_SM100_PAIRS)
    takes = "multiples of 8 up to 256 each" if major == 9 else f"multiples of 8 up to 128 each, or (q/k, v) {pairs}"
    return f"head dims {head_dim} (q, k) and {head_dim_v} (v): FA4 on sm{major}0 takes {takes}"


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries, *, return_lse: bool, validate: bool) -> str | None:
    """Why this call cannot run on FA4 with the contract kept (None: it can)."""
    kernels = load()
    if isinstance(kernels, str):
        return kernels
    reason = platform_reason(q)
    if reason:
        return reason
    if q.dtype not in FA4_DTYPES:
        return f"FA4 computes in float16 and bfloat16 only, q is {q.dtype}"
    reason = _head_dims_reason(q.shape[-1], v.shape[-1], q.device)
    if reason:
        return reason
    if return_lse and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "return_lse=True with gradients: FA4's lse carries no gradient, ours does"
    if not validate:
        return "validate=False: FA4 bounds its work by max_seqlen_q/k, which only validate=True checks"
    if any(t is not None and t.dtype != torch.int32 for t in boundaries):
        return "int64 boundaries: FA4 takes int32 cu_seqlens"
    return None


class _PaddingZeroed(torch.autograd.Function):
    """What FA4 reads on a side with GAP rows: q (or k and v) with its padding rows zeroed, in a
    copy; their gradients come back exactly 0 on padding rows."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, cu_q_padded, cu_k_padded, padded_q, padded_k):
        ctx.save_for_backward(cu_q, cu_k, cu_q_padded, cu_k_padded)
        ctx.padded = (padded_q, padded_k, padded_k)
        copy = torch.contiguous_format
        inputs = [t.clone(memory_format=copy) if padded else t.view_as(t) for t, padded in zip((q, k, v), ctx.padded)]
        _zero_padding_rows(inputs, _sides(cu_q, cu_k, cu_q_padded, cu_k_padded), ctx.padded)
        return tuple(inputs)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        grads = [None if g is None else g.contiguous() for g in (dq, dk, dv)]
        _zero_padding_rows(grads, _sides(*ctx.saved_tensors), ctx.padded)  # _FA4's fresh gradient buffers
        return (*grads, None, None, None, None, None, None)


class _FA4(torch.autograd.Function):
    """FA4 on the leading `seen_q` rows of q and `seen_k` of k and v (the rest are TAIL rows),
    writing into views of full-size out, lse and gradients whose TAIL rows are written 0 (lse
    -inf) here: the rows FA4 does not see cost a fill of out, one of lse and one of the three
    gradients, no appended copy."""

    @staticmethod
    def forward(ctx, q, k, v, seen_q: int, seen_k: int, arguments: dict):
        kernels = load()
        assert not isinstance(kernels, str), "unsupported() rules this out"
        ctx.seen, ctx.arguments = (seen_q, seen_k, seen_k), arguments
        out = torch.empty((*q.shape[:2], v.shape[2]), dtype=q.dtype, device=q.device)  # v's head dim
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        out_seen, lse_seen = _tail_filled(out, seen_q, 0.0), _tail_filled(lse, seen_q, float("-inf"), 1)
        kernels.forward(*map(_leading, (q, k, v), ctx.seen), out=out_seen, lse=lse_seen, **arguments)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _):
        kernels = load()
        assert not isinstance(kernels, str)
        q, k, v, out, lse = ctx.saved_tensors
        seen_q = ctx.seen[0]
        grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
        tails = [g[seen:] for g, seen in zip(grads, ctx.seen) if seen < g.shape[0]]
        if tails:  # one launch for the three on a GPU (a multi-tensor kernel), not one each
            torch._foreach_zero_(tails)
        dq, dk, dv = map(_leading, grads, ctx.seen)
        q, k, v = map(_leading, (q, k, v), ctx.seen)
        out, d_out, lse = _leading(out, seen_q), _leading(d_out, seen_q), _leading(lse, seen_q, 1)
        kernels.backward(q, k, v, out, d_out, lse, dq=dq, dk=dk, dv=dv, **ctx.arguments)
        return *grads, None, None, None


# Views by indexing: a basic slice takes about half the host time of `narrow` and a fifth of `split`.
def _leading(t: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """The first `rows` rows of t along dim (0 or 1); t itself when that is all of them."""
    if rows == t.shape[dim]:
        return t
    return t[:, :rows] if dim else t[:rows]


def _tail_filled(t: torch.Tensor, seen: int, value: float, dim: int = 0) -> torch.Tensor:
    """Writes `value` on t's rows from `seen` on along dim (0 or 1: the TAIL rows FA4 does not
    see) and returns the view of the rows before them (t itself where there are none)."""
    if seen == t.shape[dim]:
        return t
    (t[:, seen:] if dim else t[seen:]).fill_(value)
    return _leading(t, seen, dim)


class _OutputGradZeroed(torch.autograd.Function):
    """out unchanged; the gradient FA4's backward reads (dO) gets 0 on padding rows, in a copy:
    out is 0 there whatever q, k, v hold, so no gradient flows from those rows."""

    @staticmethod
    def forward(ctx, out, cu_q, cu_q_padded):
        ctx.save_for_backward(cu_q, cu_q_padded)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, d_out):
        d_out = d_out.clone(memory_format=torch.contiguous_format)  # never the caller's tensor
        _zero_padding_rows([d_out], [ctx.saved_tensors], [True])
        return d_out, None, None


def _sides(cu_q, cu_k, cu_q_padded, cu_k_padded) -> tuple:
    """The (real, padded) boundaries of q, k and v's rows."""
    return ((cu_q, cu_q_padded), (cu_k, cu_k_padded), (cu_k, cu_k_padded))


def _zero_padding_rows(tensors, sides, padded) -> None:
    """0 on the padding rows of each (T, H, D) tensor whose side has padding rows: one launch."""
    fill_padding_rows(
        *(Padding(t.view(t.shape[0], -1), 0.0, *side) for t, side, p in zip(tensors, sides, padded) if p and t is not None)
    )


def fa4_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: VarlenMetadata,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FA4 on a call `unsupported` accepts, the contract kept: (out, lse or None). `metadata`'s
    check has been read (`metadata.check()`) before this call: FA4 never runs on a malformed batch."""
    cu_q, cu_k, cu_q_padded, cu_k_padded = boundaries = (
        metadata.cu_seqlens_q,
        metadata.cu_seqlens_k,
        metadata.cu_seqlens_q_padded,
        metadata.cu_seqlens_k_padded,
    )
    layout = fa4_layout(metadata)
    gap_q, gap_k = layout.seqused_q is not None, layout.seqused_k is not None
    if gap_q or gap_k:
        q, k, v = _PaddingZeroed.apply(q, k, v, *boundaries, gap_q, gap_k)
    arguments = dict(
        cu_seqlens_q=cu_q_padded,
        cu_seqlens_k=cu_k_padded,
        seqused_q=layout.seqused_q,
        seqused_k=layout.seqused_k,
        max_seqlen_q=metadata.max_seqlen_q,
        max_seqlen_k=metadata.max_seqlen_k,
        softmax_scale=scale,
        causal=causal,
        window_size_left=None if window_left < 0 else window_left,
        window_size_right=None if window_right < 0 else window_right,
    )
    # FA4 sees a TAIL-only side up to its last real row, a side with GAP rows whole.
    out, lse = _FA4.apply(q, k, v, q.shape[0] if gap_q else layout.real_q, k.shape[0] if gap_k else layout.real_k, arguments)
    if return_lse:
        lse = torch.where(lse == float("inf"), float("-inf"), lse)  # a copy: FA4's backward reads its own
    if gap_q:
        # Padding rows only, written in place by a kernel: FA4's saved out reads them nowhere.
        targets = [Padding(out.view(out.shape[0], -1), 0.0, cu_q, cu_q_padded)]
        if return_lse:
            targets.append(Padding(lse.T, float("-inf"), cu_q, cu_q_padded))
        fill_padding_rows(*targets)
        out = _OutputGradZeroed.apply(out, cu_q, cu_q_padded)
    return out, (lse if return_lse else None)
