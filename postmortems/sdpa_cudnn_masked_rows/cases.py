"""What sdpa-cudnn-masked-rows studies: META, the keyless-row cases and the tolerances."""

from __future__ import annotations

import re

from varlen_workbench.workbench.affected import Affected, Layout, MaskedBatch
from varlen_workbench.workbench.layout import Case, Fill
from varlen_workbench.workbench.postmortem import (
    Link,
    Meta,
)
from varlen_workbench.workbench.upstream_status import finding_status

PT = "https://github.com/pytorch/pytorch"

META = Meta(
    id="sdpa-cudnn-masked-rows",
    title="torch SDPA's cuDNN backend gives query rows with no visible key a finite, non-zero output",
    component="PyTorch / scaled_dot_product_attention, cuDNN backend, boolean attn_mask",
    category="training bug",
    impact="a real query row whose boolean mask row is all False (empty key sequence, causal with len_q > len_k) "
    "gets attention over every key slot instead of 0, and its gradient reaches keys it must not see: silent; on an "
    "H200 with torch 2.11, SDPA runs cuDNN for masked calls by default, so no opt-in is needed to hit it",
    our_verdict="reproduced on an H200 (torch 2.11.0+cu130, cuDNN 9.19): SDPA picks cuDNN unasked; a float mask of "
    "-65504 gives cuDNN's boolean-mask result bit for bit and -inf gives 0, confirming the finite-fill mechanism "
    "that our CPU replica reproduces to three digits",
    detection="none at run time: outputs are finite; rows whose mask row is all False are non-zero, and differ from "
    "the math backend's output there (0)",
    fix_type="upstream: fix merged in torch 2.12.0 (a -inf fill; not run here); on 2.11: pass an additive float mask with "
    "-inf, zero the rows with no visible key after the call, or keep the cuDNN backend off for masked calls; ours: a "
    "varlen kernel that writes 0 there by contract",
    tags=("attention mask", "fully masked rows", "silent error", "audit finding"),
    reported="2026-03-19",  # pytorch#177842, filed on or before the day PR #177868 ("To fix #177842") was opened
    published="2026-12-01",
    revised="2026-12-05",
    links=(
        Link(
            "pytorch#103749: SDPA produces NaN with padding mask (fully masked rows)",
            f"{PT}/issues/103749",
            "2023-06-16",
            "issue",
            "closed",
        ),
        Link(
            "pytorch#131060: add a private _safe_softmax (fully masked rows give 0)",
            f"{PT}/pull/131060",
            "2024-07-18",
            "PR",
            "closed",
        ),
        Link(
            "pytorch#133882: update fused kernels and call _safe_softmax from SDPA (take 3 of #131863)",
            f"{PT}/pull/133882",
            "2024-08-19",
            "PR",
            "closed",
        ),
        Link(
            "pytorch#140837: cuDNN bool-mask fill -65504 -> -1024 (diff context shows -65504)",
            f"{PT}/pull/140837",
            "2024-11-15",
            "PR",
            "closed; reviewers uneasy about the 'magic number'",
        ),
        Link(
            "pytorch#177842: When using the cuDNN backend, custom masks become ineffective (title read; filed on or "
            "before 2026-03-19)",
            f"{PT}/issues/177842",
        ),
        Link(
            "pytorch#177868: fix the cuDNN attn-mask conversion constant, 'To fix #177842'",
            f"{PT}/pull/177868",
            "2026-03-19",
            "PR",
            "merged: listed in the torch 2.12.0 release notes, Bug fixes, cuDNN",
        ),
        Link(
            "PyTorch 2.12.0 release notes: '[cuDNN][SDPA] Fix attn-mask conversion constant (#177868)' under cuDNN fixes",
            f"{PT}/releases/tag/v2.12.0",
        ),
        Link(
            "pytorch#162073: enable cuDNN SDPA by default for SM 9.0 and SM 10.0 (for 2.9)",
            f"{PT}/pull/162073",
            "2025-09-03",
            "PR",
            "closed; merge requested 2025-09-04",
        ),
        Link(
            "pytorch#191612: another silent cuDNN masked path: an fp32 attn_mask described to cuDNN in the query's dtype",
            f"{PT}/pull/191612",
            "2026-07-30",
            "PR",
            "closed",
        ),
        Link(
            "transformers#48163: cuDNN is already SDPA's default on Hopper with a new enough cuDNN (comment)",
            "https://github.com/huggingface/transformers/pull/48163",
            "2026-08-31",
            "PR",
            "closed",
        ),
        Link(
            "diffusers#14349: a -inf vs finfo.min fill on a fully masked row gives zeros vs mean(V) (its own cuDNN path)",
            "https://github.com/huggingface/diffusers/pull/14349",
            "2026-07-31",
            "PR",
            "open",
        ),
        Link(
            "pytorch#196678: cuDNN backward NaN dq with attn_mask, 'default backend' since 2.11 (another bug, same path)",
            f"{PT}/issues/196678",
            "2026-09-11",
            "issue",
            "closed",
        ),
        Link(
            "sdp_utils.cpp at the commit read: check_prefer_cudnn_attention, can_use_cudnn_attention",
            f"{PT}/blob/001f694aef6f922b4fdf6d27d59162d27bf3df58/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp",
        ),
    ),
)
STATUS = finding_status(META.id, __file__)  # where upstream stands: data/upstream-status.toml

# torch's boolean -> additive mask conversion for the cuDNN backend fills False with this finite value
# (`convert_boolean_attn_mask_cudnn`, "workaround -inf issue with cuDNN"; -65504.0 in PR #140837's diff
# context; on the H200, torch 2.11's cuDNN result with a float mask of this value equals the boolean
# mask's bit for bit). The replica below feeds exactly that additive mask to the math backend.
CUDNN_FILL = -65504.0

