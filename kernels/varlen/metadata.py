"""`VarlenMetadata`: the boundaries of one packed batch, checked once and shared by every
attention call of a step.

A model calls attention once per layer on the same batch, so what depends on the batch alone is
built once per step and reused, as FlashAttention-4's scheduler metadata and FlexAttention's
BlockMask are. The object holds:

- the boundaries, real and padded (`cu_seqlens_*`, `cu_seqlens_*_padded`), the longest real
  sequence of each side (`max_seqlen_*`) and the row counts of q and of k (`total_*`);
- the check of the boundary values, and any error it finds (`check()`);
- what the kernels read: the boundaries they run on (natively the device check's safe copy),
  the work lists of both sides, and whether any row is padding (a padding fill to launch);
- the layout the FA4 backend needs (real rows per side, `seqused` where GAP rows lie).

After the first call on it, a call makes no host sync, no validation and no allocation for
metadata. Where the boundary values are checked depends on where they live when it is built:

- **host memory** (CPU tensors, as a collator makes them; `device=` names where the kernels
  run, and the boundaries are copied there once, without a sync): the host check, at once and
  for free: a malformed batch raises in the constructor;
- **CUDA memory, eagerly**: a kernel checks them on the device (kernels/varlen/device_check.py)
  and the object waits for nothing. Its verdict is read once, at the first of: `check()`, a
  call on the FA4 backend (which needs the layout read with it), and the backward of a call on
  the object, before that backward returns any gradient. Until then every call on the object
  raises the error if the device has already reported it (asked without waiting), and the
  outputs of calls on a malformed batch are NaN, never zeros that could pass for a result;
- **traced** (`torch.compile`, a dispatch mode) or under the CPU interpreter: the host check.

`validate=False` checks only what needs no look at the values (kinds, shapes, devices): for CUDA
graphs and `torch.compile(fullgraph=True)`.

The FlashAttention-style positional call (`varlen_attention(q, k, v, cu_seqlens_q, ...)`) builds
one implicitly and reads its verdict before it returns; `implicit` keeps the last one it built,
so that positional calls on the same unmodified tensors (the layers of one step) share it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from varlen_workbench.kernels.contract import check_cu_seqlens, check_cu_seqlens_tensors, check_max_seqlen
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen.device_check import DeviceCheck, SafeLayout, check_on_device

Boundaries = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Given = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # the padded ones optional


def eager() -> bool:
    """Nothing traces the call: no torch.compile, no dispatch mode."""
    return not torch.compiler.is_compiling() and _current_dispatch_mode() is None


@functools.cache
def _cuda() -> bool:
    """Whether torch has CUDA, asked once (microseconds a call otherwise, on every layer)."""
    return torch.cuda.is_available()


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream: no wait, no query is allowed."""
    return _cuda() and torch.cuda.is_current_stream_capturing()


def checks_on_device(boundary: torch.Tensor) -> bool:
    """Whether the boundary values are checked by a kernel where they live: compiled and eagerly.
    Where the kernels are interpreted they are host memory (or copied there), and a traced call
    keeps the host check.
    A capture allows no check (it would need a wait): a clear error."""
    if capturing():
        raise ValueError(
            "validate=True checks the boundary values, which waits on the device, and a CUDA graph capture allows no "
            "wait; build the VarlenMetadata before capturing, or pass validate=False inside the capture."
        )
    return not interpreted(boundary.device) and eager()


class Fa4Layout(NamedTuple):
    """What FA4 is told of a batch, per side: how many leading rows hold every real row
    (`cu_seqlens[-1]`), and FA4's `seqused` (the real rows of each padded slot) where padding
    lies between sequences (GAP rows), None where none does."""

    real_q: int
    real_k: int
    seqused_q: torch.Tensor | None
    seqused_k: torch.Tensor | None


_NOT_BOUND = "not bound yet"


