"""What fsa-varlen-descriptors studies: META, the audit's calls replayed, and the H200 records it reads."""

from __future__ import annotations

from varlen_workbench.workbench.affected import Affected, Layout
from varlen_workbench.workbench.layout import Case, Fill
from varlen_workbench.workbench.postmortem import Link, Meta
from varlen_workbench.workbench.upstream_status import finding_status

META = Meta(
    id="fsa-varlen-descriptors",
    title="flash-sparse-attn 2.0.6's varlen attention faults on an H200: a misaligned lse descriptor in the backward, "
    "descriptors over empty sequences in the forward; and it leaves the rows past cu_seqlens_q[-1] unwritten",
    component="flash-sparse-attn 2.0.6 / flash_dense_attn_varlen_func, flash_sparse_attn_varlen_func (Triton)",
    category="training bug",
    impact="every varlen backward whose sequence starts or row count are not all multiples of 4 raises 'misaligned "
    "address' on an H200 and the process loses its CUDA context; a batch with an empty sequence raises 'illegal "
    "instruction' in the forward; out's and dq's rows past cu_seqlens_q[-1] (TAIL padding) hold whatever memory held, "
    "NaN under poisoned memory",
    our_verdict="found by our audit on an H200 (flash-sparse-attn 2.0.6, torch 2.11.0+cu130, Triton 3.6.0); the "
    "descriptors and the unwritten rows shown on the CPU by running the library under the Triton interpreter; the "
    "faulting kernel shown on the H200; source read at named commits",
    detection="the faults are loud: RuntimeError 'Triton Error [CUDA]: misaligned address', or 'CUDA error: an illegal "
    "instruction was encountered', and every later CUDA call of the process fails; the unwritten rows are silent",
    fix_type="workaround today: drop empty sequences from cu_seqlens, pad each sequence's queries to a multiple of 4 "
    "with dummy rows at its start, and return the rows the call does not see as 0; upstream: an early exit for empty "
    "sequences, an lse descriptor over a 16-byte aligned (padded) layout, as the kernel already uses for dPsum, and "
    "out and dq zeroed past cu_seqlens_q[-1]",
    tags=(
        "flash-sparse-attn",
        "Triton",
        "TMA",
        "tensor descriptor",
        "misaligned address",
        "empty sequences",
        "uninitialised memory",
        "audit finding",
    ),
    reported="2026-12-01",  # our audit run on the H200 (data/gpu/audit-fsa-*-varlen.json); no upstream report
    published="2026-12-02",
    revised="2026-12-05",
    links=(
        Link(
            "flash-sparse-attention#306: move every Triton kernel from make_block_ptr to make_tensor_descriptor (TMA)",
            "https://github.com/HKUSTDial/flash-sparse-attention/issues/306",
            "2026-06-04",
            "issue",
            "closed by #307",
        ),
        Link(
            "flash-sparse-attention#307: the migration, 13 kernel files; two lse paths of the decode combine kept on raw "
            "pointers, a (1,) block being below TMA's 16-byte minimum",
            "https://github.com/HKUSTDial/flash-sparse-attention/pull/307",
            "2026-06-04",
            "PR",
            "merged: the origin of the descriptors this page studies",
        ),
    ),
)
STATUS = finding_status(META.id, __file__)  # where upstream stands: data/upstream-status.toml

