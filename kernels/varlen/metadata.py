"""`VarlenMetadata`: the boundaries of one packed batch, checked once and shared by every
attention call of a step.

A model calls attention once per layer on the same batch, so what depends on the batch alone is
built once per step and reused, as FlashAttention-4's scheduler metadata and FlexAttention's
BlockMask are. The object is whole when it is built, and nothing is written onto it afterwards:

- the boundaries, real and padded (`cu_seqlens_*`, `cu_seqlens_*_padded`), the longest real
  sequence of each side (`max_seqlen_*`) and the row counts of q and of k (`total_*`: required,
  or read off q and k by `VarlenMetadata.for_tensors`). A call on q or k of other row counts, or
  on another device, is refused with both sizes (`check_call`);
- the check of the boundary values, and any error it finds (`check()`);
- what the kernels read: the boundaries they run on (natively the device check's safe copy),
  the work lists of both sides (`work`), and whether any row is padding (a padding fill to launch).

A call on it makes no host sync, no validation and no allocation for metadata. Where the
boundary values are checked depends on where they live when it is built:

- **host memory** (CPU tensors, as a collator makes them; `device=` names where the kernels
  run, and the boundaries are copied there once, without a sync): the host check, at once and
  for free: a malformed batch raises in the constructor;
- **CUDA memory, eagerly**: a kernel checks them on the device (kernels/varlen/device_check.py)
  and the object waits for nothing. Its verdict is a handle the object owns (`device_check`),
  read only at these points: `check()` (which the FA4 and torch backends call, as they need
  the verdict before they run), the backward of a call on the object (before it returns any
  gradient), and the next call on the object (which raises the error if the device has already
  reported it, asked without waiting). The outputs of calls on a malformed batch are NaN, never
  zeros that could pass for a result;
- **traced** (`torch.compile`, a dispatch mode) or under the CPU interpreter: the host check.

The work lists are the device check's own (it writes them); else a launch at construction
natively. Under the interpreter (a launch there costs tens of milliseconds of host time, which
the CPU's default backend never needs) and when built inside a trace there are none: each call
on the Triton backend makes its own, inside the op.

What a backend derives from the object (FA4's layout: kernels/varlen/fa4.py `fa4_layout`) is
built by that backend and kept per backend and per object in kernels/caches.py (`derived`),
never on the object.

`validate=False` checks only what needs no look at the values (kinds, shapes, devices): for CUDA
graphs and `torch.compile(fullgraph=True)`.

The FlashAttention-style positional call (`varlen_attention(q, k, v, cu_seqlens_q, ...)`) builds
one implicitly (`implicit`) and reads its verdict before it returns; `caches.LAST` keeps the last
one it built, so that positional calls on the same unmodified tensors (the layers of one step)
share it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from varlen_workbench.kernels import caches
from varlen_workbench.kernels.caches import cached
from varlen_workbench.kernels.contract import check_cu_seqlens, check_cu_seqlens_tensors, check_max_seqlen
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen.device_check import DeviceCheck, SafeLayout, check_on_device
from varlen_workbench.kernels.varlen.launch import work_lists

Boundaries = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Given = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # the padded ones optional


def eager() -> bool:
    """Nothing traces the call: no torch.compile, no dispatch mode."""
    return not torch.compiler.is_compiling() and _current_dispatch_mode() is None


@cached
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


class VarlenMetadata:
    """The boundaries of one packed batch, checked once, for every attention call of a step.

    Args:
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) real boundaries, (N + 1,), starting at 0.
        max_seqlen_q, max_seqlen_k: the longest real sequence of each side (Python ints).
        total_q, total_k: the rows of q and of k/v the batch lives in (real rows plus any
            padding): `q.shape[0]` and `k.shape[0]`, which `for_tensors` reads for you.
        cu_seqlens_q_padded, cu_seqlens_k_padded: where each sequence starts in memory, for
            layouts with padding between sequences; default: the real boundaries.
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
        total_q: int,
        total_k: int,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_k_padded: torch.Tensor | None = None,
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
        self.total_q, self.total_k = _rows("total_q", total_q), _rows("total_k", total_k)
        self.given: Given = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
        self.device = _kernel_device(device) if device is not None else cu_seqlens_q.device
        if self.device.type not in ("cpu", "cuda") and not interpreted(self.device):  # a kernel of it would launch there
            raise ValueError(
                f"this VarlenMetadata would live on {self.device}, but the kernels run on CUDA (compiled) or the CPU "
                "(through Triton's interpreter); build it from boundaries on one of those, or pass device='cuda' or 'cpu'."
            )
        self.device_check: DeviceCheck | None = None
        self._layout: SafeLayout | None = None  # from the host check; else read with the device verdict
        self._padding: bool | None = None  # whether q or k has a row that is not real, known from the host check
        q, k, q_padded, k_padded = self.given
        if q.device.type == "cpu" and self.device.type != "cpu":
            # host memory: checked for free, then copied where the kernels run, without a sync
            if validate:
                self._check_on_host()
            q, k = (t.to(self.device, non_blocking=True) for t in (q, k))
            q_padded, k_padded = (None if t is None else t.to(self.device, non_blocking=True) for t in (q_padded, k_padded))
        elif validate and checks_on_device(q):
            limits = (self.total_q, self.total_k, self.max_seqlen_q, self.max_seqlen_k)
            safe, self.device_check = check_on_device(q, k, q_padded, k_padded, *limits)
        elif validate:
            self._check_on_host()
        if self.device_check is None:
            safe = (q, k, q if q_padded is None else q_padded, k if k_padded is None else k_padded)
        # what the kernels read: on `device`, natively the device check's safe copy
        self.boundaries: Boundaries = safe
        # the work lists of both sides (launch.work_lists' layout), or None: each Triton call makes its own
        self.work: torch.Tensor | None = (
            self.device_check.work
            if self.device_check is not None
            else (work_lists(safe[0], safe[1]) if eager() and not interpreted(self.device) else None)
        )

    @classmethod
    def for_tensors(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        **keywords: Any,
    ) -> VarlenMetadata:
        """The metadata of the batch that q and k hold: `total_q`, `total_k` are their row counts and
        `device` (unless given) q's device; the other keywords are the constructor's."""
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
            raise TypeError(
                f"VarlenMetadata.for_tensors reads the row counts off q and k, got {type(q).__name__} and "
                f"{type(k).__name__}; pass the tensors, or build VarlenMetadata(..., total_q=..., total_k=...)."
            )
        keywords.setdefault("device", q.device)
        return cls(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q=q.shape[0], total_k=k.shape[0], **keywords)

    # -- the boundaries the kernels read ---------------------------------------------------------

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

    def check_call(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Refuses a call whose q and k are not those it was built for: other row counts, another device."""
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
        layout = self.known_layout()
        return None if layout is None else (layout.gap_q, layout.gap_k)

    def known_layout(self) -> SafeLayout | None:
        """The layout of the boundaries the kernels read (real rows per side, GAP rows or not),
        once known without a wait: from the host check, or from the device check's read verdict
        (`check()` reads it); else None."""
        check = self.device_check
        if self._layout is None and check is not None and check.outcome is not None:
            return check.layout()
        return self._layout

    def __repr__(self) -> str:
        sequences = self.given[0].numel() - 1
        check = "host check passed" if self._layout is not None else ""
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
            f"total_q={self.total_q}, total_k={self.total_k}, {check or 'unchecked'}, on {self.device})"
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
    return caches.LAST.get(tensors, extra, build)
