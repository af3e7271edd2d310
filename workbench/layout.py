"""The packed-batch model: a `Case` describes a packed (THD) batch, `pack` materialises it.

A packed batch stores B sequences back to back in one (T, H, D) tensor. Two boundary
vectors describe it (TransformerEngine's convention, adopted by our kernel):

* `cu_seqlens` — REAL token boundaries, used for masking;
* `cu_seqlens_padded` — memory-layout boundaries: sequence i occupies rows
  `[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`, of which the first `len_i` are real.

Every other row is padding: GAP rows (after a sequence's real end, before the next padded
start) and TAIL rows (from `cu_seqlens_padded[-1]` to T, the rows of the torch bug).
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.contract import check_window_size

if TYPE_CHECKING:
    from varlen_workbench.kernels.varlen import VarlenMetadata


class Region(enum.IntEnum):
    """What a row of a packed tensor is."""

    REAL = 0
    GAP = 1
    TAIL = 2


class Fill(str, enum.Enum):
    """What padding rows of q, k, v hold. Real bugs see every one of these."""

    ZEROS = "zeros"
    NAN = "nan"
    POS_INF = "+inf"
    NEG_INF = "-inf"
    HUGE = "huge"  # the dtype's largest finite value: overflows any product
    GARBAGE = "garbage"  # random values of magnitude ~1e4 with random signs (stale activations)

    @classmethod
    def _missing_(cls, value: object) -> Fill:
        names = ", ".join(repr(f.value) for f in cls)
        raise ValueError(f"{value!r} is not a padding fill; choose one of {names} (or Fill.NAN etc.).")

    def values(self, shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
        """A CPU tensor of `shape` filled the way this kind of padding is."""
        if self is Fill.GARBAGE:
            return torch.randn(shape, generator=generator, dtype=torch.float32).mul_(1e4).to(dtype)
        constant = {
            Fill.ZEROS: 0.0,
            Fill.NAN: math.nan,
            Fill.POS_INF: math.inf,
            Fill.NEG_INF: -math.inf,
            Fill.HUGE: torch.finfo(dtype).max,
        }[self]
        return torch.full(shape, constant, dtype=dtype)


# The dtypes a Case can name, by name (float64: the oracle's own cases).
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Case:
    """A packed batch, described well enough to rebuild it bit for bit.

    Padded lengths come from `padded_q`/`padded_k` (explicit, per sequence) or from
    `align` (each sequence rounded up to a multiple, as FP8 alignment padding does);
    with neither, sequences are packed back to back. `tail_q`/`tail_k` add TAIL rows after
    the last padded end. `seqlens_k=None` means self-attention lengths (= seqlens_q).
    `head_dim` is q's and k's; `head_dim_v` v's (and the output's), None meaning the same
    (DeepSeek-style attention has 192 and 128).
    `window` is FlashAttention's `window_size=(left, right)`, -1 = unbounded (`(-1, -1)`: no
    window); `causal=True` bounds its right side at 0, as in `varlen_workbench.kernels.varlen.varlen_attention`.
    """

    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...] | None = None
    padded_q: tuple[int, ...] | None = None
    padded_k: tuple[int, ...] | None = None
    align: int | None = None
    tail_q: int = 0
    tail_k: int = 0
    heads: int = 2
    kv_heads: int | None = None
    head_dim: int = 32
    head_dim_v: int | None = None
    dtype: str = "float32"
    causal: bool = False
    seed: int = 0
    fill: Fill = Fill.NAN
    window: tuple[int, int] = (-1, -1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seqlens_q", tuple(int(n) for n in self.seqlens_q))
        try:  # a JSON list from a record becomes the tuple again
            object.__setattr__(self, "window", check_window_size(self.window))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"Case.window = {self.window!r}: {exc}") from None
        for name in ("seqlens_k", "padded_q", "padded_k"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(n) for n in value))
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        object.__setattr__(self, "fill", Fill(self.fill))
        self._validate()

    def _validate(self) -> None:
        if not self.seqlens_q:
            raise ValueError("Case.seqlens_q is empty; give at least one sequence length.")
        for name in ("seqlens_q", "seqlens_k", "padded_q", "padded_k"):
            value = getattr(self, name)
            if value is None:
                continue
            if len(value) != len(self.seqlens_q):
                raise ValueError(
                    f"Case.{name} has {len(value)} entries but seqlens_q has {len(self.seqlens_q)}; give one per sequence."
                )
            bad = [i for i, n in enumerate(value) if n < 0]
            if bad:
                raise ValueError(f"Case.{name}[{bad[0]}] = {value[bad[0]]} is negative.")
        for side in ("q", "k"):
            padded, real = getattr(self, f"padded_{side}"), self.real_lengths(side)
            if padded is not None:
                for i, (n, p) in enumerate(zip(real, padded)):
                    if n > p:
                        raise ValueError(
                            f"Case.padded_{side}[{i}] = {p} is shorter than the real length "
                            f"{n}; a padded length must be >= the real one."
                        )
        if self.align is not None and self.align < 1:
            raise ValueError(f"Case.align = {self.align} must be a positive row count (e.g. 16).")
        if self.tail_q < 0 or self.tail_k < 0:
            raise ValueError("Case.tail_q and Case.tail_k count rows and must be >= 0.")
        for name in ("head_dim", "head_dim_v"):
            value = getattr(self, name)
            if name == "head_dim_v" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Case.{name} = {value!r} must be a positive int: the features per head (e.g. 16, 32, 64).")
        kv = self.kv_heads or self.heads
        if self.heads < 1 or self.heads % kv:
            raise ValueError(f"Case.heads = {self.heads} must be a positive multiple of kv_heads = {kv}.")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"Case.dtype = {self.dtype!r} is not one of {sorted(DTYPE_NAMES)}.")

    # -- derived layout -------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.seqlens_q)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_NAMES[self.dtype]

    def real_lengths(self, side: str) -> tuple[int, ...]:
        if side == "q" or self.seqlens_k is None:
            return self.seqlens_q
        return self.seqlens_k

    def padded_lengths(self, side: str) -> tuple[int, ...]:
        explicit = self.padded_q if side == "q" else self.padded_k
        if explicit is not None:
            return explicit
        real = self.real_lengths(side)
        if self.align is None:
            return real
        return tuple(-(-n // self.align) * self.align for n in real)

    def total_rows(self, side: str) -> int:
        return sum(self.padded_lengths(side)) + (self.tail_q if side == "q" else self.tail_k)

    @property
    def value_head_dim(self) -> int:
        """v's head dim (and the output's)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def windowed(self) -> bool:
        """The case has a window: its calls pass `window_size`."""
        return self.window != (-1, -1)

    def with_(self, **changes: Any) -> Case:
        """A copy with some fields changed (sweeps build grids this way)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description (records, sweeps, recorded GPU runs)."""
        d = asdict(self)
        d["fill"] = self.fill.value
        if not self.windowed:  # a windowless case's dict is the one records made before windows hold
            del d["window"]
        if self.head_dim_v is None:  # nor one head dim's, before v could have its own
            del d["head_dim_v"]
        return d

    def label(self) -> str:
        """A short human-readable name for tables and plot titles."""
        parts = [f"q={list(self.seqlens_q)}"]
        if self.seqlens_k is not None:
            parts.append(f"k={list(self.seqlens_k)}")
        if self.padded_q is not None or self.align is not None:
            parts.append(f"padded={list(self.padded_lengths('q'))}")
        if self.tail_q:
            parts.append(f"tail={self.tail_q}")
        parts.append(f"H={self.heads}" + (f"/{self.kv_heads}" if self.kv_heads else ""))
        parts.append(f"D={self.head_dim}" + (f"/{self.head_dim_v}" if self.head_dim_v is not None else ""))
        parts.append(self.dtype)
        if self.causal:
            parts.append("causal")
        if self.windowed:
            parts.append(f"window={self.window}")
        return " ".join(parts)


