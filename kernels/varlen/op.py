"""`varlen_attention`: the public entry point. It checks the call, builds or takes the batch's
`VarlenMetadata`, and hands the call to a backend of the registry (kernels/varlen/backends/):
the named one, or under "auto" the preferred one that can take it.
"""

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch

from varlen_workbench.kernels._compat import check_kernel_device
from varlen_workbench.kernels.caches import cached
from varlen_workbench.kernels.contract import check_causal, check_scale, check_varlen_tensors, check_window_size
from varlen_workbench.kernels.varlen.backends import Call, check_backend, choose
from varlen_workbench.kernels.varlen.metadata import VarlenMetadata, capturing, implicit
from varlen_workbench.kernels.varlen.metadata import eager as _eager

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# q/k and v each: every multiple of 8 up to 256, as FlashAttention-2/3 (the kernels pad the lanes
# to a power of two and mask them, kernels/varlen/kernel_common.py).
HEAD_DIMS = range(8, 257, 8)


def _one_scale(scale: float | None, softmax_scale: float | None) -> float | None:
    """`softmax_scale` is FlashAttention's name for `scale`: either may be given, not both."""
    if softmax_scale is None:
        return scale
    if scale is not None:
        raise ValueError(
            f"got scale={scale!r} and softmax_scale={softmax_scale!r}; they are one argument (softmax_scale is "
            "FlashAttention's name for scale): pass one of them."
        )
    return softmax_scale


def _metadata_of(
    q: torch.Tensor,
    k: torch.Tensor,
    boundaries: tuple[torch.Tensor | None, ...],
    limits: tuple[int | None, int | None],
    metadata: VarlenMetadata | None,
    validate: bool | None,
) -> VarlenMetadata:
    """The call's metadata: the one passed, or (a positional call) the one `implicit` builds."""
    if metadata is None:
        if any(b is None for b in (*boundaries[:2], *limits)):
            missing = [
                n
                for n, b in zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), (*boundaries[:2], *limits))
                if b is None
            ]
            raise TypeError(
                f"varlen_attention needs the batch's boundaries: {', '.join(missing)} missing; pass cu_seqlens_q, "
                "cu_seqlens_k, max_seqlen_q, max_seqlen_k, or metadata=VarlenMetadata(...) built once per step."
            )
        validate = True if validate is None else validate
        cu_q, cu_k, cu_q_padded, cu_k_padded = boundaries
        return implicit(cu_q, cu_k, *limits, cu_q_padded, cu_k_padded, q.shape[0], k.shape[0], validate, q.device)
    if not isinstance(metadata, VarlenMetadata):
        raise TypeError(
            f"metadata must be a varlen_workbench.kernels.varlen.VarlenMetadata, got {type(metadata).__name__}; build one per step with "
            "VarlenMetadata(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)."
        )
    given = [n for n, b in zip(_BOUNDARY_NAMES, (*boundaries, *limits)) if b is not None]
    if given or validate is not None:
        given += ["validate"] if validate is not None else []
        raise ValueError(
            f"varlen_attention got metadata= and {', '.join(given)}: the metadata already holds the boundaries and "
            "whether they are validated; pass one or the other (build the VarlenMetadata with the values you meant)."
        )
    metadata.check_call(q, k)
    return metadata


