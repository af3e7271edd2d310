"""The catalogue of malformed varlen calls: point 4 of the padding contract, as data.

Each `Malformed` case is one bad call, made by changing a valid TE-style call (`base_args`):
real boundaries [0, 3, 5, 9], padded [0, 4, 8, 13], 15 rows (so 2 TAIL rows; `tail=False` gives
exactly as many rows as the layout covers, which the audit's campaign uses so that an
implementation's TAIL-row bug cannot pose as a malformed-input finding). Two consumers
share it: `tests/test_contract.py` checks that our validation raises `exception` with a message
matching `message`, and `varlen-workbench audit`'s bad-input campaign feeds every case to any
implementation and classifies what it does (clear error / crash / silent result / silent NaN).

A case's changes are a function of the base call, so the same case can be built for an
implementation that needs another dtype or device, has no GQA or no padded layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

I32 = torch.int32
REAL, PADDED = [0, 3, 5, 9], [0, 4, 8, 13]
ROWS, HEADS, HEAD_DIM = 15, 4, 16


def base_args(
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    padded: bool = True,
    kv_heads: int = 2,
    seed: int = 0,
    tail: bool = True,
    head_dim: int = HEAD_DIM,
) -> dict[str, Any]:
    """A valid call in the contract's argument names. `padded=False` drops the padded layout
    (rows 9-14 become TAIL rows); `kv_heads=HEADS` makes it plain multi-head attention;
    `tail=False` drops the TAIL rows (9 rows unpadded, 13 padded); `head_dim` for an
    implementation that refuses the catalogue's own."""
    generator = torch.Generator().manual_seed(seed)
    rows = ROWS if tail else (PADDED if padded else REAL)[-1]

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, head_dim, generator=generator).to(dtype=dtype, device=device)

    cu = torch.tensor(REAL, dtype=I32, device=device)
    cu_padded = torch.tensor(PADDED, dtype=I32, device=device) if padded else None
    return dict(
        q=tensor(HEADS),
        k=tensor(kv_heads),
        v=tensor(kv_heads),
        cu_seqlens_q=cu,
        cu_seqlens_k=cu.clone(),
        max_seqlen_q=4,
        max_seqlen_k=4,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_k_padded=None if cu_padded is None else cu_padded.clone(),
        scale=None,
    )


POSITIONAL = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def split_call(args: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """(positional, keyword) arguments of a contract-shaped call."""
    keywords = dict(args)
    return [keywords.pop(name) for name in POSITIONAL], keywords


@dataclass(frozen=True)
class Malformed:
    """One malformed call.

    `arguments`: the error must name one of them (in the contract's names). `requires`:
    features of the call the implementation must be able to express ("padded": a padded
    layout; "scale": a custom softmax scale; "window": a `window_size`). `outside`: (what, value) for inputs that are
    malformed only because our kernel does not support them (head_dim 20, float64): other
    implementations may legitimately accept them.

    `stands_for`: changes to the base call giving the well-formed call this one stands for,
    whose fp64 answer an implementation that accepts the call must give (a Python list for the
    tensor it lists, a 0-d tensor for the float it holds; for a too-small max_seqlen, the
    attention cu_seqlens describes); None when the call means nothing (decreasing boundaries).
    `valid`: the input is legal mathematics (a negative scale, head_dim 20 for a kernel without
    that restriction): accepting it with the oracle's answer is as right as refusing it.
    """

    id: str
    arguments: tuple[str, ...]
    changes: Callable[[dict[str, Any]], dict[str, Any]]
    exception: type[Exception]
    message: str  # regex our validation's message matches
    requires: frozenset[str] = frozenset()
    outside: tuple[str, Any] | None = None
    stands_for: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    valid: bool = False

    def reference_call(self, base: dict[str, Any], built: dict[str, Any]) -> dict[str, Any] | None:
        """The well-formed call whose answer an accepting implementation must give, or None."""
        if self.valid:
            return built
        return None if self.stands_for is None else {**base, **self.stands_for(base)}

    def build(self, base: dict[str, Any]) -> dict[str, Any]:
        """The malformed call's arguments: `base` with this case's changes."""
        return {**base, **self.changes(base)}

    def names_argument(self, message: str, aliases: dict[str, str] | None = None) -> bool:
        """Whether `message` names one of the arguments, by our name or the implementation's."""
        aliases = aliases or {}
        names = {*self.arguments, *(aliases[a] for a in self.arguments if a in aliases)}
        return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message) for n in names)