# The two failing cases of the H200 record, exactly (the audit's Context: H=2, D=64, fp16, zero padding).
FULLY = Case((3, 2, 4), seqlens_k=(3, 0, 2), heads=2, head_dim=64, dtype="float16", causal=True, seed=0, fill=Fill.ZEROS)

UNEQUAL = Case((6, 9), seqlens_k=(4, 9), heads=2, head_dim=64, dtype="float16", causal=True, seed=1, fill=Fill.ZEROS)

CASES = (FULLY, UNEQUAL)

CHECK_OF = {FULLY: "fully-masked-rows", UNEQUAL: "causal-unequal"}

POISONED = {FULLY: True, UNEQUAL: False}  # as the audit's checks probed them

TENSORS = ("out", "dq", "dk", "dv")

RECORD_TOLERANCE = 0.02  # relative: the record prints 3 significant digits; cuDNN rounds its output to fp16 itself

_ERROR = re.compile(r"(out|dq|dk|dv): error ([0-9.e+-]+) > bound ([0-9.e+-]+) \(([0-9.e+-]+)x PyTorch's own error\)")

# (lengths q, lengths k) of each probed layout: the record's two, and a larger bf16-sized one.
GPU_LAYOUTS = {
    "fully-masked-rows": ((3, 2, 4), (3, 0, 2)),
    "causal-unequal": ((6, 9), (4, 9)),
    "larger": ((300, 64, 128, 17), (0, 40, 128, 5)),
}

# Who is affected, as data: padded batches of three items (6 positions, 2 heads of 16, float16) with the masks
# users pass SDPA. The paste-block battery runs the page's check and workarounds on each, against the
# replica of cuDNN's boolean-mask path (`cudnn_mask_replica`, the finite fill; what the H200 record confirms
# bit for bit) and torch's own backends.
_PADDED = MaskedBatch(lengths_k=(6, 4, 5), seq=6, mask_shape="(B, 1, 1, S)", seed=2)
WHO = Affected(
    scope=(
        "**Backend:** SDPA on the cuDNN backend with an explicit **boolean** `attn_mask`. `is_causal=True` without a "
        "mask is not this path. The math and memory-efficient backends match the oracle's 0 on those rows (within the "
        "bound, on the same H200 calls, recorded below); FlashAttention takes no mask.",
        "**cuDNN runs without being asked.** On our H200 (torch 2.11.0+cu130, its bundled cuDNN), "
        "`scaled_dot_product_attention` called with no `sdpa_kernel` context ran the cuDNN backend, forward and "
        "backward, for every masked call we profiled: boolean and float masks, GQA, fp16 and bf16 (the profiler's "
        "aten ops and kernel names, table under *On GPU*). The source agrees: `check_prefer_cudnn_attention()` in "
        "`sdp_utils.cpp` (read at the commit in the references) puts cuDNN first on sm90/sm100 when the runtime cuDNN "
        "is newer than 9.15.0. So anyone training on Hopper with torch 2.11 and a mask that leaves a row empty is "
        "affected unless they turned cuDNN off. Other GPUs and other torch releases were not measured.",
        "**torch releases:** 2.11 is affected (recorded). The 2.12.0 release notes list PR #177868, which changes the "
        "constant torch fills masked positions with for cuDNN; torch 2.12 and later were not run here, so whether "
        "they give these rows 0 is open.",
    ),
    layouts=(
        Layout(
            "An empty key sequence",
            True,
            "a cross-attention item with an empty context, a key sequence of length 0 in a packed-to-padded batch: "
            "its real query rows see no key, and cuDNN's finite fill makes each of them attend every key slot of its "
            "item.",
            _PADDED.with_(lengths_k=(6, 0, 5)),
        ),
        Layout(
            "Bottom-right causal attention with more queries than keys",
            True,
            "the first `len_q - len_k` query rows see no key.",
            _PADDED.with_(lengths_q=(6, 6, 6), lengths_k=(4, 6, 6), causal=True, mask_shape="(B, 1, S, S)"),
        ),
        Layout(
            "A sliding window that leaves rows without a key",
            True,
            "a window aligned bottom-right over more queries than keys leaves the first rows none: the audit's "
            "sliding-window failure on the H200 (our replica of the fill reproduces its error, and every row it gets "
            "wrong is such a row; Report it upstream, below).",
            _PADDED.with_(lengths_q=(6, 6, 6), lengths_k=(3, 6, 6), window=(2, 1), mask_shape="(B, 1, S, S)"),
        ),
        Layout(
            "Per-head masks that leave one head's row without a key",
            True,
            "block or dynamic masks that differ by head.",
            _PADDED.with_(keyless_rows=1, mask_shape="(B, H, S, S)"),
        ),
        Layout(
            "Grouped K/V (`enable_gqa=True`) with an empty key sequence",
            True,
            "the query heads of a group see no key alike.",
            _PADDED.with_(lengths_k=(6, 0, 5), kv_heads=1),
        ),
        Layout(
            "Masks with at least one `True` per row",
            False,
            "each masked key's score is lowered by 65504, so next to a visible key its weight underflows to 0.",
            _PADDED,
        ),
        Layout(
            "An additive float mask with `-inf` where a key is hidden",
            False,
            "torch converts only boolean masks to the finite fill; on the H200, cuDNN given `-inf` returned 0 on every "
            "row that sees no key (workaround (b') below).",
            _PADDED.with_(lengths_k=(6, 0, 5), mask_dtype="additive"),
        ),
    ),
    notes=(
        "**Not harmed:** padded query rows you drop and whose loss is masked (they also come out non-zero on cuDNN, "
        "but nothing reads them and `dO = 0` there).",
    ),
)
