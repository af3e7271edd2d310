"""What fa4-unwritten-padding studies: META, the layouts and the H200 records it reads."""

from __future__ import annotations

from varlen_workbench.workbench.affected import Affected, Layout
from varlen_workbench.workbench.layout import Case, Fill
from varlen_workbench.workbench.postmortem import Link, Meta
from varlen_workbench.workbench.upstream_status import finding_status

FA = "https://github.com/Dao-AILab/flash-attention"

META = Meta(
    id="fa4-unwritten-padding",
    title="FlashAttention-4 leaves padding rows of out and of dq, dk, dv unwritten: NaN gradients on packed batches with TAIL rows",
    component="FlashAttention-4 (flash-attn-4 4.0.0b36) / flash_attn.cute.flash_attn_varlen_func",
    category="training bug",
    impact="rows past cu_seqlens[-1] (TAIL) and past seqused inside a slot (GAP) keep whatever memory held in out, dq, "
    "dk and dv; through the QKV projection they reach the weight gradients: a real training step gets NaN or silently "
    "wrong gradients",
    our_verdict="found by our audit on an H200 (flash-attn-4 4.0.0b36, torch 2.11.0+cu130) and confirmed by a real "
    "transformers training step there; the mechanism (torch.empty, rows no program covers) reproduced on the CPU with "
    "our replica; source read in the 4.0.0b36 wheel",
    detection="none in the loss: it stays finite with memory as is; gradient norms of the layers below attention "
    "explode or turn NaN, and NaN-poisoned memory makes every gradient NaN",
    fix_type="workaround today: zero the padding rows of q, k, v and of out with torch.where around the call; "
    "upstream: zero-initialised out/dq/dk/dv, or stores of 0 into rows no sequence covers",
    tags=("FlashAttention-4", "uninitialised memory", "TAIL rows", "GAP rows", "NaN gradients", "audit finding"),
    reported="2026-12-01",  # our audit run on the H200 (data/gpu/audit-fa4.json); no upstream report
    published="2026-12-01",
    revised="2026-12-07",
    links=(
        Link(
            "flash-attention#1228: padding rows past cu_seqlens[-1] uninitialised, NaN/inf forward and backward (FA2)",
            f"{FA}/issues/1228",
            "2024-09-14",
            "issue",
            "open",
        ),
        Link(
            "flash-attention#1990: FA3 varlen with seqused as padding between sequences: 'issues with the backward'",
            f"{FA}/issues/1990",
            "2025-11-06",
            "issue",
            "open",
        ),
        Link(
            "flash-attention#2167: [Cute,Bwd,Sm100] fix seqused in varlen bwd; 'we currently don't store zero to the "
            "unused region for seqused_{q,k}, so the tests fill zero for this region'",
            f"{FA}/pull/2167",
            "2026-01-10",
            "PR",
            "merged",
        ),
        Link(
            "flash-attention#2324: FA2/FA3 gradients from torch.empty, an opt-in autograd function zeroes the padding",
            f"{FA}/pull/2324",
            "2026-03-10",
            "PR",
            "closed",
        ),
        Link(
            "flash-attention#2562: FA4 varlen padded with zero-length sequences (cu_seqlens_q=[0, 0, ...]); the hdim-256 "
            "backward crashed on it",
            f"{FA}/issues/2562",
            "2026-05-13",
            "issue",
            "closed: PR #2568 (merged 2026-05-16, 8a8b2f1) writes zero for zero-length sequences in the hdim-256 kernels",
        ),
        Link(
            "TE#3205: TransformerEngine runs FA3/FA4 with padding between sequences; 'FA3/FA4 can leave these positions "
            "unwritten', so TE zeroes the padding rows (GAP and TAIL) of out and of dq, dk, dv around its call when pad_between_seqs is set",
            "https://github.com/NVIDIA/TransformerEngine/pull/3205",
            "2026-07-13",
            "PR",
            "open; its commit 3bb2858 (2026-07-12) not on TransformerEngine's main at d0067d0 (2026-08-22)",
        ),
        Link(
            "flash-attention#2776: [CuTe, Bwd] zero dq, dk, dv when q or k has no row at all (not for empty sequences "
            "inside a packed batch)",
            f"{FA}/pull/2776",
            "2026-08-09",
            "PR",
            "merged per the tracker; its commits ce53288 (2026-08-09) and 6648aa4 not on main at 0251105 (2026-08-15)",
        ),
    ),
)
STATUS = finding_status(META.id, __file__)  # where upstream stands: data/upstream-status.toml

# The audit's tail-rows layout (q=[5, 3], 4 TAIL query rows, 3 TAIL key rows), at a head dim and
# dtype the CPU replica runs quickly; garbage padding as the audit had it.
TAIL = Case((5, 3), tail_q=4, tail_k=3, heads=2, head_dim=16, dtype="float16", fill=Fill.GARBAGE, seed=0)
# The same with NaN in the padding rows of q, k, v: what the workaround must survive too.
TAIL_NAN = TAIL.with_(fill=Fill.NAN)
CASES = (TAIL, TAIL_NAN)

