"""What te-thd-2892 studies: META, the upstream commits read, and the cases and sizes of each study."""

from __future__ import annotations

import torch

from varlen_workbench.workbench.layout import Case, Fill
from varlen_workbench.workbench.postmortem import (
    Link,
    Meta,
)
from varlen_workbench.workbench.upstream_status import finding_status

ISSUE = "https://github.com/NVIDIA/TransformerEngine/issues/2892"

TE = "https://github.com/NVIDIA/TransformerEngine"

# The upstream commits read for the source-reading claims (the v2.12 tag, and main as fetched).
TE_V2_12 = "NVIDIA/TransformerEngine@5671fd3675906cda1ade26c24a65d3dedd88eb89"

TE_MAIN = "NVIDIA/TransformerEngine@d0067d0da6cb01811b8072a7d304f0e00344ce2b"

META = Meta(
    id="te-thd-2892",
    title="TransformerEngine THD: real vs padded cu_seqlens, FP8 alignment padding and VERL's identical-boundaries workaround",
    component="TransformerEngine / DotProductAttention (THD) and FP8 GEMMs; VERL sequence packing",
    category="training bug",
    impact=(
        "a reported run collapsed (ppl 3.7 -> 3055) after FP8 alignment padding entered packed THD batches (the "
        "reporter's attribution); VERL's identical cu_seqlens workaround shows padding to non-causal attention"
    ),
    our_verdict=(
        "on TE 2.20.2 (H200) the report's failing call is the correct one: no crash, padded output, REAL rows right, "
        "padding zero; the workaround is harmless for causal attention with padding at each sequence's end and "
        "harmful without a causal mask (through TE's attention too); the FP8-scale mechanism holds in our replica"
    ),
    detection="loss and gradient-norm blow-up when FP8 alignment padding is enabled for packed sequences",
    fix_type="pass real cu_seqlens with cu_seqlens_padded; keep padding rows zero before FP8 quantization; zero tail rows",
    tags=("thd", "cu_seqlens_padded", "fp8", "training"),
    reported="2026-04-16",
    published="2026-11-29",
    revised="2026-12-07",
    links=(
        Link(
            "Dao-AILab/flash-attention#1228: rows after cu_seqlens[-1] may be uninitialised",
            "https://github.com/Dao-AILab/flash-attention/issues/1228",
            "2024-09-14",
            "issue",
            "open",
        ),
        Link("TE#2391: FlashAttention with pad_between_seqs=True", f"{TE}/issues/2391", "2025-11-17", "issue", "open when read"),
        Link(
            "verl#5440: FP8 block-quantization padding for the Megatron EngineWorker",
            "https://github.com/verl-project/verl/pull/5440",
            "2026-02-28",
            "PR",
            "merged",
        ),
        Link("TE#2892: the report (SIGSEGV, VERL workaround, ppl 3.7 -> 3055)", ISSUE, "2026-04-16", "issue", "open"),
        Link(
            "TE#2892: the reporter withdraws the SIGSEGV; corruption from extending cu_seqlens_padded[-1]",
            ISSUE,
            "2026-04-17",
            "thread",
            "comment",
        ),
        Link("TE#2911: auto-pad FP8 GEMM m/k inside cublas_gemm", f"{TE}/pull/2911", "2026-04-21", "PR", "open, not merged"),
        Link(
            "TE#2596: pad_between_seqs with FlashAttention 3",
            f"{TE}/pull/2596",
            "2026-05-23",
            "PR",
            "merged (80ea313); cherry-picked to release_v2.16 (4d0e9be): first in v2.16",
        ),
        Link(
            "TE#2898: CUDA graphs with THD; rewrites the pad_between_seqs auto-detect",
            f"{TE}/pull/2898",
            "2026-07-01",
            "PR",
            "merged (4cd705b), first in v2.18; still so in 2.20.2",
        ),
        Link(
            "TE#2994: Plumb FP8+THD (fused FP8 attention takes THD, from cuDNN 9.23)",
            f"{TE}/pull/2994",
            "2026-08-20",
            "PR",
            "merged after 2026-08-22 (tracker; not on main at d0067d0); TE 2.20.2 refuses FP8 THD attention below cuDNN 9.23",
        ),
        Link(
            "TE#3205: FA3/FA4 with pad_between_seqs, exact zeros on padding rows",
            f"{TE}/pull/3205",
            "2026-07-13",
            "PR",
            "open",
        ),
        Link(
            "TE#3331: THD + context parallelism, auto-detect blind to tail padding",
            f"{TE}/issues/3331",
            "2026-08-08",
            "issue",
            "closed by its reporter (worked around)",
        ),
        Link(
            "TE#3332: a regression test and docs for #3331 (pad_between_seqs must be True with any padding under CP)",
            f"{TE}/pull/3332",
            "2026-08-08",
            "PR",
            "closed, not merged",
        ),
        Link(
            "Megatron-LM#5541: thd_tail_padding_policy, 'extend_last' extends cu_seqlens_padded[-1]",
            "https://github.com/NVIDIA/Megatron-LM/pull/5541",
            "2026-07-30",
            "PR",
            "merged to dev (1392f28); in no release tag as of core_v0.19.0",
        ),
        Link(
            "TE#3487: the object-identity auto-detect (#2898) counts equal-valued copies as padding",
            f"{TE}/issues/3487",
            "2026-09-05",
            "issue",
            "open",
        ),
        Link(
            "Megatron-LM#7417: pad_between_seqs = not torch.equal(cu_seqlens, cu_seqlens_padded)",
            "https://github.com/NVIDIA/Megatron-LM/pull/7417",
            "2026-09-16",
            "PR",
            "open",
        ),
    ),
    seed="004_c27650584a0de2fe.txt",
)
STATUS = finding_status(META.id, __file__)  # where upstream stands: data/upstream-status.toml

