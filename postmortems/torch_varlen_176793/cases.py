"""What torch-varlen-176793 studies: META, the layouts and pads of the CPU study and of the GPU probes."""

from __future__ import annotations

from varlen_workbench.workbench.affected import Affected, Layout
from varlen_workbench.workbench.layout import Case, Fill
from varlen_workbench.workbench.postmortem import (
    Link,
    Meta,
    source_at,
)
from varlen_workbench.workbench.upstream_status import finding_status

META = Meta(
    id="torch-varlen-176793",
    title="torch varlen_attn leaves rows beyond cu_seqlens[-1] unwritten in its output and gradients",
    component="PyTorch / torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen)",
    category="training bug",
    impact="q/k/v longer than cu_seqlens[-1] (a padded token budget): garbage or NaN in the padding rows' gradients "
    "reaches the QKV weight gradient, silently when finite",
    our_verdict="mechanism confirmed on an H200 and in a replica; the report's 'forward is fine' holds only for rows "
    "the loss reads, and its proposed ValueError forbids a legal layout",
    detection="garbage or NaN in rows >= cu_seqlens[-1] of the output and of dq/dk/dv; wrong or NaN QKV weight gradients",
    fix_type="workarounds today: a dummy last sequence, slicing, or zeroing the rows on the device; "
    "ours: a kernel that writes 0 there",
    tags=("varlen", "padding", "uninitialised memory", "backward"),
    # The issue's own opening date, as recorded by NeuralDBG's tracking file for it (BUG-002):
    # "OPEN, since 2026-03-07"; flash-attention#2324 (same mechanism, by varlen_attn's author) follows on 03-10.
    reported="2026-03-07",
    published="2026-11-29",
    revised="2026-12-07",
    links=(
        Link("pytorch#176793", "https://github.com/pytorch/pytorch/issues/176793", "2026-03-07", "issue", "open"),
        Link(
            "flash-attention#2324: opt-in autograd function that zeroes the padding's gradient",
            "https://github.com/Dao-AILab/flash-attention/pull/2324",
            "2026-03-10",
            "PR",
            "closed, not merged",
        ),
        Link(
            "flash-linear-attention#892: zero-initialised gradient buffers, same root cause",
            "https://github.com/fla-org/flash-linear-attention/pull/892",
            "2026-05-12",
            "PR",
            "closed, not merged",
        ),
        Link(
            "pytorch#186786: raise ValueError if query.size(0) > cu_seq_q[-1]",
            "https://github.com/pytorch/pytorch/pull/186786",
            "2026-06-09",
            "PR",
            "closed, not merged",
        ),
        Link(
            "tilelang#2461: zero lse/Delta padding in its varlen backward example",
            "https://github.com/tile-ai/tilelang/pull/2461",
            "2026-06-26",
            "PR",
            "merged",
        ),
        Link(
            "pytorch#188933: the same ValueError, resubmitted",
            "https://github.com/pytorch/pytorch/pull/188933",
            "2026-07-03",
            "PR",
            "closed, not merged",
        ),
        Link(
            "ROCm/flash-attention#175: a zero_tensors option for flash_attn_varlen_func, zeroing the padding past "
            "cu_seqlen[-1] (the fix this page proposes)",
            "https://github.com/ROCm/flash-attention/pull/175",
            "2026-03-04",
            "PR",
            "closed; the maintainers asked for it upstream",
        ),
        Link(
            "pytorch#187770: make varlen_attn's backend selectable; nightly builds prefer cuDNN",
            "https://github.com/pytorch/pytorch/issues/187770",
            "2026-06-20",
            "issue",
            "open",
        ),
        Link(
            "pytorch#193630: dispatch causal varlen calls to cuDNN (stack with #193631, #193632)",
            "https://github.com/pytorch/pytorch/pull/193630",
            "2026-08-14",
            "PR",
            "closed",
        ),
        Link(
            "pytorch#194906: pass cumulative sequence lengths directly to cuDNN (varlen forward)",
            "https://github.com/pytorch/pytorch/pull/194906",
            "2026-08-26",
            "PR",
            "closed",
        ),
        Link(
            "pytorch#191576: paged KV caches (block_table) and seqused_k in the cuDNN varlen path (closed)",
            "https://github.com/pytorch/pytorch/pull/191576",
        ),
        Link(
            "pytorch#195650: route eligible causal GQA paged-KV varlen_attn calls to cuDNN (SM100, cuDNN 9.24)",
            "https://github.com/pytorch/pytorch/pull/195650",
            "2026-09-02",
            "PR",
            "closed (tracker; pytorch's history not read here)",
        ),
        Link(
            "torchtitan#4458: restore 'PyTorch's default varlen priority (cuDNN, then Flash)' around varlen calls",
            "https://github.com/pytorch/torchtitan/pull/4458",
            "2026-09-04",
            "PR",
            "open; not in torchtitan's history read here (main at b5bcd76, 2026-08-21)",
        ),
        Link(
            "flash-attention#895: a window bound >= max_seqlen_k is reset to -1, which drops the offset when seq_q > seq_k",
            "https://github.com/Dao-AILab/flash-attention/issues/895",
            "2024-03-20",
            "issue",
            "open; tridao: 'Yeah i think you might be right, it's a bug.'; the reset is still in flash_api.cpp at main 0251105",
        ),
        Link("varlen_attn API (pytorch#164502)", "https://github.com/pytorch/pytorch/pull/164502"),
        Link(
            "flash-attention#1228: the same question for flash_attn_varlen_func",
            "https://github.com/Dao-AILab/flash-attention/issues/1228",
        ),
    ),
    seed="000_1019a3997e440af2.txt",
)
STATUS = finding_status(META.id, __file__)  # where upstream stands: data/upstream-status.toml

