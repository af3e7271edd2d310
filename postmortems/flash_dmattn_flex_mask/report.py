"""The upstream report flash-dmattn-flex-mask offers, ready to file: the Flex backend's dropped mask."""

from __future__ import annotations

from varlen_workbench.postmortems.flash_dmattn_flex_mask.cases import GPU_RECORD
from varlen_workbench.postmortems.flash_dmattn_flex_mask.upstream import (
    SOURCE,
    SUCCESSOR_VERSION,
    UPSTREAM_FILE,
    UPSTREAM_VERSION,
)
from varlen_workbench.workbench.upstream_report import Source, UpstreamReport

_AT = SOURCE.at  # SmallDoges/flash-dmattn@<tag v1.2.2>
_FILE = f"https://github.com/{_AT.replace('@', '/blob/')}/{UPSTREAM_FILE}"

REPRO = """
# flash-dmattn 1.2.2 flex_dmattn_func never applies attn_mask
import torch
from flash_dmattn.flash_dmattn_flex import flex_dmattn_func

torch.manual_seed(0)
q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))  # (batch, seq, heads, head dim)
mask = torch.ones(1, 2, 8, 8, dtype=torch.bool)
mask[..., 5:] = False  # keys 5-7 are padding
with torch.compiler.set_stance("force_eager"):  # eager: on a CPU the compiled call crashes (torch 2.13)
    out = flex_dmattn_func(q, k, v, attn_mask=mask, is_causal=False)
    out_no_mask = flex_dmattn_func(q, k, v, attn_mask=torch.ones_like(mask), is_causal=False)
want = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
).transpose(1, 2)
print("bit-identical to the unmasked call:", torch.equal(out, out_no_mask))
print(f"max |out - SDPA with the mask| = {(out - want).abs().max().item():.2f}")
"""

REPORT = UpstreamReport(
    title="flex_dmattn_func ignores attn_mask: its only mask_mod is q_idx >= kv_idx, applied only when is_causal",
    file_at="https://github.com/HKUSTDial/flash-sparse-attention/issues/new",
    versions=(
        f"flash-dmattn {UPSTREAM_VERSION} (the last release; every tag since v0.1.0 has the same lines), and "
        f"flash-sparse-attn {SUCCESSOR_VERSION}, whose `deprecated/flash_sparse_attn_flex.py` is the same function",
        "torch 2.13.0 on a CPU (eager FlexAttention) and torch 2.11.0+cu130 on an H200 (compiled), transformers installed",
    ),
    repro=REPRO,
    prints=("bit-identical to the unmasked call: True", "max |out - SDPA with the mask| = 1.07"),
    expected="keys the mask hides get weight 0: the output equals SDPA's with the same mask, to rounding, and differs "
    "from the call with an all-True mask.",
    actual="the mask changes no bit of the output: padded keys are attended, and every row whose mask row is not all "
    "True gets a finite, wrong output (no warning). A padding mask, a document mask and the library's own top-k mask "
    "(`flash_dmattn.utils.mask.create_mask`) are dropped alike.",
    shown=f"this repro, run as shown on a CPU (this page's paste-block battery); on the H200 the page's study gave the "
    f"same bits for four masks, compiled (`{GPU_RECORD}`), and the audit failed five checks with finite, wrong "
    "outputs (`data/gpu/audit-dmattn-flex.json`)",
    suspected=(
        Source(
            UPSTREAM_FILE,
            43,
            _AT,
            "# return q_idx >= kv_idx and attn_mask[batch_idx][head_idx][q_idx][kv_idx] > 0",
            f"{_FILE}#L40-L44",
        ),
        Source(UPSTREAM_FILE, 68, _AT, "block_mask=block_mask if is_causal else None,", f"{_FILE}#L68"),
    ),
    fix="read the mask in the `mask_mod` with `&` (Python's `and` is what failed to trace): `keep = attn_mask[b][h]"
    "[q_idx][kv_idx] > 0` and `return keep & (q_idx >= kv_idx) if is_causal else keep`, and build the `BlockMask` "
    "from it in both branches. Through torch's `flex_attention`, that `mask_mod` gave the right forward on every case "
    'the audit failed, on a CPU and on the H200. Until then, the documentation\'s "Attention Mask: limited" for this '
    'backend should say "ignored".',
    related=(
        'the docs also tick "GQA Support" for this backend, but `flex_attention` is called without `enable_gqa`, so '
        "grouped K/V raise a `ValueError`",
    ),
)
