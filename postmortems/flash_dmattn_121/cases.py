"""What flash-dmattn-121 studies: META, the mask cases (upstream's, the replica's, the packed equivalents) and the fixed sizes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.workbench.affected import Affected, Layout, MaskedBatch
from varlen_workbench.workbench.layout import Case, Fill
from varlen_workbench.workbench.postmortem import (
    Link,
    Meta,
)
from varlen_workbench.workbench.upstream_status import finding_status

META = Meta(
    id="flash-dmattn-121",
    title="flash-dmattn: its Triton backward NaN-fills dK and dV (lengths off 64, fully masked rows); the proposed NaN-to-zero patch would hide it",
    component="flash-dmattn 1.2.2 (now flash-sparse-attn) / Triton backend",
    category="training bug",
    impact="flash-dmattn 1.2.2 Triton: a length not a multiple of 64, or a row seeing none of keys 0-63 (left padding + causal), NaN-fills dK and dV",
    our_verdict=(
        "the report's symptom is reproduced on the released Triton backend at lengths not a multiple of 64 (with dK NaN too), "
        "not on its own configuration (256); fully masked rows give a second NaN; the proposed patch cannot compile and, "
        "made to, turns the first into finite, wrong dK/dV and leaves the second's NaN output"
    ),
    detection="NaN in every dK/dV row (finite output) at lengths off 64; NaN output rows and NaN gradients with left padding + causal",
    fix_type="proposed: zeros_like + isfinite masking (cannot compile, hides NaN); workarounds: pad lengths to a multiple of 64, pad on the right or let padding rows see themselves",
    tags=("attention mask", "padding", "ragged length", "NaN", "unsound fix"),
    reported="2025-08-24",
    published="2026-11-29",
    revised="2026-12-07",
    links=(
        Link(
            "flash-sparse-attention#121",
            "https://github.com/HKUSTDial/flash-sparse-attention/issues/121",
            date="2025-08-24",
            kind="issue",
            status="closed; its repro step runs benchmarks/backward_equivalence.py --test-type cuda, which at f567c1f "
            "calls flash_dmattn_func (the CUDA backend); the snippet of Copilot's fix, #122, calls triton_dmattn_func "
            "(the Triton backend)",
        ),
        Link(
            "flash-sparse-attention#122 (Copilot's fix for #121, branch copilot/fix-121, commit 9969738)",
            "https://github.com/HKUSTDial/flash-sparse-attention/pull/122",
            date="2025-08-24",
            kind="PR",
            status="not merged: tl.where(tl.isfinite(dv), dv, 0.0) and zeros_like for dk/dv; not on main",
        ),
        Link(
            "flash-sparse-attention#136 (tensor sanitization, ce22f2d)",
            "https://github.com/HKUSTDial/flash-sparse-attention/pull/136",
            date="2025-08-29",
            kind="PR",
            status="merged: nan_to_num of out and gradients in the CUDA interface",
        ),
        Link(
            "071ab90: 'Disables tensor sanitization in attention ops'",
            "https://github.com/SmallDoges/flash-dmattn/commit/071ab90f1c8f2ca884a68bc8a6dc7b8887cd2c97",
            date="2025-10-26",
            kind="commit",
            status="#136's sanitization commented out, before 1.2.2",
        ),
        Link(
            "flash-sparse-attention#185 (varlen with mask and bias)",
            "https://github.com/HKUSTDial/flash-sparse-attention/pull/185",
            date="2025-10-09",
            kind="PR",
            status="merged; says it zeroes NaN/Inf values",
        ),
        Link(
            "flash-dmattn 1.2.2",
            "https://pypi.org/project/flash-dmattn/1.2.2/",
            date="2025-11-05",
            kind="release",
            status="last flash-dmattn release (sdist files dated 2025-11-05); Triton backend unguarded",
        ),
        Link(
            "flash-sparse-attn 2.0.6",
            "https://pypi.org/project/flash-sparse-attn/2.0.6/",
            date="2026-09-09",
            kind="release",
            status="latest (wheel files dated 2026-09-09); no boolean-mask API; import needs undeclared triton_kernels",
        ),
        Link(
            "guarded Triton backend in the successor repository (read at 0b8d052)",
            "https://github.com/HKUSTDial/flash-sparse-attention/blob/0b8d05282f725c7d823ca428c8d7d782aec69fa2/flash_sparse_attn/flash_sparse_attn_triton.py",
        ),
        Link("triton#11584 (interpreter bf16 dot)", "https://github.com/triton-lang/triton/issues/11584"),
    ),
    seed="001_90a18acb6ed00fca.txt",
)
STATUS = finding_status(META.id, __file__)  # where upstream stands: data/upstream-status.toml

VARIANTS = {"replica": {}, "patch": {"patch": True}, "guard": {"guard": True}}

TENSORS = ("out", "lse", "dq", "dk", "dv")

GRADS = ("dq", "dk", "dv")

PATTERNS = ("none", "all", "rows", "leading", "left_pad", "right_pad", "left_pad_self", "random")

PADDED_PATTERNS = ("left_pad", "right_pad", "left_pad_self")


@dataclass(frozen=True)
class MaskCase:
    """A dense batch with a boolean mask pattern, described well enough to rebuild it bit for bit.

    `pattern` (one of PATTERNS) and its parameter `amount`:
    none: no mask; all: an all-True mask; rows: query rows [0, amount) fully masked;
    leading: key block 0 (the first `block_n` keys) masked for query rows [0, amount);
    left_pad: batch item 1 left-padded with `amount` tokens, masked as keys for every query
    (HF's 4-D mask); right_pad: the same padding at the end of item 1; left_pad_self: left_pad
    where each padding query row may see itself (so no row is fully masked); random: each
    (query, key) kept with probability `amount`. `loss_mask` zeroes dO on padding query rows,
    as a loss that ignores padding does.
    """

    name: str
    pattern: str
    amount: float = 0
    seqlen: int = 128
    batch: int = 1
    heads: int = 1
    head_dim: int = 32
    dtype: str = "bfloat16"
    causal: bool = False
    block_m: int = 64
    block_n: int = 64
    seed: int = 0
    loss_mask: bool = False

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"MaskCase.pattern = {self.pattern!r} must be one of {PATTERNS}.")
        if self.pattern in PADDED_PATTERNS and self.batch < 2:
            raise ValueError(f"MaskCase(pattern={self.pattern!r}) pads batch item 1: give batch >= 2.")
        if self.loss_mask and self.pattern not in PADDED_PATTERNS:
            raise ValueError(f"MaskCase.loss_mask zeroes dO on padding rows: give a padded pattern {PADDED_PATTERNS}.")
        if self.pattern == "random" and not 0 <= self.amount <= 1:
            raise ValueError(f"MaskCase.amount = {self.amount} is the kept fraction of a random mask: give 0..1.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def mask(self) -> torch.Tensor | None:
        """The (B, 1, Q, K) boolean mask on the CPU (None for pattern 'none')."""
        if self.pattern == "none":
            return None
        n, amount = self.seqlen, int(self.amount)
        mask = torch.ones(self.batch, 1, n, n, dtype=torch.bool)
        if self.pattern == "rows":
            mask[:, :, :amount] = False
        elif self.pattern == "leading":
            mask[:, :, :amount, : self.block_n] = False
        elif self.pattern in ("left_pad", "left_pad_self"):
            mask[1, :, :, :amount] = False
            if self.pattern == "left_pad_self":
                mask[1, :, range(amount), range(amount)] = True
        elif self.pattern == "right_pad":
            mask[1, :, :, n - amount :] = False
        elif self.pattern == "random":
            generator = torch.Generator().manual_seed(self.seed + 7)
            mask = torch.rand(mask.shape, generator=generator) < self.amount
        return mask

    def inputs(self, device=None) -> dict[str, torch.Tensor | None]:
        """q, k, v, d_out (B, S, H, D) and the mask, drawn on the CPU from `seed`, then moved."""
        device = default_device() if device is None else torch.device(device)
        generator = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, self.seqlen, self.heads, self.head_dim)
        tensors = {n: torch.randn(shape, generator=generator).to(self.torch_dtype).to(device) for n in ("q", "k", "v", "d_out")}
        if self.loss_mask:
            tensors["d_out"][~self.real_query_rows().to(device)] = 0
        mask = self.mask()
        return tensors | {"mask": None if mask is None else mask.to(device)}

    def reduction_lengths(self) -> dict[str, int]:
        """`error_check`'s keys= and queries= (self-attention, no GQA: both the sequence length)."""
        return {"keys": self.seqlen, "queries": self.seqlen}

    def padding_rows(self) -> torch.Tensor:
        """(B, S) bool: the padding positions of a padded pattern (none otherwise)."""
        rows = torch.zeros(self.batch, self.seqlen, dtype=torch.bool)
        amount = int(self.amount)
        if self.pattern in ("left_pad", "left_pad_self"):
            rows[1, :amount] = True
        elif self.pattern == "right_pad":
            rows[1, self.seqlen - amount :] = True
        return rows

    def real_query_rows(self) -> torch.Tensor:
        """(B, S) bool: query rows a loss reads: not padding, and with at least one visible key."""
        n = self.seqlen
        mask = self.mask()
        visible = torch.ones(self.batch, 1, n, n, dtype=torch.bool) if mask is None else mask.clone()
        if self.causal:
            visible &= torch.ones(n, n, dtype=torch.bool).tril()
        return visible.any(-1)[:, 0] & ~self.padding_rows()


# The original report's configuration: 1 x 256 x 1 x 64, causal, bf16, no mask, torch.manual_seed(42).
SEED = MaskCase("the report's config (no mask)", "none", seqlen=256, head_dim=64, causal=True, seed=42)

UPSTREAM_TENSORS = ("out", "dq", "dk", "dv")  # 1.2.2's triton_dmattn_func returns no lse

# The upstream kernel's cases (dtype set per device by `upstream_cases`): the original report's configuration, the
# same at a length that is not a multiple of 64 and an unmasked ragged batch, fully masked rows, a fully masked leading block, and a left-padded causal batch (HF's 4-D padding
# mask), without and with a loss mask, then the two workarounds: pad on the right, or let each
# padding query row see itself.
_PAD = dict(amount=40, batch=2, causal=True)

# The H200 record (data/gpu/flash-dmattn-121-h200.json, 2026-12-01) names the original report's two
# configurations as they were named when it was made; `recorded` reads an entry of it by either name.
RECORDED_AS = {
    "the report's config (no mask)": "seed config (no mask)",
    "the report's config at Q=K=200 (not a multiple of 64)": "seed config at Q=K=200 (not a multiple of 64)",
}


def recorded(entries: dict, name: str):
    """`entries[name]` of a GPU record, under the name the record gives it (`RECORDED_AS`); None if absent."""
    return entries.get(name, entries.get(RECORDED_AS.get(name, name)))


def shown_name(name: str) -> str:
    """The name a page shows for a case a GPU record names `name` (its present name)."""
    return next((shown for shown, old in RECORDED_AS.items() if old == name), name)


UPSTREAM_CASES = (
    SEED,
    MaskCase("the report's config at Q=K=200 (not a multiple of 64)", "none", seqlen=200, head_dim=64, causal=True, seed=42),
    MaskCase("no mask, Q=K=100", "none", seqlen=100),
    MaskCase("8 fully masked rows", "rows", amount=8),
    MaskCase("leading block masked, 16 rows", "leading", amount=16),
    MaskCase("left-padded batch (40), causal", "left_pad", **_PAD),
    MaskCase("left-padded, loss mask on padding", "left_pad", loss_mask=True, **_PAD),
    MaskCase("workaround: right-padded, loss mask", "right_pad", loss_mask=True, **_PAD),
    MaskCase("workaround: padding rows see themselves, loss mask", "left_pad_self", loss_mask=True, **_PAD),
)

SWEEP_DENSITIES = (0.02, 0.05, 0.1, 0.3)  # fraction of (query, key) pairs a random mask keeps

SWEEP_SEQLENS = (64, 100, 128)

# Lengths that are multiples of 64 (others NaN-fill dK/dV, see predict_upstream_nan_grad_items), causal and
# not, with and without a mask: square, as 1.2.2's causal mask is top-left aligned.
COVERAGE_CASES = (
    MaskCase("Q=K=128", "none", seqlen=128),
    MaskCase("Q=K=192, causal", "none", seqlen=192, causal=True),
    MaskCase("Q=K=64, all-True mask", "all", seqlen=64),
)

# The replica runs the mechanism with and without the PR's masking; bf16 as the original report (on CPU its dots
# are upcast, see varlen_workbench.kernels.interpreter). Its block skipping (`any_active`) is not in 1.2.2, which visits
# every block; on these cases both turn the same rows NaN.
REPLICA_CASES = (
    SEED,
    MaskCase("all-True mask, Q=K=100", "all", seqlen=100),  # 1.2.2 always has a mask: it makes all-ones for None
    MaskCase("8 fully masked rows", "rows", amount=8),
    MaskCase("leading block masked, 16 rows", "leading", amount=16),
    MaskCase("left-padded batch (40), causal", "left_pad", amount=40, batch=2, causal=True),
)

PADDED = REPLICA_CASES[4]

NAN_DO_ROW = 200  # a query row of the original report's configuration where dO arrives as NaN (a NaN loss term)

# PADDED packed for varlen_attention: item 1's 40 padding tokens become an empty sequence whose padded
# segment holds them (GAP rows), so no query sees them. The registry's CASES: the one packed (THD)
# layout this post-mortem studies; the dense cases are MaskCases.
_N, _NPAD = PADDED.seqlen, int(PADDED.amount)

PACKED = Case(
    seqlens_q=(_N, 0, _N - _NPAD),
    padded_q=(_N, _NPAD, _N - _NPAD),
    padded_k=(_N, _NPAD, _N - _NPAD),
    heads=PADDED.heads,
    head_dim=PADDED.head_dim,
    dtype=PADDED.dtype,
    causal=PADDED.causal,
    fill=Fill.ZEROS,
)

CASES = (PACKED,)

TRAIN_SEQLEN, TRAIN_HEADS, TRAIN_HEAD_DIM, TRAIN_VOCAB = 64, 1, 16, 32

TRAIN_STEPS = 4

TRAIN_VARIANTS = (
    "flash-dmattn 1.2.2",
    "1.2.2 + proposed patch (replica)",
    "1.2.2, sanitized (nan_to_num on out, dq, dk, dv)",
    "workaround on 1.2.2: padding rows see themselves",
)

SHOWN_VARIANTS = (TRAIN_VARIANTS[0], TRAIN_VARIANTS[2], TRAIN_VARIANTS[3])  # the patch's run looks like 1.2.2's: NaN

TRAIN_PAD = 24  # the padding the explorer opens on and the training claim is checked at

GPU_SEEDS = tuple(range(8))  # the original report's configuration over 8 random draws

# Who is affected, as data: batches of two items, 2 heads of 16, float16, as flash-dmattn's API takes them
# (attn_mask (B, H, Q, K)). The paste-block battery runs the page's check on each against 1.2.2's own Triton
# kernel, under the interpreter.
_BATCH = MaskedBatch(lengths_k=(64, 64), seq=64, head_dim=16, mask_shape="none")
WHO = Affected(
    scope=(
        "**Library:** `flash-dmattn` **1.2.2** (`flash_dmattn.triton_dmattn_func`, also chosen by "
        "`flash_dmattn_func_auto` when the CUDA extension is not built). Its successor **`flash-sparse-attn` 2.x** has "
        "no boolean-mask API; 2.0.6 does not import without `triton_kernels`, which it does not declare (its dense "
        "kernel, run on the H200 below, is another code path).",
        "**Backends:** the Triton backend, run here on CPU through the interpreter and natively on an H200. The CUDA "
        "backend (where #121 was filed) needs a compiled extension we cannot build; this page makes no claim about it.",
    ),
    layouts=(
        Layout(
            "A query length that is not a multiple of 64",
            True,
            "the backward's row block is 64: every batch item gets NaN in dK and dV, whatever the mask. Lengths that "
            "are multiples of 64, such as the report's 256, are clean.",
            _BATCH.with_(lengths_k=(100, 100), seq=100),
        ),
        Layout(
            "Left padding with `is_causal=True`",
            True,
            "the padded item's first rows see none of keys 0-63 after the causal mask: NaN output rows, and NaN in that "
            "item's dK and dV.",
            _BATCH.with_(lengths_k=(64, 44), left=True, is_causal=True, mask_shape="(B, H, S, S)"),
        ),
        Layout(
            "A per-head mask where a row sees none of keys 0-63",
            True,
            "read per head: one head's row is enough.",
            _BATCH.with_(keyless_rows=10, mask_shape="(B, H, S, S)"),
        ),
        Layout(
            "The same as a float mask (`> 0` attends), with an `attn_bias`",
            True,
            "the kernel reads a float mask as a bool one, and a bias changes no row's visibility.",
            _BATCH.with_(keyless_rows=10, mask_shape="(B, H, S, S)", mask_dtype="float", bias=True),
        ),
        Layout(
            "An empty key sequence",
            True,
            "every row of that item sees no key.",
            _BATCH.with_(lengths_k=(64, 0), mask_shape="(B, H, S, S)"),
        ),
        Layout(
            "No mask, an all-True mask, or right padding, at a length that is a multiple of 64",
            False,
            "every row sees key 0, and every row block is full.",
            _BATCH.with_(lengths_k=(64, 40), mask_shape="(B, H, S, S)"),
        ),
    ),
)