# The first call four audit checks made on the H200 (as the audit called fsa: 2 heads of 64, float16,
# zeros in padding rows), replayed: each raised there (data/audit/judgements.toml).
AUDIT = Case((5, 3, 7), tail_q=3, tail_k=2, heads=2, head_dim=64, dtype="float16", fill=Fill.ZEROS)  # real-accuracy
_NO_TAIL = AUDIT.with_(tail_q=0, tail_k=0)
CAUSAL = _NO_TAIL.with_(seqlens_q=(5, 3), seqlens_k=(9, 7), causal=True)  # causal-unequal: bottom-right causal
NO_KEY = _NO_TAIL.with_(seqlens_q=(3, 2, 4), seqlens_k=(3, 0, 2), causal=True)  # fully-masked-rows: a sequence with no key
EMPTY = _NO_TAIL.with_(seqlens_q=(3, 0, 4, 0))  # empty-sequences: two sequences with no query and no key
CASES = (AUDIT, CAUSAL, NO_KEY, EMPTY)
# no-real-query: every query row TAIL, garbage (finite) in the padding; the one check whose call returned on the H200.
NO_QUERY = _NO_TAIL.with_(seqlens_q=(0, 0), seqlens_k=(3, 2), tail_q=2, tail_k=1, fill=Fill.GARBAGE)
NO_QUERY_CHECK = "no-real-query"
TAIL_CASES = (AUDIT, NO_QUERY)  # the calls with TAIL rows, run again under NaN-poisoned memory
NAMED = {"audit": AUDIT, "causal": CAUSAL, "no-key": NO_KEY, "empty": EMPTY}  # for scripts/fsa_misaligned.py
WITH_EMPTY = (EMPTY,)  # the call with sequences of length 0 (a sequence with queries and no key builds none)

FUNCTIONS = ("flash_dense_attn_varlen_func", "flash_sparse_attn_varlen_func")
ROWS = {"flash_dense_attn_varlen_func": "fsa-dense-varlen", "flash_sparse_attn_varlen_func": "fsa-sparse-varlen"}
AUDITS = {row: f"audit-{row}.json" for row in ROWS.values()}
SANITIZERS = {row: f"sanitizer-{row}.json" for row in ROWS.values()}
# The workaround (b) through both functions on the H200: scripts/fsa_misaligned.py --device cuda --workaround
WORKAROUND_H200 = "fsa-workaround-h200.json"
# Each call of scripts/fsa_misaligned.py's cases alone on the H200 with CUDA_LAUNCH_BLOCKING=1: where it faults.
MISALIGNED_H200 = "fsa-misaligned.json"
PREPROCESS_LAUNCH = "ops/triton/flash_bwd_preprocess.py:227 _flash_attn_bwd_preprocess"
MISALIGNED = "misaligned address"
ILLEGAL_INSTRUCTION = "illegal instruction"

# Triton's rule for a tensor descriptor (tl.make_tensor_descriptor): a 16-byte aligned base. lse is
# float32, so its base LSE + h * total_q + cu_seqlens_q[b] is aligned when that offset is a multiple of 4.
LSE_ALIGNMENT = 16 // 4

# The upstream source read: flash_bwd_preprocess.py at this commit builds `lse_desc` over
# `lse_base = offset_batch_Q(LSE + head_idx * stride_lh, ..., USE_PADDED=False)`, beside dPsum's
# and lse_log2's over the padded layout (USE_PADDED=True), as the 2.0.6 wheel does.
FSA_SOURCE = "HKUSTDial/flash-sparse-attention@801cc148254bf2a16964c53046cbd99f77717fef"
PREPROCESS_FILE = "flash_sparse_attn/ops/triton/flash_bwd_preprocess.py"

# The unwritten TAIL rows: the buffers fsa's varlen functions allocate with torch.empty_like(query), by
# file and line in the 2.0.6 wheel (each inside _flash_*_attn_varlen_forward/backward). The dense
# forward and backward read the same at these commits of the repository:
TAIL_ALLOCATIONS = {
    "flash_sparse_attn/ops/triton/flash_dense_fwd.py": ("out", 876),
    "flash_sparse_attn/ops/triton/flash_dense_bwd.py": ("dq", 854),
    "flash_sparse_attn/ops/triton/flash_sparse_fwd.py": ("out", 886),
    "flash_sparse_attn/ops/triton/flash_sparse_bwd.py": ("dq", 871),
}
FORWARD_SOURCE = "HKUSTDial/flash-sparse-attention@007a7fee35941ab7e09a01912e2bbb6740b5475d"  # flash_dense_fwd.py
BACKWARD_SOURCE = "HKUSTDial/flash-sparse-attention@184cad5b23c47621a252aabe2be9a0e94607b30b"  # flash_dense_bwd.py