AUDIT = "audit-fa4.json"
ROW = "fa4"  # the audit matrix's row of that record: its FAILs are judged there (data/audit/judgements.toml)
REAL_CLIENT = "real-client-h200-fa4.json"
# The audit checks whose FAILs are this mechanism (data/audit/judgements.toml), and the regions each names.
CHECKS = {"tail-rows": ("TAIL",), "gap-rows": ("GAP",), "no-real-query": ("TAIL",), "sliding-window": ("GAP", "TAIL")}
# The fuzzer's FAILs of the same mechanism, and the FAILs that reach REAL rows only through NaN planted in
# padded K/V (0 x NaN, another mechanism): with CHECKS, every FAIL the claims say the record holds.
FUZZ_CHECKS = ("fuzz:tail-rows", "fuzz:gap-rows")
NAN_PADDING = ("padding-leak", "fuzz:real-accuracy")

# The upstream source read: FA4's newest tag in the repository, fa4-v4.0.0.beta27. The 4.0.0b36 wheel
# that ran on the H200 has the same four allocations (its flash_attn/cute/interface.py, lines 873 and 2594-2604).
FA4_SOURCE = "Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced"
# flash_attn/cute/interface.py at FA4_SOURCE: _flash_attn_fwd (line 711) and _flash_attn_bwd (lines 2109-2117),
# each when the caller passes no buffer (flash_attn_varlen_func passes none).
UPSTREAM_ALLOCATIONS = {
    "out": "out = torch.empty(*q_batch_seqlen_shape, num_head, head_dim_v, ...)",
    "dq": "dq = torch.empty_like(q)",
    "dk": "dk = torch.empty_like(k)",
    "dv": "dv = torch.empty_like(v)",
}

# Who is affected, as data: each layout as FA4 is called with it (head dim 64, FA4's smallest; float16;
# garbage in the padding rows of q, k, v, finite as stale activations are). The paste-block battery runs
# the page's check and workaround on each, on FA4 itself on a GPU and on the replica elsewhere.
_LAYOUT = Case((5, 9), heads=2, head_dim=64, dtype="float16", fill=Fill.GARBAGE, seed=1)
_TAIL = _LAYOUT.with_(tail_q=3, tail_k=3)
_UNWRITTEN = "FA4 allocates out, dq, dk and dv with torch.empty and no program writes these rows"
WHO = Affected(
    scope=(
        "**flash-attn-4** (`flash_attn.cute.flash_attn_varlen_func`): 4.0.0b36 was run on an H200 (sm90); the "
        "allocations are the same in the newest tagged source read (fa4-v4.0.0.beta27) and in the 4.0.0b36 wheel. "
        "Training is hurt through the backward; inference gets unwritten output rows, which matter only if something "
        "reads them.",
    ),
    layouts=(
        Layout(
            "Rows past `cu_seqlens[-1]` (TAIL)",
            True,
            "a packed buffer longer than its tokens: a static token budget for `torch.compile` or CUDA graphs, a "
            f"buffer padded to a multiple. {_UNWRITTEN}.",
            _TAIL,
        ),
        Layout(
            "Rows past `seqused_q/k` inside a slot (GAP)",
            True,
            "a padded layout given as slot starts in `cu_seqlens` and real lengths in `seqused_q`/`seqused_k` "
            "(TransformerEngine's THD layout with `cu_seqlens_padded`): each sequence's stores stop at its "
            "`seqused`, and the rest of its slot keeps whatever memory held.",
            _LAYOUT.with_(seqlens_q=(5, 3, 9), padded_q=(8, 4, 12), padded_k=(8, 4, 12)),
        ),
        Layout(
            "TAIL rows of the queries only",
            True,
            "`q` longer than `cu_seqlens_q[-1]`, `k` and `v` exact: the TAIL rows of `out` and `dq` are unwritten.",
            _LAYOUT.with_(tail_q=4),
        ),
        Layout(
            "TAIL rows with grouped K/V (GQA), a sliding window or an empty sequence",
            True,
            "none of these changes which rows FA4 writes.",
            _TAIL.with_(seqlens_q=(5, 0, 9), heads=4, kv_heads=2, causal=True, window=(4, 0)),
        ),
        Layout(
            "Buffers exactly `cu_seqlens[-1]` rows long, without `seqused`",
            False,
            "every row belongs to a sequence and is written; grouped K/V, windows and empty sequences included.",
            _LAYOUT.with_(seqlens_q=(5, 0, 9), heads=4, kv_heads=2, causal=True, window=(4, 0)),
        ),
    ),
    notes=(
        "**Same mechanism elsewhere:** FlashAttention-2 and 3 allocate their gradients with `torch.empty` too "
        "(flash-attention#1228, #2324), as does torch's `varlen_attn` (the torch-varlen-176793 post-mortem).",
        "**Also in FA4, apart from this page:** NaN *in* padded K/V rows reaches REAL rows (FA4 multiplies zero "
        "weights by whole key tiles: `0 x NaN`, the audit's padding-leak); the workaround below covers it too.",
    ),
)