class VarlenMetadata:
    """The boundaries of one packed batch, checked once, for every attention call of a step.

    Args:
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) real boundaries, (N + 1,), starting at 0.
        max_seqlen_q, max_seqlen_k: the longest real sequence of each side (Python ints).
        cu_seqlens_q_padded, cu_seqlens_k_padded: where each sequence starts in memory, for
            layouts with padding between sequences; default: the real boundaries.
        total_q, total_k: the rows of q and of k/v the batch lives in (real rows plus any
            padding). Default: bound by the first call, from its q and k.
        validate: check the boundary values (the module docstring says where and when).
        device: where the kernels run, when the boundaries are given in host memory: they are
            checked there, then copied to `device` once. Default: the boundaries' device.

    Example::

        >>> import torch
        >>> from varlen_workbench.kernels.varlen import VarlenMetadata, varlen_attention
        >>> from varlen_workbench.kernels._compat import default_device
        >>> cu = torch.tensor([0, 5, 8], dtype=torch.int32)  # host memory, as a collator makes it
        >>> metadata = VarlenMetadata(cu, cu, 5, 5, total_q=8, total_k=8, device=default_device())
        >>> q, k, v = (torch.randn(8, 2, 16, device=default_device()) for _ in range(3))
        >>> out = varlen_attention(q, k, v, metadata=metadata, causal=True)  # every layer of the step
        >>> out.shape
        torch.Size([8, 2, 16])
    """

    def __init__(
        self,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_k_padded: torch.Tensor | None = None,
        total_q: int | None = None,
        total_k: int | None = None,
        validate: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        check_cu_seqlens_tensors(
            cu_seqlens_q,
            cu_seqlens_k,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_k_padded=cu_seqlens_k_padded,
            device=cu_seqlens_q.device if isinstance(cu_seqlens_q, torch.Tensor) else None,
        )
        self.max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, "cu_seqlens_q")
        self.max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, "cu_seqlens_k")
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be a bool, got {type(validate).__name__} {validate!r}; pass True or False.")
        self.validate = validate
        self.given: Given = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
        self.device = _kernel_device(device) if device is not None else cu_seqlens_q.device
        self.total_q: int | None = None
        self.total_k: int | None = None
        # set by _bind: what the kernels run on, and what is known of the batch
        self._boundaries: Boundaries | None = None  # on self.device: the safe copy natively
        # the work lists of both sides (launch.work_lists' layout): the device check's own, or
        # those the first eager call makes (a traced call makes its own, inside the op)
        self.work: torch.Tensor | None = None
        self.device_check: DeviceCheck | None = None
        self._layout: SafeLayout | None = None  # once known: from the host values, or read with the verdict
        self._padding: bool | None = None  # whether q or k has a row that is not real, once known
        self._fa4: Fa4Layout | None = None
        if (total_q is None) != (total_k is None):
            raise ValueError(
                f"pass both total_q and total_k (the rows of q and of k), or neither to bind them at the first call; "
                f"got total_q={total_q!r}, total_k={total_k!r}."
            )
        if total_q is not None:
            self._bind(_rows("total_q", total_q), _rows("total_k", total_k))

    # -- the boundaries the kernels read ---------------------------------------------------------

    @property
    def boundaries(self) -> Boundaries:
        """(cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded) as the kernels
        read them, on `device`: natively the device check's safe copy; absent padded boundaries
        stand as the real ones."""
        if self._boundaries is None:
            raise RuntimeError(
                "this VarlenMetadata has no row counts yet: pass total_q and total_k when building it, or use it in a "
                "varlen_attention call first (which binds them to its q and k)."
            )
        return self._boundaries

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        return self.boundaries[0]

    @property
    def cu_seqlens_k(self) -> torch.Tensor:
        return self.boundaries[1]

    @property
    def cu_seqlens_q_padded(self) -> torch.Tensor:
        return self.boundaries[2]

    @property
    def cu_seqlens_k_padded(self) -> torch.Tensor:
        return self.boundaries[3]

    def _bind(self, total_q: int, total_k: int) -> None:
        """Fixes the row counts, checks the boundary values (or launches their check), and makes
        what the kernels read."""
        self.total_q, self.total_k = total_q, total_k
        q, k, q_padded, k_padded = self.given
        if q.device.type == "cpu" and self.device.type != "cpu":
            # host memory: checked for free, then copied where the kernels run, without a sync
            if self.validate:
                self._check_on_host()
            q, k = (t.to(self.device, non_blocking=True) for t in (q, k))
            q_padded, k_padded = (None if t is None else t.to(self.device, non_blocking=True) for t in (q_padded, k_padded))
        elif self.validate and checks_on_device(q):
            limits = (total_q, total_k, self.max_seqlen_q, self.max_seqlen_k)
            self._boundaries, self.device_check = check_on_device(q, k, q_padded, k_padded, *limits)
            self.work = self.device_check.work
            return
        elif self.validate:
            self._check_on_host()
        self._boundaries = (q, k, q if q_padded is None else q_padded, k if k_padded is None else k_padded)

    def _check_on_host(self) -> None:
        """The host check (it raises the contract's error); the layout comes with it."""
        q, k, q_padded, k_padded = self.given
        lengths_q, lengths_k = check_cu_seqlens(
            q,
            k,
            self.max_seqlen_q,
            self.max_seqlen_k,
            cu_seqlens_q_padded=q_padded,
            cu_seqlens_k_padded=k_padded,
            total_q=self.total_q,
            total_k=self.total_k,
        )
        real_q, real_k = sum(lengths_q), sum(lengths_k)
        gaps = [padded is not None and not torch.equal(padded, real) for real, padded in ((q, q_padded), (k, k_padded))]
        self._layout = SafeLayout(real_q, real_k, *gaps)
        self._padding = real_q != self.total_q or real_k != self.total_k

    # -- what a call on it needs -----------------------------------------------------------------

    def bind(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Binds the row counts at the first call, or checks that a call's q and k have them."""
        if self.total_q is None:
            self._bind(q.shape[0], k.shape[0])
            return
        if (q.shape[0], k.shape[0]) != (self.total_q, self.total_k):
            raise ValueError(
                f"this VarlenMetadata describes q of {self.total_q} rows and k of {self.total_k}, but the call passes q of "
                f"{q.shape[0]} and k of {k.shape[0]}; build one VarlenMetadata per batch layout."
            )
        if q.device != self.device:
            raise ValueError(f"this VarlenMetadata lives on {self.device} but q is on {q.device}; build it with device=q.device.")

    def raise_if_reported(self) -> None:
        """Raises the check's error if the device has already reported it: never waits."""
        check = self.device_check
        if check is not None and not capturing() and check.done() and check.failed():
            check.raise_if_failed(_REPORTED)

    def check(self) -> VarlenMetadata:
        """Waits for the check of the boundary values (once: its verdict is kept) and raises its
        error if they are malformed; returns the object. Nothing to wait for after the host check
        or with validate=False."""
        if self.device_check is not None:
            self.device_check.raise_if_failed()
        return self

    def read_in_backward(self) -> None:
        """The backward of a call on the object: reads the verdict (one wait per object) and raises
        before any gradient leaves. Not while a CUDA graph is captured, which allows no wait."""
        if self.device_check is not None and not capturing():
            self.device_check.raise_if_failed(_BACKWARD)

    @property
    def verdict(self) -> torch.Tensor | None:
        """The device check's verdict on the device (non-zero first entry: malformed), which the
        padding fills read to write NaN instead of zeros; None without a device check."""
        return None if self.device_check is None else self.device_check.device_verdict

    def padding_to_fill(self) -> bool:
        """Whether padding rows may exist: False once the batch is known, without a wait, to make
        every row of q and k real (an unpadded batch: no fill to launch)."""
        if self._padding is not None:
            return self._padding
        check = self.device_check
        return check is None or capturing() or not check.all_rows_real()

    def has_gaps(self) -> tuple[bool, bool] | None:
        """Whether GAP rows lie between the sequences of q, of k: known without a wait where no
        padded boundaries were given, or after the host check or the read verdict; else None."""
        if self.given[2] is None and self.given[3] is None:
            return (False, False)
        layout = self._known_layout()
        return None if layout is None else (layout.gap_q, layout.gap_k)

    def _known_layout(self) -> SafeLayout | None:
        if self._layout is None and self.device_check is not None and self.device_check.outcome is not None:
            self._layout = self.device_check.layout()
        return self._layout

    def fa4_layout(self) -> Fa4Layout:
        """The layout FA4 is told, built once: from the host check, or read with the device check's
        verdict (`check()` has read it). FA4 runs on validated batches only (`fa4.unsupported`)."""
        if self._fa4 is None:
            layout = self._known_layout()
            if layout is None:
                raise RuntimeError("fa4_layout() of a batch whose check is unread or absent: call check() first")
            q, k = self.boundaries[:2]
            self._fa4 = Fa4Layout(
                layout.real_q,
                layout.real_k,
                _real_lengths(q) if layout.gap_q else None,
                _real_lengths(k) if layout.gap_k else None,
            )
        return self._fa4

    def __repr__(self) -> str:
        state = _NOT_BOUND if self.total_q is None else f"total_q={self.total_q}, total_k={self.total_k}"
        sequences = self.given[0].numel() - 1
        check = "host check passed" if self._layout is not None and self.device_check is None else ""
        if self.device_check is not None:
            check = (
                "device check pending"
                if self.device_check.outcome is None
                else ("device check failed" if self.device_check.outcome else "device check passed")
            )
        elif not self.validate:
            check = "not validated"
        return (
            f"VarlenMetadata({sequences} sequences, max_seqlen_q={self.max_seqlen_q}, max_seqlen_k={self.max_seqlen_k}, "
            f"{state}, {check or 'unchecked'}, on {self.device})"
        )


_REPORTED = "a VarlenMetadata whose boundaries are malformed (its check ran on the device, read at this later call): "
_BACKWARD = "the backward of a varlen_attention call whose metadata is malformed (its check ran on the device, read here): "


def _kernel_device(device: torch.device | str) -> torch.device:
    """`device=` as the kernels run there, with its index: "cuda" is the current CUDA device, where
    `.to("cuda")` puts tensors (q says "cuda:0", and the two must compare equal). CUDA where torch
    has none is refused here, with what to pass, rather than by torch's own assertion."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc}); pass 'cuda' or 'cpu'.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r}, but torch {torch.__version__} sees no CUDA device here; pass device='cpu' (the "
            "kernels then run through Triton's interpreter) or device=q.device."
        )
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _rows(name: str, value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise TypeError(f"{name} must be a non-negative Python int (a row count), got {value!r}; pass q.shape[0] / k.shape[0].")
    return int(value)


def _real_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)


class Memo:
    """One value kept for the very same caller tensors, unmodified, and the same other arguments:
    a match needs the same tensor objects (weak references: a freed tensor never matches, even
    if a new one gets its memory), each with the version counter it had (an in-place write bumps
    it). A write that bypasses torch's version counter (a raw kernel writing into the tensor's
    memory) is not seen: build a new VarlenMetadata for new boundary values."""

    def __init__(self) -> None:
        self.refs: tuple = ()
        self.versions: tuple = ()
        self.extra: Any = None
        self.value: Any = None

    def get(self, tensors: Sequence[torch.Tensor | None], extra: Any, build: Callable[[], Any]) -> Any:
        if self._holds(tensors, extra):
            return self.value
        value = build()
        self.refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self.versions = tuple(None if t is None else t._version for t in tensors)
        self.extra, self.value = extra, value
        return value

    def _holds(self, tensors: Sequence[torch.Tensor | None], extra: Any) -> bool:
        if self.value is None or len(self.refs) != len(tensors) or self.extra != extra:
            return False
        for ref, t, version in zip(self.refs, tensors, self.versions):
            if (ref is None) != (t is None):
                return False
            if t is not None and (not isinstance(t, torch.Tensor) or ref() is not t or t._version != version):
                return False
        return True


# The one memo of this module: the last metadata built for a positional call or for the
# transformers swap (kernels/hf.py), keyed on the tensors the caller handed over.
LAST = Memo()


def implicit(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Any,  # checked by the constructor, which names a wrong kind
    max_seqlen_k: Any,
    cu_seqlens_q_padded: torch.Tensor | None,
    cu_seqlens_k_padded: torch.Tensor | None,
    total_q: int,
    total_k: int,
    validate: bool,
    device: torch.device,
) -> VarlenMetadata:
    """The metadata of a positional call on q's `device`: the last one built, for the same
    unmodified tensors and arguments, or a new one. The boundaries must live on q's device (the
    contract): a positional call copies nothing."""
    tensors = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
    check_cu_seqlens_tensors(
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_k_padded=cu_seqlens_k_padded,
        device=device,
    )
    extra = ("positional", max_seqlen_q, max_seqlen_k, total_q, total_k, validate)

    def build() -> VarlenMetadata:
        return VarlenMetadata(
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_k_padded=cu_seqlens_k_padded,
            total_q=total_q,
            total_k=total_k,
            validate=validate,
        )

    if not eager() or not all(isinstance(t, torch.Tensor) for t in tensors[:2]):
        # traced: the graph holds no memo; not tensors: the constructor names the mistake
        return build()
    return LAST.get(tensors, extra, build)
