"""What flash-dmattn-flex-mask studies: META, the audited checks and their cases, the implementations compared, the
records read."""

from __future__ import annotations

import re
from typing import Any

from varlen_workbench.workbench.affected import Affected, Layout, MaskedBatch
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.postmortem import (
    Link,
    Meta,
)
from varlen_workbench.workbench.upstream_status import finding_status

META = Meta(
    id="flash-dmattn-flex-mask",
    title="flash-dmattn: the Flex backend ignores attn_mask, so padded keys are attended and outputs and gradients are silently wrong",
    component="flash-dmattn 1.2.2 (now flash-sparse-attn) / Flex backend (flex_dmattn_func)",
    category="training bug",
    impact=(
        "flash-dmattn <= 1.2.2 flex_dmattn_func: any padding, document or top-k attn_mask is dropped; "
        "finite outputs and gradients {h200_error_ratios} times PyTorch's own error on the H200, no warning"
    ),
    our_verdict=(
        "confirmed on the upstream code, CPU and H200: attn_mask changes no bit of the output; only rows whose mask "
        "row is all True are right; passing the mask as a -inf attn_bias, or torch's flex_attention with a mask_mod "
        "reading the mask, gives the right forward"
    ),
    detection="none: outputs and gradients stay finite; compare with another backend, or flip the mask and see nothing change",
    fix_type="workarounds: the mask as a -inf attn_bias (same function), or flex_attention with a BlockMask; upstream: a mask_mod that also reads attn_mask",
    tags=("attention mask", "padding", "silent error", "audit finding"),
    reported="2026-12-01",
    published="2026-12-01",
    links=(
        Link(
            "the Flex backend appears (af27f2e): mask_mod already q_idx >= kv_idx",
            "https://github.com/SmallDoges/flash-dmattn/commit/af27f2e10cd8dd7cecf45ae2bb5de27b5f0056cf",
            date="2025-07-03",
            kind="commit",
            status="the attn_mask line commented out since the first version",
        ),
        Link(
            "API docs: Flex backend 'Avoid when strict attention mask compliance is required' (d5b9be6)",
            "https://github.com/SmallDoges/flash-dmattn/commit/d5b9be6f086dc94f6fee9549b97b3a95267606ef",
            date="2025-09-08",
            kind="docs",
            status="a warning; attn_mask still documented as a parameter",
        ),
        Link(
            "flash-sparse-attention#146 (flex path of the example model)",
            "https://github.com/HKUSTDial/flash-sparse-attention/issues/146",
            date="2025-09-03",
            kind="issue",
            status="closed by #147, which removed the example's flex path; flex_dmattn_func untouched",
        ),
        Link(
            "flash-dmattn 1.2.2",
            "https://pypi.org/project/flash-dmattn/1.2.2/",
            date="2025-11-05",
            kind="release",
            status="last flash-dmattn release; flash_dmattn_flex.py as at tag v1.2.2 (1dcc395)",
        ),
        Link(
            "the same function as flash_sparse_attn_flex.py (e02668c)",
            "https://github.com/SmallDoges/flash-dmattn/commit/e02668c0b47e6db62c33857ec34051ec860b385b",
            date="2025-11-09",
            kind="commit",
            status="copied unchanged into the renamed package",
        ),
        Link(
            "flash-sparse-attn 2.0.6",
            "https://pypi.org/project/flash-sparse-attn/2.0.6/",
            date="2026-09-09",
            kind="release",
            status="latest; the function kept in flash_sparse_attn/deprecated/, not exported",
        ),
        Link(
            "flash_dmattn_flex.py at v1.2.2",
            "https://github.com/SmallDoges/flash-dmattn/blob/1dcc395d495318c3f0cee27353b9afadc3928650/flash_dmattn/flash_dmattn_flex.py",
        ),
        Link(
            "API reference at v1.2.2 (backend table, lines 85-121)",
            "https://github.com/SmallDoges/flash-dmattn/blob/1dcc395d495318c3f0cee27353b9afadc3928650/docs/api_reference.md",
        ),
        Link(
            "transformers' compile_friendly_flex_attention (read at 2ccc6ca)",
            "https://github.com/huggingface/transformers/blob/2ccc6cae21faaf11631efa5fb9054687ae5dc931/src/transformers/integrations/flex_attention.py",
        ),
    ),
)
STATUS = finding_status(META.id, __file__)  # where upstream stands: data/upstream-status.toml

AUDIT_RECORD = "audit-dmattn-flex.json"

GPU_RECORD = f"data/gpu/{META.id}-h200.json"

GPU_COMMAND = f"varlen-workbench repro {META.id} --device cuda --record {GPU_RECORD}"