# The upstream source we read, at the commit we read it.
VARLEN_PY = source_at("pytorch/pytorch@255ac567c50191b57bf8674134ba731c0b64e3ef")  # torch/nn/attention/varlen.py

SEED_SEQLENS = (144, 288, 512)  # cu_seqlens [0, 144, 432, 944]: the original report's and both PRs' layout

CPU_SCALE = 8  # the Triton interpreter studies the original report's layout 8x smaller: (18, 36, 64)

# Inputs' padding rows hold zeros: every NaN the replica returns comes from memory, not data.
STUDY = Case(
    seqlens_q=tuple(n // CPU_SCALE for n in SEED_SEQLENS),
    tail_q=2,
    tail_k=2,
    heads=2,
    head_dim=32,
    dtype="float16",
    fill=Fill.ZEROS,
    seed=176793,
)

# The NaN map's grid, kept small for the interpreter: trailing rows (q and k alike) on its x axis
# (2: the original report's, 64: a whole block of the replica), sequence lengths on y.
PADS = (0, 2, 64)

LAYOUTS = ((17,), STUDY.seqlens_q, (40, 5))

# On a GPU, the original report's layout itself, with varlen_attn's usual shapes and dtype.
GPU_PADS = (0, 2, 64, 512)

GPU_CASE = Case(seqlens_q=SEED_SEQLENS, heads=16, head_dim=64, dtype="bfloat16", fill=Fill.ZEROS, seed=176793)

GPU_PREFILL_MB = 256  # NaN blocks left in the CUDA caching allocator before poisoned runs

GPU_TRAILING = 64  # trailing rows of the GPU workaround and damage probes

# Workaround timing at a training-sized batch too (the original report's 944 tokens are launch-bound):
# 8 documents of 2048 tokens, the benchmark's "8x2048 d64" workload, plus 64 trailing rows.
GPU_TIMING_CASE = Case(seqlens_q=(2048,) * 8, tail_q=64, tail_k=64, heads=16, head_dim=64, dtype="bfloat16", fill=Fill.ZEROS)

CASES = tuple(STUDY.with_(seqlens_q=layout, tail_q=pad, tail_k=pad) for layout in LAYOUTS for pad in PADS) + tuple(
    GPU_CASE.with_(tail_q=pad, tail_k=pad) for pad in GPU_PADS
)

GRADS = ("dq", "dk", "dv")

# Who is affected, as data: each layout as varlen_attn is called with it (GQA through enable_gqa, causal
# and windows through window_size). The paste-block battery runs the page's check and workarounds on each,
# on torch's own varlen_attn on a GPU and on the replica elsewhere.
_LAYOUT = Case((5, 9), heads=2, head_dim=16, dtype="float16", fill=Fill.ZEROS, seed=2)
_TAIL = _LAYOUT.with_(tail_q=3, tail_k=3)
WHO = Affected(
    scope=(
        "**torch 2.10 and later** (`varlen_attn` first ships in 2.10), CUDA only. Our evidence covers **torch 2.11** "
        "on an H200, where `varlen_attn` runs the FlashAttention-2 kernels vendored in torch (torch 2.13.0's wheel, "
        "read here, picks FlashAttention too). Nightly builds prefer cuDNN where it is eligible (Upstream status, "
        "below): which kernel runs depends on your torch, cuDNN and GPU, and no build that picks cuDNN was run here.",
    ),
    layouts=(
        Layout(
            "`query.size(0) > cu_seq_q[-1]` or `key.size(0) > cu_seq_k[-1]` (TAIL rows)",
            True,
            "static token budgets kept for `torch.compile` or CUDA graphs, packed buffers padded to a multiple of N "
            "(sequence-parallel divisibility, `pad_to_multiple_of`): `varlen_attn` allocates out, dq, dk and dv with "
            "`empty_like` and no program writes the rows past the last boundary.",
            _TAIL,
        ),
        Layout(
            "TAIL rows of the queries only",
            True,
            "`q` longer than `cu_seq_q[-1]`, `k` and `v` exact: the TAIL rows of `out` and `dq` are unwritten.",
            _LAYOUT.with_(tail_q=4),
        ),
        Layout(
            "TAIL rows with a causal or sliding window (`window_size`), or an empty sequence",
            True,
            "neither changes which rows are written.",
            _TAIL.with_(seqlens_q=(5, 0, 9), causal=True, window=(4, 0)),
        ),
        Layout(
            "TAIL rows with grouped K/V (`enable_gqa=True`, torch 2.12 and later)",
            True,
            "grouping changes which heads are read, not which rows are written.",
            _TAIL.with_(heads=4, kv_heads=2),
        ),
        Layout(
            "Buffers exactly `cu_seqlens[-1]` rows long",
            False,
            "every row belongs to a sequence and is written; windows and empty sequences included. Padding described "
            "inside `cu_seqlens` (workaround (a)) is such a buffer.",
            _LAYOUT.with_(seqlens_q=(5, 0, 9), causal=True, window=(4, 0)),
        ),
    ),
    notes=(
        "**Same mechanism elsewhere:** `flash_attn_varlen_func` (FlashAttention 2 and 3 allocate gradients with "
        "`torch.empty`, as flash-attention#2324 states); the same pattern was addressed in flash-linear-attention "
        "(#892 proposed zero-initialised buffers; closed unmerged) and in tilelang (#2461 zeroes its padding rows; "
        "merged).",
    ),
)
