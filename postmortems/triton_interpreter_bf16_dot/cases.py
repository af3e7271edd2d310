"""What triton-interpreter-bf16-dot studies: META, the Triton release and source read, the cases."""

from __future__ import annotations

from varlen_workbench.kernels.interpreter import DOT_DTYPES
from varlen_workbench.workbench.layout import Case, Fill
from varlen_workbench.workbench.postmortem import (
    Link,
    Meta,
)
from varlen_workbench.workbench.upstream_status import finding_status

TRITON = "https://github.com/triton-lang/triton"

# The upstream commit whose interpreter source we read (python/triton/runtime/interpreter.py):
# bf16 stored as uint16 in `_get_np_dtype`, and `create_dot` converting only 8-bit float operands.
SOURCE_READ = "triton-lang/triton@bf34f5bbc5f3cb472d9a19c369f9d5e20399ff15"

META = Meta(
    id="triton-interpreter-bf16-dot",
    title="The Triton CPU interpreter multiplies raw bfloat16 bits in tl.dot",
    component="Triton / CPU interpreter (TRITON_INTERPRET=1), tl.dot",
    category="tooling bug",
    impact="CPU runs (TRITON_INTERPRET=1) of any Triton kernel with a bf16 tl.dot return finite results whose relative "
    "error is {bf16_relative_error}, and raise nothing; compiled GPU runs are correct",
    our_verdict="the report holds on triton 3.6.0, its mechanism to the bit; natively (H200) the bf16 dot is correct",
    detection="finite results ~1e9 too large; probe: REAL rows finite but error far beyond the bound",
    fix_type="upstream: none; workarounds: upcast tl.dot operands to fp32 (a constexpr, off natively), test in fp16, "
    "or run natively; ours applies the upcast when a runtime detector sees the bug",
    tags=("triton", "interpreter", "bfloat16"),
    reported="2026-09-04",
    published="2026-11-29",
    revised="2026-12-07",
    links=(
        Link("triton#11584", f"{TRITON}/issues/11584", date="2026-09-04", kind="issue", status="closed"),
        Link(
            "triton#11604: the interpreter's bf16 tl.sum silently loses NaN (integer addition of the uint16 bit patterns)",
            f"{TRITON}/issues/11604",
            date="2026-09-06",
            kind="issue",
            status="closed; its fix, PR #11605, closed without merging (tracker; triton's history not read here)",
        ),
        Link(
            "triton#11585: convert bf16 operands of tl.dot",
            f"{TRITON}/pull/11585",
            date="2026-09-04",
            kind="PR",
            status='closed unmerged; maintainer, 2026-09-05: "No, we just don\'t support it yet"',
        ),
        Link(
            "triton#10945: bf16 ops in a value dtype",
            f"{TRITON}/pull/10945",
            date="2026-07-18",
            kind="PR",
            status="closed unmerged (covered create_dot too)",
        ),
        Link(
            "triton#10688: bf16 through ml_dtypes",
            f"{TRITON}/pull/10688",
            date="2026-06-20",
            kind="PR",
            status="open; maintainer reluctant to add a dependency",
        ),
        Link(
            "triton#5424: back-to-back BMMs fail under the interpreter, in bf16",
            f"{TRITON}/issues/5424",
            date="2024-12-13",
            kind="issue",
            status='closed; answered 2025-02-14: "The interpreter mode doesn\'t support bf16"',
        ),
        Link(
            "triton#4972: bf16 loads under the interpreter",
            f"{TRITON}/issues/4972",
            date="2024-10-23",
            kind="issue",
            status="closed; answered that day with the debugging guide",
        ),
        Link("triton#3811: bf16 <-> fp32 casts in the interpreter (merged)", f"{TRITON}/pull/3811"),
        Link(
            "debugging guide: interpreter limitations", "https://triton-lang.org/main/programming-guide/chapter-3/debugging.html"
        ),
    ),
)
STATUS = finding_status(META.id, __file__)  # where upstream stands: data/upstream-status.toml

# A padded, causal GQA batch with NaN in its padding (every region present), small enough for
# the interpreter; one per dtype. The flash-dmattn report's configuration (bf16, causal, 256
# tokens, d=64) meets the same bug: any bf16 tl.dot does.
BASE = Case(seqlens_q=(21, 40, 3), padded_q=(24, 40, 8), tail_q=3, heads=2, kv_heads=1, head_dim=32, causal=True, fill=Fill.NAN)

CASES = tuple(BASE.with_(dtype=dtype) for dtype in DOT_DTYPES)

BF16 = CASES[-1]

REPRODUCTION = "reproduction"  # single_block_attention as a user's kernel would be: no workaround

WORKAROUND = "reproduction + upcast"

FIXED = "fixed kernel"

TIMING_REPEATS = 2

RECORD_COMMAND = (
    "varlen-workbench repro triton-interpreter-bf16-dot --device cuda --record data/gpu/triton-interpreter-bf16-dot-<gpu>.json"
)