# check of the audit -> (the first case it failed on, keyword arguments of the call)
AUDITED: dict[str, tuple[Case, dict[str, Any]]] = {
    "real-accuracy": (Case((5, 3, 7), heads=2, head_dim=64, dtype="float16", fill="zeros"), {}),
    "empty-sequences": (Case((3, 0, 4, 0), heads=2, head_dim=64, dtype="float16", fill="zeros"), {}),
    "custom-scale": (Case((5, 9), heads=2, head_dim=64, dtype="float16", fill="zeros"), {"scale": 0.3}),
    "fully-masked-rows": (
        Case((3, 2, 4), seqlens_k=(3, 0, 2), heads=2, head_dim=64, dtype="float16", causal=True, fill="zeros"),
        {},
    ),
    "causal-unequal": (
        Case((5, 3), seqlens_k=(9, 7), heads=2, head_dim=64, dtype="float16", causal=True, fill="zeros"),
        {},
    ),
    "fuzz:real-accuracy": (Case((1, 2), heads=1, head_dim=64, dtype="bfloat16", fill="zeros"), {}),
}

CASES = tuple(case for case, _ in AUDITED.values())

STUDY = AUDITED["real-accuracy"][0]  # q=[5, 3, 7]: the picture's batch

GPU_SEEDS = (0, 1, 2)

_RATIO = re.compile(r"(\w+): error [^;]*?\(([\d.e+]+)x PyTorch's own error\)")

IMPLS = ("flex_dmattn_func", "(a) mask as -inf attn_bias", "(b) torch flex_attention + BlockMask", "(c) our varlen_attention")

# Who is affected, as data: padded batches of three items (5, 3 and 8 real keys of 8), 2 heads of 16, float16,
# each mask form flash-dmattn's API accepts (its head dim 1, nheads_k or nheads). The paste-block battery runs
# the page's check and workarounds on each, against flex_dmattn_func 1.2.2 itself.
_PADDED = MaskedBatch(lengths_k=(5, 3, 8), seed=1)
WHO = Affected(
    scope=(
        "**flash-dmattn v0.1.0 to v1.2.2** (every tagged release; the line was already there when the backend "
        "appeared in July 2025), when `flex_dmattn_func` runs: called directly, through "
        '`flash_dmattn_func_auto(backend="flex")`, or by `flash_dmattn_func_auto()` on a machine where neither the '
        "CUDA extension nor Triton imports.",
        "**flash-sparse-attn 2.0.6**: the identical function survives as "
        "`flash_sparse_attn.deprecated.flash_sparse_attn_flex.flex_sparse_attn_func` (not exported from the package "
        "root; v1.2.3 exported it as the Flex backend).",
        "**On a CPU** the compiled call does not get that far: with torch 2.13, `flex_dmattn_func` crashed the Python "
        "process in our runs (SIGSEGV, or glibc's `free(): invalid size`). The check and workarounds below run "
        "FlexAttention eagerly on a CPU, which computes the same attention.",
    ),
    layouts=(
        Layout(
            "A padding mask (B, H, S_q, S_k)",
            True,
            "right- or left-padded batches, document masks, and the top-k dynamic masks flash-dmattn is built for "
            "(`flash_dmattn.utils.mask.create_mask`): every mask is dropped, so padded keys are attended.",
            _PADDED,
        ),
        Layout(
            "A float 0/1 mask",
            True,
            "read as `> 0` by the other backends, dropped by this one.",
            _PADDED.with_(mask_dtype="float"),
        ),
        Layout(
            "Per-head masks",
            True,
            "heads that see different keys, such as flash-dmattn's per-head top-k masks: dropped alike.",
            _PADDED.with_(keyless_rows=2),
        ),
        Layout(
            "A mask shared by every head (B, 1, S_q, S_k)",
            True,
            "a shape flash-dmattn's API accepts (its mask head dim may be 1, the key/value heads or the query heads): "
            "dropped alike.",
            _PADDED.with_(mask_shape="(B, 1, S, S)", is_causal=True),
        ),
        Layout(
            "A key-padding mask (B, 1, 1, S_k)",
            True,
            "the same mask for every head and every query row, as tokenizers' attention masks give it: dropped alike.",
            _PADDED.with_(mask_shape="(B, 1, 1, S)"),
        ),
        Layout("A mask with your own `attn_bias`", True, "the bias is added, the mask still dropped.", _PADDED.with_(bias=True)),
        Layout(
            "A padding mask with `is_causal=True`",
            True,
            "only `q_idx >= kv_idx` is applied: keys a row may see under causality but that the mask hides are attended.",
            _PADDED.with_(is_causal=True),
        ),
        Layout("An empty key sequence", True, "its rows attend the padded keys.", _PADDED.with_(lengths_k=(5, 0, 8))),
        Layout(
            "No mask, or an all-True one",
            False,
            "nothing to drop: `is_causal=True` (or `None`) applies top-left causality `q_idx >= kv_idx`, which is "
            "right for equal query and key lengths.",
            _PADDED.with_(lengths_k=(8, 8, 8)),
        ),
        Layout(
            "Grouped K/V (fewer key/value heads than query heads)",
            False,
            "`flex_attention` is called without `enable_gqa`, so the call raises a `ValueError` (the docs tick "
            '"GQA Support" for this backend, which does not hold).',
            _PADDED.with_(kv_heads=1),
            refused="ValueError",
        ),
    ),
    notes=(
        "The Triton and CUDA backends read `attn_mask` (the Triton one has its own NaN bug: "
        "[flash-dmattn-121](flash-dmattn-121.html)).",
    ),
)