# The checks of both H200 rows that raised 'misaligned address', and the one that raised 'illegal instruction'.
MISALIGNED_CHECKS = (
    "real-accuracy", "tail-rows", "padding-leak", "custom-scale", "fully-masked-rows", "causal-unequal", "gqa", "determinism",
)  # fmt: skip
EMPTY_CHECK = "empty-sequences"
# compute-sanitizer memcheck's first report on each row: the forward's Q descriptor load (its source line).
SANITIZER_FIRST_SITE = "scheduler.py:1625"

# Who is affected, as data: each layout as the H200 audit called the library (2 heads of 64, float16,
# zeros in the padding rows). The paste-block battery runs the page's check and workaround on each, the
# library itself under the interpreter with every descriptor recorded (a fault on the GPU is a descriptor
# that breaks Triton's rule there).
_LAYOUT = Case((8, 4, 12), heads=2, head_dim=64, dtype="float16", fill=Fill.ZEROS)
WHO = Affected(
    scope=(
        "**flash-sparse-attn 2.0.6** (`pip install flash-sparse-attn`, the successor of flash-dmattn), its Triton "
        "varlen path (`flash_dense_attn_varlen_func`, `flash_sparse_attn_varlen_func`), on GPUs where Triton lowers "
        "tensor descriptors to TMA (Hopper: the H200 here). Both varlen functions share the backward preprocess "
        "kernel. The fixed-length `flash_dense_attn_func` reads lse the same way (`LSE + b * H * S + h * S`), so a "
        "sequence length that is not a multiple of 4 breaks its backward too (under the interpreter: `python "
        "scripts/fsa_misaligned.py --fixed`).",
    ),
    layouts=(
        Layout(
            "Sequence starts or a row count that are not all multiples of 4",
            True,
            "packed batches from real data, whose lengths are rarely all multiples of 4: the backward reads lse "
            "through a descriptor based at `LSE + h * rows + cu_seqlens_q[b]` floats, which must be 16-byte aligned, "
            "and raises `misaligned address` on an H200; the process loses its CUDA context. In the H200 audit, 8 "
            "checks faulted this way, their first calls having between 2 of 4 and 24 of 32 lse bases misaligned. "
            "Forward-only calls are spared.",
            AUDIT.with_(tail_q=0, tail_k=0),
        ),
        Layout(
            "An empty sequence",
            True,
            "`cu_seqlens_q` with a repeated boundary (a static batch size with a document missing, a bucket with "
            "nothing in it): the forward builds descriptors over no element and raises `illegal instruction`.",
            _LAYOUT.with_(seqlens_q=(4, 0, 8)),
        ),
        Layout(
            "Rows past `cu_seqlens_q[-1]` (TAIL padding to a static shape)",
            True,
            "`out` and `dq` come from `torch.empty_like(query)` and no program writes those rows, aligned or not. On "
            "the H200 the one batch that reached the end of its backward, the no-real-query check's, returned them "
            "non-finite. In training, `dq`'s TAIL rows flow into the weight gradient of the projection that made "
            "`q`, which sums over every row: one NaN there makes that gradient NaN.",
            _LAYOUT.with_(seqlens_q=(4, 8), tail_q=4, tail_k=4),
        ),
        Layout(
            "Every `cu_seqlens_q[b]` and the row count multiples of 4, no empty sequence, no TAIL rows",
            False,
            "every lse base is aligned, every descriptor has an extent, every row is written.",
            _LAYOUT,
        ),
        Layout(
            "The same with grouped K/V and bottom-right causal attention over unequal lengths",
            False,
            "neither changes where the descriptors start.",
            _LAYOUT.with_(seqlens_q=(8, 4), seqlens_k=(12, 8), heads=4, kv_heads=2, causal=True),
        ),
    ),
)