def _i32(base: dict, values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=I32, device=base["q"].device)


def _like(
    base: dict,
    name: str,
    rows: int | None = None,
    heads: int | None = None,
    dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Random (rows, heads, dim) values shaped like base[name] except where given."""
    ref = base[name]
    shape = (rows or ref.shape[0], heads or ref.shape[1], dim or ref.shape[2])
    return torch.randn(shape).to(dtype=dtype or ref.dtype, device=ref.device)


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float16 else torch.float16


def _kv(base: dict, **kw) -> dict:
    return dict(k=_like(base, "k", **kw), v=_like(base, "v", **kw))


PADDED_LAYOUT, SCALE, WINDOW = frozenset({"padded"}), frozenset({"scale"}), frozenset({"window"})


def SAME(base: dict) -> dict:
    """`stands_for` of a call that means the base call (the same values in another form)."""
    return {}


CATALOGUE: tuple[Malformed, ...] = (
    Malformed(
        "cu-not-tensor",
        ("cu_seqlens_q",),
        lambda b: dict(cu_seqlens_q=list(REAL)),
        TypeError,
        r"cu_seqlens_q must be a torch\.Tensor of int32, got list",
        stands_for=SAME,
    ),
    Malformed(
        "cu-float",
        ("cu_seqlens_q",),
        lambda b: dict(cu_seqlens_q=b["cu_seqlens_q"].float()),
        TypeError,
        r"cu_seqlens_q must be an integer tensor .*got torch\.float32.*\.to\(torch\.int32\)",
        stands_for=SAME,
    ),
    Malformed(
        "cu-2d",
        ("cu_seqlens_k",),
        lambda b: dict(cu_seqlens_k=b["cu_seqlens_k"].view(1, -1)),
        ValueError,
        r"cu_seqlens_k must be 1-D .*got shape \(1, 4\)",
        stands_for=SAME,
    ),
    Malformed(
        "cu-too-short",
        ("cu_seqlens_q",),
        lambda b: dict(cu_seqlens_q=_i32(b, [0])),
        ValueError,
        r"cu_seqlens_q must hold at least 2 boundaries.*\[0, n\]",
    ),
    Malformed(
        "cu-not-from-zero",
        ("cu_seqlens_q",),
        lambda b: dict(cu_seqlens_q=_i32(b, [1, 3, 5, 9])),
        ValueError,
        r"cu_seqlens_q\[0\] = 1: .*must start at 0",
    ),
    Malformed(
        "cu-decreasing",
        ("cu_seqlens_k",),
        lambda b: dict(cu_seqlens_k=_i32(b, [0, 3, 2, 9])),
        ValueError,
        r"cu_seqlens_k decreases at index 2: cu_seqlens_k\[1\] = 3 > cu_seqlens_k\[2\] = 2",
    ),
    Malformed(
        "padded-decreasing",
        ("cu_seqlens_q_padded",),
        lambda b: dict(cu_seqlens_q_padded=_i32(b, [0, 4, 3, 13])),
        ValueError,
        r"cu_seqlens_q_padded decreases at index 2",
        PADDED_LAYOUT,
    ),
    Malformed(
        "padded-not-from-zero",
        ("cu_seqlens_k_padded",),
        lambda b: dict(cu_seqlens_k_padded=_i32(b, [2, 4, 8, 13])),
        ValueError,
        r"cu_seqlens_k_padded\[0\] = 2",
        PADDED_LAYOUT,
    ),
    Malformed(
        "batch-mismatch-q-k",
        ("cu_seqlens_q", "cu_seqlens_k"),
        lambda b: dict(cu_seqlens_k=_i32(b, [0, 3, 9]), cu_seqlens_k_padded=None, max_seqlen_k=6),
        ValueError,
        r"cu_seqlens_q describes 3 sequences but cu_seqlens_k describes 2",
    ),
    Malformed(
        "batch-mismatch-padded",
        ("cu_seqlens_q_padded",),
        lambda b: dict(cu_seqlens_q_padded=_i32(b, [0, 4, 13])),
        ValueError,
        r"cu_seqlens_q_padded has 2 sequences but cu_seqlens_q has 3",
        PADDED_LAYOUT,
    ),
    Malformed(
        "real-longer-than-padded",
        ("cu_seqlens_q", "cu_seqlens_q_padded"),
        lambda b: dict(cu_seqlens_q=_i32(b, [0, 3, 8, 9]), max_seqlen_q=5),
        ValueError,
        r"sequence 1 has 5 real tokens .*only 4 rows in the padded layout.*swap",
        PADDED_LAYOUT,
    ),
    Malformed(
        "padded-end-past-q",
        ("q", "cu_seqlens_q_padded"),
        lambda b: dict(q=_like(b, "q", rows=12)),
        ValueError,
        r"cu_seqlens_q_padded\[-1\] = 13 exceeds q\.shape\[0\] = 12",
        PADDED_LAYOUT,
    ),
    Malformed(
        "real-end-past-k-no-padded",
        ("cu_seqlens_k", "k"),
        lambda b: dict(cu_seqlens_k_padded=None, cu_seqlens_k=_i32(b, [0, 3, 5, 16]), max_seqlen_k=11),
        ValueError,
        r"cu_seqlens_k\[-1\] = 16 exceeds k and v\.shape\[0\] = 15",
    ),
    Malformed(
        "max-seqlen-too-small",
        ("max_seqlen_q",),
        lambda b: dict(max_seqlen_q=3),
        ValueError,
        r"max_seqlen_q = 3 is smaller than sequence 2's real length 4.*silently dropped",
        stands_for=SAME,
    ),
    Malformed(
        "max-seqlen-not-int",
        ("max_seqlen_k",),
        lambda b: dict(max_seqlen_k=torch.tensor(4)),
        TypeError,
        r"max_seqlen_k must be a Python int, got Tensor",
        stands_for=SAME,
    ),
    Malformed(
        "max-seqlen-bool",
        ("max_seqlen_k",),
        lambda b: dict(max_seqlen_k=True),
        TypeError,
        r"max_seqlen_k must be a Python int, got bool",
        stands_for=SAME,
    ),
    Malformed(
        "heads-not-multiple", ("q", "k"), lambda b: _kv(b, heads=3), ValueError, r"q has 4 heads, not a multiple of k's 3 heads"
    ),
    # Our kernel takes every multiple of 8 up to 256 (FlashAttention's range): 20 is none of them.
    Malformed(
        "head-dim-unsupported",
        ("q", "head_dim"),
        lambda b: dict(q=_like(b, "q", dim=20), **_kv(b, dim=20)),
        ValueError,
        r"head_dim 20 .*not supported.*8, 16, 24, \.\.\., 256.*Pad q and k with zeros to 24 .*scale=20\*\*-0\.5",
        outside=("head_dim", 20),
        valid=True,
    ),
    Malformed(
        "head-dim-v-unsupported",
        ("v", "head_dim"),
        lambda b: dict(v=_like(b, "v", dim=20)),
        ValueError,
        r"v's head_dim 20 \(v\.shape\[-1\]\) is not supported.*Pad v with zeros to 24",
        outside=("head_dim", 20),
        valid=True,
    ),
    Malformed(
        "head-dim-q-k-differ",
        ("q", "k"),
        lambda b: _kv(b, dim=32),
        ValueError,
        r"q and k must have the same head_dim .*q 16 and k 32",
    ),
    Malformed(
        "q-not-3d",
        ("q",),
        lambda b: dict(q=b["q"].reshape(b["q"].shape[0], -1)),
        ValueError,
        r"q must be 3-D \(tokens, heads, head_dim\).*got shape \(15, 64\)",
    ),
    Malformed(
        "k-v-shape-differ",
        ("k", "v"),
        lambda b: dict(v=_like(b, "v", rows=14)),
        ValueError,
        r"v has 14 rows but k has \d+ .*one value row per key row",
    ),
    Malformed(
        "k-v-heads-differ",
        ("k", "v"),
        lambda b: dict(v=_like(b, "v", heads=b["k"].shape[1] + 1)),
        ValueError,
        r"v has \d+ heads but k has \d+ .*one value head per key head",
    ),
    Malformed(
        "dtype-mixed",
        ("q", "k", "v"),
        lambda b: _kv(b, dtype=_other_dtype(b["q"].dtype)),
        TypeError,
        r"q, k, v must share one dtype",
    ),
    Malformed(
        "dtype-unsupported",
        ("q",),
        lambda b: dict(q=b["q"].double(), k=b["k"].double(), v=b["v"].double()),
        TypeError,
        r"q has dtype torch\.float64; this implementation supports",
        outside=("dtype", torch.float64),
        valid=True,
    ),
    Malformed(
        "q-integer",
        ("q",),
        lambda b: dict(q=torch.ones(b["q"].shape, dtype=torch.int64, device=b["q"].device)),
        TypeError,
        r"q must be a floating-point tensor",
    ),
    Malformed("q-not-tensor", ("q",), lambda b: dict(q=[[1.0]]), TypeError, r"q must be a torch\.Tensor, got list"),
    Malformed(
        "device-differs",
        ("cu_seqlens_q",),
        lambda b: dict(cu_seqlens_q=torch.tensor(REAL, dtype=I32, device="meta")),
        ValueError,
        r"cu_seqlens_q is on meta but q is on cpu; move it",
    ),
    Malformed(
        "scale-negative",
        ("scale",),
        lambda b: dict(scale=-1.0),
        ValueError,
        r"scale = -1\.0 must be a finite positive number",
        SCALE,
        valid=True,
    ),
    Malformed(
        "scale-nan",
        ("scale",),
        lambda b: dict(scale=float("nan")),
        ValueError,
        r"scale = nan must be a finite positive number",
        SCALE,
    ),
    Malformed(
        "scale-tensor",
        ("scale",),
        lambda b: dict(scale=torch.tensor(0.5)),
        TypeError,
        r"scale must be a Python float or None",
        SCALE,
        stands_for=lambda b: dict(scale=0.5),
    ),
    # window_size (varlen_workbench.kernels.contract.check_window_size): the right kind of thing is a pair of ints >= -1.
    Malformed(
        "window-not-pair",
        ("window_size",),
        lambda b: dict(window_size=4),
        TypeError,
        r"window_size must be a \(left, right\) pair of ints, got int 4.*window_size=\(4096, 0\)",
        WINDOW,
    ),
    Malformed(
        "window-three-entries",
        ("window_size",),
        lambda b: dict(window_size=(4, 0, 1)),
        ValueError,
        r"window_size must have 2 entries \(left, right\), got 3",
        WINDOW,
    ),
    Malformed(
        "window-below-minus-one",
        ("window_size",),
        lambda b: dict(window_size=(-2, 0)),
        ValueError,
        r"window_size left bound = -2 is invalid.*-1 \(unbounded\)",
        WINDOW,
    ),
    Malformed(
        "window-bound-float",
        ("window_size",),
        lambda b: dict(window_size=(0, 1.5)),
        TypeError,
        r"window_size right bound must be an int, got float 1\.5",
        WINDOW,
    ),
    Malformed(
        "window-bound-bool",
        ("window_size",),
        lambda b: dict(window_size=(True, 0)),
        TypeError,
        r"window_size left bound must be an int, got bool",
        WINDOW,
    ),
)