_BOUNDARY_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_q_padded", "cu_seqlens_k_padded", "max_seqlen_q", "max_seqlen_k")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    metadata: VarlenMetadata | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    validate: bool | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Attention over packed variable-length sequences, keeping the padding contract (docs/contract.md).

    Sequence i's real queries are rows [cu_seqlens_q_padded[i], cu_seqlens_q_padded[i] + len_i)
    of q, len_i = cu_seqlens_q[i + 1] - cu_seqlens_q[i] (the padded boundaries default to
    cu_seqlens_q); the same for keys. Every other row is padding, and padding never influences
    a real row.

    The batch is described either positionally, as FlashAttention's varlen functions take it,
    or by ``metadata``, a `varlen_workbench.kernels.varlen.VarlenMetadata` built once per step and passed to every
    layer: checked once, then no host sync, no validation and no allocation for it per call
    (the object for training loops, kernels/varlen/metadata.py).

    Args:
        q: queries, (T_q, H, D).
        k, v: keys (T_k, H_kv, D) and values (T_k, H_kv, D_v); H % H_kv == 0 (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) real boundaries, (N + 1,), starting at 0.
        max_seqlen_q, max_seqlen_k: the longest real sequence of each side (only validated: the
            grid is bounded by the row counts, so no row goes unprocessed).
        cu_seqlens_q_padded, cu_seqlens_k_padded: where each sequence starts in memory, (N + 1,),
            for layouts with padding between sequences (THD with cu_seqlens_padded).
        metadata: the batch's `VarlenMetadata`, instead of the six arguments above.
        causal: a bool; True is ``window_size=(left, 0)``, bottom-right aligned.
        window_size: FlashAttention's ``(left, right)``, -1 = unbounded: query i of a sequence
            sees key j iff ``i + len_k - len_q - left <= j <= i + len_k - len_q + right``
            (bottom-right aligned when len_q != len_k). ``(-1, 0)`` is causal, ``(4096, 0)`` a
            causal sliding window. Key blocks wholly outside the window are skipped.
        scale: softmax scale, 1/sqrt(D) by default. ``softmax_scale``: the same, by
            FlashAttention's name (pass one of them).
        return_lse: return ``(out, lse)`` instead of ``out``.
        validate: (positional calls) check the boundary values too (docs/contract.md,
            Validation); a malformed call raises before it returns. Natively a kernel checks
            them on the GPU, and the call waits for its verdict once per new boundary tensors:
            the same, unmodified tensors passed again (the layers of one step) share that check.
            False keeps only the checks that need no look at the values, for CUDA graphs and
            ``torch.compile(fullgraph=True)``. A ``metadata`` object was validated (or not) when
            it was built, and says when its verdict is read.
        backend: which registered backend computes the call (`varlen_workbench.kernels.varlen.backends`).
            "auto" (the default): the registry's preferred one that can take the call. On CPU
            tensors that is "torch" (per-document SDPA keeping the contract) unless the Triton
            interpreter is asked for (`runtime.use_interpreter()`); on a GPU the faster of the
            Triton kernel and FA4 by the rule docs/contract.md (Backends) derives from the
            benchmark record, the Triton kernel where FA4 is missing or cannot take the call.
            "triton": ours (interpreted on CPU tensors). "torch": per-document SDPA, eager calls
            only. "fa4": FlashAttention-4 (the
            optional extra ``fa4``) with the contract kept by a thin wrapper
            (kernels/varlen/fa4.py); a call it cannot express is refused with the reason. FA4
            runs a call eagerly on an sm90 or sm100 GPU, float16/bfloat16, the head dims it
            compiles, int32 boundaries, validated metadata (FA4 bounds its work by max_seqlen)
            and no gradient through lse.

    Returns:
        out (T_q, H, D_v) in q's dtype, exactly 0 on padding rows and on rows that see no key;
        with ``return_lse``, also lse (H, T_q) float32 (flash-attn's varlen layout), -inf on
        those rows. Gradients of q, k, v are exactly 0 on padding rows, never NaN. (A
        ``metadata`` whose device check finds the batch malformed: NaN until its error is raised.)

    Shape legend:
        N: sequences in the batch; T_q, T_k: rows of q and of k/v (real rows plus any padding);
        H: query heads; H_kv: key/value heads; D, D_v: head dims of q/k and of v, each a multiple
        of 8 up to 256 (D_v = D but for DeepSeek-style attention, e.g. 192 and 128);
        dtypes float32, float16, bfloat16.

    Example::

        >>> import torch
        >>> from varlen_workbench.kernels._compat import default_device
        >>> from varlen_workbench.kernels.varlen import varlen_attention
        >>> device = default_device()
        >>> lengths = torch.tensor([5, 3])
        >>> cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(device)
        >>> q, k, v = (torch.randn(8, 2, 16, device=device) for _ in range(3))
        >>> out = varlen_attention(q, k, v, cu, cu, 5, 5, window_size=(2, 0))
        >>> out.shape
        torch.Size([8, 2, 16])
    """
    check_causal(causal)
    left, right = check_window_size(window_size)
    check_backend(backend)
    scale = _one_scale(scale, softmax_scale)
    check_varlen_tensors(q, k, v, dtypes=DTYPES, head_dims=HEAD_DIMS)
    boundaries = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
    check_kernel_device("q", q)  # before the metadata, whose construction may launch a kernel on q's device
    positional = metadata is None
    metadata = _metadata_of(q, k, boundaries, (max_seqlen_q, max_seqlen_k), metadata, validate)
    if not positional:
        metadata.raise_if_reported()  # a malformed batch the device has reported: raised, no wait
    mask = (causal, check_scale(scale, q.shape[-1]), left, right)
    call = Call(q, k, v, metadata, *mask, return_lse, _eager())  # eager asked once: it reads compile and mode state
    out, lse = choose(backend, call).run(call)
    if positional:
        metadata.check()  # a positional call raises before it returns (one wait per new metadata)
    return (out, lse) if return_lse else out


def auto_backend(device: str | torch.device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 64, causal: bool = True) -> str:
    """The backend `backend="auto"` runs an eager call of one 64-row sequence on, in this process:
    "torch" on CPU tensors unless the Triton interpreter is asked for (then "triton"); on a GPU the
    registry's preference (the Triton kernel, or FlashAttention-4 where the contract's rule says).
    Longer GPU calls may go elsewhere by that rule; on the CPU every eager call goes here."""
    rows = 64
    q = torch.zeros(rows, 2, head_dim, device=device, dtype=dtype)
    cu = torch.tensor([0, rows], dtype=torch.int32, device=device)
    metadata = VarlenMetadata(cu, cu, rows, rows, total_q=rows, total_k=rows)
    return choose("auto", Call(q, q, q, metadata, causal, head_dim**-0.5, -1, 0 if causal else -1, False, True)).name


@cached
def pinned(backend: str) -> Callable:
    """`varlen_attention` with `backend` fixed, one object per name: `varlen_attention_<backend>`
    of `varlen_workbench.kernels.varlen`, the audit's `ours-<backend>` target."""
    check_backend(backend)
    call = functools.partial(varlen_attention, backend=backend)
    # Named as it is imported, so that probes and the audit name it and find it again by "module:name".
    call.__name__ = call.__qualname__ = f"varlen_attention_{backend}"  # type: ignore[attr-defined]
    call.__module__ = "varlen_workbench.kernels.varlen"
    return call


