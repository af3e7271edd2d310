"""Who a post-mortem's bug hits, declared as data.

A post-mortem's cases.py declares

    WHO = Affected(
        scope=("**flash-attn-4 4.0.0b36** ...",),   # which releases, functions, backends (prose bullets)
        layouts=(Layout(...), ...),                  # the batches a reader may have: hit or not, and why
        notes=("**Same mechanism elsewhere:** ...",),
    )

and its notebook renders the section "Who is affected" with `Markdown(pm.WHO.markdown())`. Each
layout carries the concrete batch it stands for (`inputs`): a packed `varlen_workbench.workbench.layout.Case`, or a padded
`MaskedBatch` for the APIs that take a mask. The paste-block battery (tests/test_snippets.py) runs
every check and every workaround of the page on every layout declared here: a check must flag each
affected layout and no other, and a workaround must keep REAL rows within the page's bound on each,
so the page cannot promise more than its blocks deliver.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from varlen_workbench.workbench.layout import DTYPE_NAMES, Case

MASK_SHAPES = ("(B, H, S, S)", "(B, 1, S, S)", "(B, 1, 1, S)", "none")
# How a mask says "attend": bool True; flash-dmattn's float mask > 0; SDPA's additive float mask 0 (-inf masks).
MASK_DTYPES = ("bool", "float", "additive")


@dataclass(frozen=True)
class MaskedBatch:
    """A padded batch as mask-taking attention APIs get it (SDPA, flash-dmattn): item b has
    `lengths_q[b]` real queries and `lengths_k[b]` real keys, each side padded to `seq` positions
    (on the right, or on the left with `left=True`), and a mask of `mask_shape` saying which keys
    each query row may see.

    What a row may see (`visible` of `build()`, the contract's answer): its item's real keys; with
    `causal` and `window` (FlashAttention's (left, right), -1 unbounded), those around the diagonal
    aligned bottom-right (key j for query i when i + len_k - len_q - left <= j <= i + len_k - len_q
    + right, causal bounding right at 0), inside the mask; with `is_causal`, the API's own flag on top
    (top-left over padded positions, `q_idx >= kv_idx`, as flash-dmattn applies it);
    `keyless_rows` rows of item 0, head 1 that see no key at all (a per-head mask).
    """

    lengths_k: tuple[int, ...]
    lengths_q: tuple[int, ...] | None = None  # None: every query position is real
    seq: int = 8
    heads: int = 2
    kv_heads: int | None = None
    head_dim: int = 16
    mask_shape: str = "(B, H, S, S)"
    mask_dtype: str = "bool"
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    is_causal: bool = False
    left: bool = False
    keyless_rows: int = 0
    bias: bool = False
    dtype: str = "float16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mask_shape not in MASK_SHAPES:
            raise ValueError(f"MaskedBatch.mask_shape = {self.mask_shape!r} must be one of {MASK_SHAPES}.")
        if self.mask_dtype not in MASK_DTYPES:
            raise ValueError(f"MaskedBatch.mask_dtype = {self.mask_dtype!r} must be one of {MASK_DTYPES}.")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"MaskedBatch.dtype = {self.dtype!r} must be one of {sorted(DTYPE_NAMES)}.")
        lengths = (*self.lengths_k, *(self.lengths_q or ()))
        if any(n < 0 or n > self.seq for n in lengths):
            raise ValueError(f"MaskedBatch lengths {lengths} must lie in [0, seq = {self.seq}].")
        if self.lengths_q is not None and len(self.lengths_q) != len(self.lengths_k):
            raise ValueError("MaskedBatch.lengths_q and lengths_k need one entry per item.")
        if self.heads % (self.kv_heads or self.heads) or (self.keyless_rows and self.heads < 2):
            raise ValueError(f"MaskedBatch: heads = {self.heads} must be a multiple of kv_heads (and >= 2 with keyless_rows).")
        windowed = self.causal or self.window != (-1, -1)
        rows_differ = windowed or self.is_causal or self.keyless_rows or self.lengths_q is not None
        if self.mask_shape == "(B, 1, 1, S)" and (windowed or self.keyless_rows):
            raise ValueError("MaskedBatch: a (B, 1, 1, S) mask holds one row per item: no causal or window, no keyless_rows.")
        if self.mask_shape == "(B, 1, S, S)" and self.keyless_rows:
            raise ValueError("MaskedBatch: a (B, 1, S, S) mask is the same for every head: no keyless_rows.")
        if self.mask_shape == "none" and (rows_differ and not self.is_causal or any(n < self.seq for n in self.lengths_k)):
            raise ValueError("MaskedBatch: without a mask every key is real and every row sees every key.")

    @property
    def batch(self) -> int:
        return len(self.lengths_k)

    def with_(self, **changes: Any) -> MaskedBatch:
        """A copy with some fields changed."""
        return replace(self, **changes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_NAMES[self.dtype]

    def _real(self, lengths: tuple[int, ...]) -> torch.Tensor:
        """(B, S) bool: the real positions of one side."""
        position = torch.arange(self.seq)
        count = torch.tensor(lengths)[:, None]
        return position >= self.seq - count if self.left else position < count

    def build(self) -> dict[str, Any]:
        """q, k, v (B, S, H, D) (k and v with `kv_heads`), `attn_mask` in the declared shape and
        dtype (None for "none"), `attn_bias` (B, H, S, S) or None (an additive mask carries the bias
        itself), `is_causal`, and the truth: `visible` (B, H, S, S) bool, the keys each row may see,
        `bias` (B, H, S, S) or None, added to their scores, and `real_q` (B, S) bool."""
        generator = torch.Generator().manual_seed(self.seed)
        shape_q = (self.batch, self.seq, self.heads, self.head_dim)
        shape_k = (self.batch, self.seq, self.kv_heads or self.heads, self.head_dim)
        q = torch.randn(shape_q, generator=generator).to(self.torch_dtype)
        k, v = (torch.randn(shape_k, generator=generator).to(self.torch_dtype) for _ in range(2))
        real_k = self._real(self.lengths_k)
        real_q = self._real(self.lengths_q) if self.lengths_q is not None else torch.ones(self.batch, self.seq, dtype=torch.bool)
        square = (self.batch, self.heads, self.seq, self.seq)
        allowed = real_k[:, None, None, :].expand(square).clone()  # what the mask says
        left, right = self.window[0], 0 if self.causal else self.window[1]
        # Bottom-right per item, in positions counted from each side's first real row.
        diagonal = (real_q.cumsum(-1) - 1 + (real_k.sum(-1) - real_q.sum(-1))[:, None])[:, None, :, None]
        rank_k = (real_k.cumsum(-1) - 1)[:, None, None, :]
        if right >= 0:
            allowed &= rank_k <= diagonal + right
        if left >= 0:
            allowed &= rank_k >= diagonal - left
        if self.keyless_rows:
            allowed[0, 1, : self.keyless_rows] = False
        visible = allowed.clone()
        if self.is_causal:
            visible &= torch.ones(self.seq, self.seq, dtype=torch.bool).tril()
        bias = torch.randn(square, generator=generator).to(self.torch_dtype) if self.bias else None
        return {
            "q": q,
            "k": k,
            "v": v,
            "attn_mask": self._mask(allowed, bias),
            "attn_bias": None if self.mask_dtype == "additive" else bias,
            "is_causal": self.is_causal,
            "visible": visible,
            "bias": bias,
            "real_q": real_q,
        }

    def _mask(self, allowed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`allowed` (B, H, S, S) in the declared shape and dtype; an additive mask carries the bias."""
        if self.mask_shape == "none":
            return None
        mask = {"(B, H, S, S)": allowed, "(B, 1, S, S)": allowed[:, :1], "(B, 1, 1, S)": allowed[:, :1, :1]}[self.mask_shape]
        if self.mask_dtype == "bool":
            return mask.contiguous()
        if self.mask_dtype == "float":
            return mask.to(self.torch_dtype).contiguous()
        zero = torch.zeros(mask.shape, dtype=self.torch_dtype) if bias is None else bias[:, : mask.shape[1], : mask.shape[2]]
        return zero.masked_fill(~mask, float("-inf")).contiguous()


# The padding a batch has, in the words the site's symptom routes use (varlen_workbench.workbench.symptoms).
PADDING_KINDS = {
    "right": "a padded batch (B, S, ...), each item's padding after its tokens",
    "left": "a padded batch, each item's padding before its tokens",
    "TAIL": "a packed buffer longer than its tokens: rows past cu_seqlens[-1]",
    "GAP": "a packed batch with padding inside each sequence's slot (cu_seqlens_padded, seqused)",
    "empty sequence": "a sequence with no token (or no key)",
    "none": "no padding at all",
}


def padding_kinds(inputs: Case | MaskedBatch) -> frozenset[str]:
    """The `PADDING_KINDS` a declared batch has, read off its fields: what a route to its layout may name."""
    if isinstance(inputs, MaskedBatch):
        lengths = (*inputs.lengths_k, *(inputs.lengths_q or ()))
        padded = any(n < inputs.seq for n in lengths)
        kinds = {("left" if inputs.left else "right") if padded else "none"}
    else:
        sides = ("q", "k")
        kinds = {"TAIL"} if inputs.tail_q or inputs.tail_k else set()
        if any(inputs.padded_lengths(side) != inputs.real_lengths(side) for side in sides):
            kinds.add("GAP")
        kinds = kinds or {"none"}
        lengths = (*inputs.real_lengths("q"), *inputs.real_lengths("k"))
    if 0 in lengths:
        kinds.add("empty sequence")
    return frozenset(kinds)


@dataclass(frozen=True)
class Layout:
    """One kind of batch a reader may pass, and what the page's bug does to it.

    `name` says what the batch is in the reader's terms, `why` why the bug hits it or not.
    `inputs` is the batch the battery builds: a `Case` (packed) or a `MaskedBatch` (padded).
    `gpu`: only a GPU shows this layout's behaviour (no CPU path runs it, not even a replica): the
    battery runs it where CUDA is native, and the page says so. `refused`: the library rejects the
    layout with this error, loudly, so nothing is silently wrong (such a layout is not affected).
    """

    name: str
    affected: bool
    why: str
    inputs: Case | MaskedBatch
    gpu: bool = False
    refused: str = ""

    def __post_init__(self) -> None:
        if not self.name.strip() or not self.why.strip():
            raise ValueError("Layout: give a name and a why (the page shows both).")
        if self.refused and self.affected:
            raise ValueError(f"Layout {self.name!r}: a layout the library refuses loudly is not affected.")

    def markdown(self) -> str:
        gpu = " *(shown on a GPU only)*" if self.gpu else ""
        return f"**{self.name}**{gpu}: {self.why}"


@dataclass(frozen=True)
class Affected:
    """Who a bug hits: the releases and call paths (`scope`, prose bullets), the layouts declared
    hit and not hit, and further bullets (`notes`: the same mechanism elsewhere, ...)."""

    scope: tuple[str, ...]
    layouts: tuple[Layout, ...]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [layout.name for layout in self.layouts]
        if len(set(names)) != len(names):
            raise ValueError(f"Affected: layout names must be unique, got {names}.")
        if not self.affected or not self.unaffected:
            raise ValueError(
                "Affected: declare at least one affected and one unaffected layout: a check is tested on both "
                "(it must flag the first and stay quiet on the second)."
            )

    @property
    def affected(self) -> tuple[Layout, ...]:
        return tuple(layout for layout in self.layouts if layout.affected)

    @property
    def unaffected(self) -> tuple[Layout, ...]:
        """Not hit, refused layouts included."""
        return tuple(layout for layout in self.layouts if not layout.affected)

    def layout(self, name: str) -> Layout:
        for layout in self.layouts:
            if layout.name == name:
                return layout
        raise KeyError(f"no layout {name!r}; declared: {[layout.name for layout in self.layouts]}")

    def markdown(self) -> str:
        """The section's text: the scope, then the layouts hit, not hit and refused, then the notes."""
        groups = (
            ("Hit", self.affected),
            ("Not hit", tuple(layout for layout in self.unaffected if not layout.refused)),
            ("Refused with an error (loud, never silently wrong)", tuple(layout for layout in self.layouts if layout.refused)),
        )
        lines = [f"* {bullet}" for bullet in self.scope]
        for title, layouts in groups:
            if layouts:
                lines.append(f"* **{title}:**")
                lines += [f"    * {layout.markdown()}" for layout in layouts]
        lines += [f"* {note}" for note in self.notes]
        return "\n".join(lines)