def cumulative(lengths: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """[0, l0, l0+l1, ...] as int32: the boundary vector of a list of lengths."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


def region_labels(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None, total_rows: int) -> torch.Tensor:
    """Region of every row (int8 CPU tensor): REAL, GAP or TAIL.

    Rows past `cu_seqlens_padded[-1]` (or `cu_seqlens[-1]` when there is no padded layout)
    are TAIL: legal memory the kernels must leave at exactly zero, not an error.
    """
    real = cu_seqlens.tolist()
    padded = real if cu_seqlens_padded is None else cu_seqlens_padded.tolist()
    labels = torch.full((total_rows,), Region.TAIL, dtype=torch.int8)
    for i in range(len(real) - 1):
        start, length = padded[i], real[i + 1] - real[i]
        labels[start : padded[i + 1]] = Region.GAP
        labels[start : start + length] = Region.REAL
    return labels


def real_rows(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None) -> torch.Tensor:
    """Row indices (int64, on cu_seqlens' device) of the real tokens of a padded layout, in order."""
    real = cu_seqlens.tolist()
    padded = real if cu_seqlens_padded is None else cu_seqlens_padded.tolist()
    index = [r for i in range(len(real) - 1) for r in range(padded[i], padded[i] + real[i + 1] - real[i])]
    return torch.tensor(index, dtype=torch.int64, device=cu_seqlens.device)


@dataclass
class PackedBatch:
    """A materialised `Case`: tensors and metadata in the contract's argument order."""

    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_k_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    regions_q: torch.Tensor = field(repr=False)
    regions_k: torch.Tensor = field(repr=False)

    def args(self) -> tuple:
        """Positional arguments of `varlen_attention` / `reference_attention`."""
        return (self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments: the padded layout, the case's causality and, only when it has one,
        its window (so functions without `window_size` still take a windowless batch)."""
        kwargs: dict[str, Any] = {
            "cu_seqlens_q_padded": self.cu_seqlens_q_padded,
            "cu_seqlens_k_padded": self.cu_seqlens_k_padded,
            "causal": self.case.causal,
        }
        if self.case.windowed:
            kwargs["window_size"] = self.case.window
        return kwargs

    def call(self, impl, **overrides: Any):
        """`impl(*args, **kwargs)` with this batch; `overrides` replace or add keywords."""
        return impl(*self.args(), **{**self.kwargs(), **overrides})

    def step_metadata(self, validate: bool = True) -> VarlenMetadata:
        """The batch's `varlen_workbench.kernels.varlen.VarlenMetadata`, as a training step builds it once for every layer."""
        from varlen_workbench.kernels.varlen import VarlenMetadata

        padded = {"cu_seqlens_q_padded": self.cu_seqlens_q_padded, "cu_seqlens_k_padded": self.cu_seqlens_k_padded}
        rows = {"total_q": self.q.shape[0], "total_k": self.k.shape[0]}
        return VarlenMetadata(
            self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k, **padded, **rows, validate=validate
        )

    def call_on(self, impl, metadata: VarlenMetadata, **overrides: Any):
        """`impl(q, k, v, metadata=metadata, **keywords)`: the batch described by its metadata."""
        keywords = {name: value for name, value in self.kwargs().items() if not name.startswith("cu_seqlens")}
        return impl(self.q, self.k, self.v, metadata=metadata, **{**keywords, **overrides})

    @property
    def device(self) -> torch.device:
        return self.q.device

    def inputs(self) -> dict[str, torch.Tensor]:
        return {"q": self.q, "k": self.k, "v": self.v}

    @property
    def out_shape(self) -> torch.Size:
        """The attention output's shape: q's rows and heads, v's head dim."""
        return torch.Size((*self.q.shape[:2], self.v.shape[2]))

    @property
    def dot_length(self) -> int:
        """`error_check`'s head_dim=: the longer of the call's dots over features, q.k (scores)
        and dO.v (dP); one head dim when v has q's."""
        return max(self.q.shape[2], self.v.shape[2])

    def reduction_lengths(self) -> dict[str, int]:
        """`error_check`'s keys= and queries=: the most keys one query sees (out, lse, dq sum over
        them) and the most query rows, over a GQA group, one key is seen by (dk, dv sum over them)."""
        group = self.q.shape[1] // self.k.shape[1]
        return {"keys": self.max_seqlen_k, "queries": self.max_seqlen_q * group}

    def regions(self, name: str) -> torch.Tensor:
        """Region labels for the rows of q/out/dq (`name` in q, out, dq) or k/v/dk/dv."""
        return self.regions_q if name in ("q", "out", "dq", "lse") else self.regions_k

    def fresh(self, requires_grad: bool = True) -> PackedBatch:
        """The same batch with new leaf tensors (so two implementations never share grads)."""
        leaves = {n: t.detach().clone().requires_grad_(requires_grad) for n, t in self.inputs().items()}
        return replace(self, **leaves)


def _side_tensor(case: Case, side: str, heads: int, head_dim: int, generator: torch.Generator) -> torch.Tensor:
    """One of q/k/v on CPU: normal values on REAL rows, the case's fill on padding rows."""
    dtype = case.torch_dtype
    x = torch.randn(case.total_rows(side), heads, head_dim, generator=generator, dtype=torch.float32).to(dtype)
    real = cumulative(case.real_lengths(side))
    padded = cumulative(case.padded_lengths(side))
    padding = region_labels(real, padded, x.shape[0]) != Region.REAL
    n = int(padding.sum())
    if n:
        x[padding] = case.fill.values((n, heads, head_dim), dtype, generator)
    return x


_PACK_OBSERVERS: list[Callable[[Case], None]] = []


@contextlib.contextmanager
def observing_packs(observer: Callable[[Case], None]) -> Iterator[None]:
    """Within the block, `observer(case)` is called each time `pack` builds a batch: how
    `varlen-workbench repro` shows which layout a post-mortem is working on."""
    _PACK_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _PACK_OBSERVERS.remove(observer)


def pack(case: Case, device: torch.device | str | None = None, requires_grad: bool = True) -> PackedBatch:
    """Builds the packed batch of `case` on `device` (default: kernels' default device).

    Values are drawn on the CPU from `case.seed`, then moved, so the same case gives the
    same numbers on every device.
    """
    for observer in _PACK_OBSERVERS:
        observer(case)
    device = torch.device(device) if device is not None else default_device()
    generator = torch.Generator().manual_seed(case.seed)
    kv_heads = case.kv_heads or case.heads
    q = _side_tensor(case, "q", case.heads, case.head_dim, generator)
    k = _side_tensor(case, "k", kv_heads, case.head_dim, generator)
    v = _side_tensor(case, "k", kv_heads, case.value_head_dim, generator)
    q_leaf, k_leaf, v_leaf = (t.to(device).requires_grad_(requires_grad) for t in (q, k, v))
    lengths_q, lengths_k = case.real_lengths("q"), case.real_lengths("k")
    cu_q, cu_k = cumulative(lengths_q, device), cumulative(lengths_k, device)
    cu_q_padded, cu_k_padded = cumulative(case.padded_lengths("q"), device), cumulative(case.padded_lengths("k"), device)
    return PackedBatch(
        case,
        q_leaf,
        k_leaf,
        v_leaf,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        cu_seqlens_q_padded=cu_q_padded,
        cu_seqlens_k_padded=cu_k_padded,
        max_seqlen_q=max(lengths_q),
        max_seqlen_k=max(lengths_k),
        regions_q=region_labels(cu_q, cu_q_padded, q.shape[0]),
        regions_k=region_labels(cu_k, cu_k_padded, k.shape[0]),
    )


# -- moving between layouts ---------------------------------------------------------------


def unpad_thd(x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """Padded THD -> unpadded THD (only real rows, back to back; boundaries = cu_seqlens).

    Differentiable: gradients flow back to the real rows; padding rows get exactly 0.
    """
    return x.index_select(0, real_rows(cu_seqlens, cu_seqlens_padded))


def pad_thd(
    x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, total_rows: int | None = None
) -> torch.Tensor:
    """Unpadded THD -> padded THD with zero padding rows (`total_rows` adds TAIL rows)."""
    rows = real_rows(cu_seqlens, cu_seqlens_padded)
    if x.shape[0] != rows.numel():
        raise ValueError(
            f"x has {x.shape[0]} rows but cu_seqlens describes {rows.numel()} real tokens; "
            "pass the unpadded tensor whose boundaries are cu_seqlens."
        )
    total = int(cu_seqlens_padded[-1]) if total_rows is None else total_rows
    if total < int(cu_seqlens_padded[-1]):
        raise ValueError(f"total_rows = {total} is less than cu_seqlens_padded[-1] = {int(cu_seqlens_padded[-1])}.")
    out = x.new_zeros((total, *x.shape[1:]))
    return out.index_copy(0, rows, x)


def thd_to_bshd(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed THD -> (B, S, H, D) zero-padded batch and a (B, S) bool mask of real tokens."""
    lengths = cu_seqlens.diff().tolist()
    seq = max(lengths) if max_seqlen is None else max_seqlen
    if seq < max(lengths):
        raise ValueError(f"max_seqlen = {seq} is smaller than the longest sequence ({max(lengths)}).")
    mask = torch.arange(seq, device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
    flat = unpad_thd(x, cu_seqlens, cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded)
    out = x.new_zeros((len(lengths) * seq, *x.shape[1:]))
    out = out.index_copy(0, mask.flatten().nonzero().squeeze(1), flat)
    return out.view(len(lengths), seq, *x.shape[1:]), mask


def bshd_to_thd(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(B, S, H, D) + (B, S) bool mask of real tokens -> unpadded THD, cu_seqlens, max_seqlen.

    The mask must be left-aligned (real tokens first in every row), as padded batches are.
    """
    if mask.dtype != torch.bool or mask.shape != x.shape[:2]:
        raise ValueError(
            f"mask must be a bool tensor of shape {tuple(x.shape[:2])} (batch, seq), got {mask.dtype} {tuple(mask.shape)}."
        )
    lengths = mask.sum(1)
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]):
        raise ValueError("mask is not left-aligned: every row must be real tokens first, then padding.")
    flat = x.reshape(-1, *x.shape[2:]).index_select(0, mask.flatten().nonzero().squeeze(1))
    return flat, cumulative(lengths.tolist(), x.device), int(lengths.max())