class AuxRequest(NamedTuple):
    """Which auxiliary outputs `varlen_attn` returns (torch.nn.attention.varlen.AuxRequest's fields)."""

    lse: bool = False


@cached
def _torch_varlen_parameters() -> frozenset[str]:
    """The parameters of the installed torch's `varlen_attn` (none where it has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn as torch_varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(torch_varlen_attn).parameters)


# What torch's varlen_attn takes that the fixed kernel cannot honour, and why.
_REFUSED = {
    "seqused_k": "KV-cache decoding (inference-only in torch too)",
    "block_table": "paged KV caches",
    "num_splits": "split-KV scheduling (it never splits a sequence's keys)",
}


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: AuxRequest | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch's `torch.nn.attention.varlen.varlen_attn` (2.11 to 2.13), same signature and return
    convention, on the fixed kernel: the fix is one import away::

        from varlen_workbench.kernels.varlen import varlen_attn  # instead of: from torch.nn.attention.varlen import varlen_attn

    Returns out (T_q, H, D), or (out, lse) with lse (H, T_q) float32 when `return_aux.lse`
    (torch's own AuxRequest works too). `window_size=(-1, 0)` is causal. Unlike torch's, rows
    of q past cu_seq_q[-1] (trailing padding) come back exactly 0 with zero gradients.
    `enable_gqa` as the installed torch has it: where its varlen_attn takes the flag (2.13),
    fewer key/value heads than query heads need ``enable_gqa=True``; where it has none (2.11),
    GQA needs no flag. The paged-cache and decoding keywords (`seqused_k`, `block_table`,
    `num_splits`) are refused with the reason. Metadata is validated when eager
    (`varlen_attention`'s ``validate=True``); inside `torch.compile` or CUDA graph capture only
    the checks that need no look at the values run.
    """
    for name, value_ in (("seqused_k", seqused_k), ("block_table", block_table), ("num_splits", num_splits)):
        if value_ is not None:
            raise ValueError(
                f"varlen_attn got {name}: the fixed kernel does not do {_REFUSED[name]}; call torch's "
                f"torch.nn.attention.varlen.varlen_attn for that, or leave {name} unset."
            )
    if cu_seq_k is None:
        raise ValueError(
            "varlen_attn got cu_seq_k=None, which torch allows only with a paged KV cache (block_table); pass the "
            "keys' boundaries, (N + 1,) int32."
        )
    _check_gqa_flag(query, key, enable_gqa)
    want_lse = return_aux is not None and bool(return_aux.lse)
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
        validate=not (torch.compiler.is_compiling() or capturing()),
    )


def _check_gqa_flag(query: object, key: object, enable_gqa: bool) -> None:
    """A torch whose varlen_attn has enable_gqa refuses fewer key/value heads than query heads without it."""
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__} {enable_gqa!r}; pass True or False.")
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == key.dim() == 3):
        return  # varlen_attention names what is wrong with them
    if not enable_gqa and query.shape[1] != key.shape[1] and "enable_gqa" in _torch_varlen_parameters():
        raise ValueError(
            f"query has {query.shape[1]} heads and key/value {key.shape[1]}: torch {torch.__version__}'s varlen_attn "
            "takes grouped-query attention only with enable_gqa=True; pass enable_gqa=True."
        )