# TE's DotProductAttention docstring: [a a a 1 b b 2 2 c c c c 3] (digits are padding), i.e.
# cu_seqlens_q = [0, 3, 5, 9] and cu_seqlens_q_padded = [0, 4, 8, 13].
TE_DOCSTRING = Case(
    seqlens_q=(3, 2, 4), padded_q=(4, 4, 5), padded_k=(4, 4, 5), heads=2, head_dim=16, dtype="float16", causal=True, fill=Fill.NAN
)

# TE's test tolerances for its THD-with-padding tests (atol = rtol), by dtype.
TE_TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 1.5e-2}


def te_case(
    seqlens: tuple[int, ...], *, dtype: str = "float16", causal: bool = True, heads: int = 2, head_dim: int = 32, seed: int = 0
) -> tuple[Case, tuple[int, ...]]:
    """TE's layout: 0-3 padding rows appended to each sequence (drawn from `seed`), padding zeroed."""
    generator = torch.Generator().manual_seed(seed)
    pads = tuple(int(p) for p in torch.randint(0, 4, (len(seqlens),), generator=generator))
    case = Case(
        seqlens_q=seqlens,
        padded_q=tuple(n + p for n, p in zip(seqlens, pads)),
        heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        causal=causal,
        seed=seed,
        fill=Fill.ZEROS,
    )
    return case, pads


SWEEP_SEQLENS = (24, 40, 17, 31)

PADDING_FRACTIONS = (0.0, 0.1, 0.2, 0.35, 0.5)


def padding_case(
    fraction: float,
    *,
    causal: bool,
    seqlens: tuple[int, ...] = SWEEP_SEQLENS,
    align: int = 1,
    fill: Fill = Fill.ZEROS,
    **case_fields,
) -> Case:
    """Sequences padded so that about `fraction` of every sequence's rows are padding, then
    each padded length rounded up to a multiple of `align` (FP8 alignment adds more).

    Padding holds zeros by default (TE's recipe zeroes it; VERL pads token ids, whose q/k/v
    are finite vectors): a zero key scores 0 and steals softmax mass, a visible damage.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction = {fraction} must be in [0, 1): the share of padding rows.")
    if align < 1:
        raise ValueError(f"align = {align} must be >= 1 (rows per alignment unit; 1 = no alignment).")
    padded = tuple(-(-(n + round(fraction * n / (1.0 - fraction))) // align) * align for n in seqlens)
    return Case(
        seqlens_q=seqlens,
        padded_q=padded,
        padded_k=padded,
        causal=causal,
        fill=fill,
        **{"heads": 2, "head_dim": 16, **case_fields},
    )


TRAIN_STEPS = 60

TRAIN_SEQS = 8  # sequences per packed batch

ALIGN = 16  # FP8 alignment: every padded length (or the total) a multiple of 16 rows

EVAL_SEQLENS = (20, 33, 12, 27, 9, 40, 11, 30)

TRAINING_RUNS = (
    "correct",
    "workaround",
    "padding at the end",
    "padding at the end, tail-blind backend",
    "padding at the end, tail-blind backend, tail zeroed",
)

MASK_RATE = 0.25  # share of real tokens the masked-token objective hides

BIDIRECTIONAL_SEEDS = (0, 1, 2, 3, 4)

BIDIRECTIONAL_STEPS = 50

HEALTH_FRACTIONS = (0.75, 0.5, 0.25, 0.0)  # the explorer opens on the first: the damage shows

HEALTH_STEPS = 30

HEALTH_PARAMS = ("blocks.0.qkv.weight", "blocks.1.qkv.weight", "embed.weight")

FP8_CASE = Case(seqlens_q=(20, 13, 30), align=16, heads=2, head_dim=32, dtype="bfloat16", causal=True, seed=3)

FP8_FILLS = (Fill.GARBAGE, Fill.HUGE, Fill.NAN, Fill.ZEROS)

CAST_VALUES = (124.3, -124.3, 17.0, 200.0, 1.0625, 0.3, 3.0)

SEQPAR_SEQLENS = (20, 13, 27, 9)  # 69 real tokens; aligned to 16 rows: 96 rows, 48 per rank

ROPE_CASE = Case(seqlens_q=(24, 40, 17, 31), align=16, heads=2, head_dim=32, dtype="bfloat16", causal=True, seed=5)

RECIPE_SEQLENS = (5, 9, 3, 12)

WORKAROUND_FRACTION = 0.2  # the padding share of the kernel-level workaround cases

CASES = (
    TE_DOCSTRING,
    padding_case(WORKAROUND_FRACTION, causal=False),
    padding_case(WORKAROUND_FRACTION, causal=True),
    FP8_CASE,
    ROPE_CASE,
)
