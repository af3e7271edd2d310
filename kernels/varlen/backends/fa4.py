"""FlashAttention-4 behind our wrapper (kernels/varlen/fa4.py) as a backend: `backend="fa4"`.
"auto" prefers it to the Triton kernel where the benchmark record says it is the faster (data/gpu/bench-h200*.json: forward+backward on
an H200, the Triton kernel against FlashAttention-4 behind our wrapper, judged as
tests/test_backends.py judges it):

- **GAP rows** on either side (padding between sequences): the Triton kernel. The wrapper hands
  FA4 copies with the padding rows zeroed, which cost more than FA4 saves (the padded long-tail
  mix: medians 1.472 ms against 1.654).
- **Short documents only** (`max_seqlen_q` at most `SHORT_DOCUMENTS`): the Triton kernel. Both
  are host-bound there; ours is faster on the fastest calls (1.155 ms against 1.232 on 335
  documents of at most 256 tokens, 1.506 against 1.682 on 386), within 2.3% on the medians.
  Documents up to 512 tokens already favour FA4 (1.012 ms against 1.344); nothing between 256
  and 512 was measured.
- **GQA on short documents** (fewer key/value heads than query heads, under `GQA_SHORT_ROWS`
  real rows per sequence on average): the Triton kernel (the 16k long-tail GQA 32/8 mix, 55 rows
  per document: 2.046 ms against 2.280). FA4 wins GQA at 2,048 rows per sequence (0.614x our
  time); those are the record's only GQA workloads, and nothing between them was measured.
- **Everything else**: FlashAttention-4, 0.56-0.87x our time.

Where FA4 cannot run a call (not installed, another GPU, a dtype or head dim it lacks, traced,
unvalidated), "auto" is the Triton kernel, whatever the rule says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from varlen_workbench.kernels.varlen.backends.registry import Call
from varlen_workbench.kernels.varlen.fa4 import FA4_DTYPES, fa4_attention, fa4_layout, load, platform_reason, unsupported

if TYPE_CHECKING:
    from varlen_workbench.kernels.varlen.metadata import VarlenMetadata

SHORT_DOCUMENTS = 256  # longest query sequence up to which the Triton kernel is the faster
GQA_SHORT_ROWS = 256  # real rows per sequence under which GQA runs faster on the Triton kernel


def fa4_is_faster_for(group: int, longest: int, rows_per_sequence: float, gap_rows: bool) -> bool:
    """The rule, on what it reads of a call: the GQA group (query heads per key/value head), the
    longest query sequence (max_seqlen_q), the real rows per sequence on average, and whether GAP
    rows lie between sequences."""
    if gap_rows or longest <= SHORT_DOCUMENTS:
        return False
    return not (group > 1 and rows_per_sequence < GQA_SHORT_ROWS)


def fa4_is_faster(q: torch.Tensor, k: torch.Tensor, metadata: VarlenMetadata) -> bool:
    """The rule for one call on `metadata`, whose check has been read (the layout comes with it)."""
    layout = fa4_layout(metadata)
    gaps = layout.seqused_q is not None or layout.seqused_k is not None
    n_seqs = max(metadata.cu_seqlens_q.numel() - 1, 1)
    return fa4_is_faster_for(q.shape[1] // k.shape[1], metadata.max_seqlen_q, layout.real_q / n_seqs, gaps)


class Fa4:
    name = "fa4"
    label = "FA4 + wrapper"
    summary = "FlashAttention-4 (the optional extra `fa4`) behind a thin wrapper that keeps the contract (kernels/varlen/fa4.py)"
    takes = "eager calls on an sm90/sm100 GPU, float16/bfloat16, the head dims FA4 compiles, validated boundaries, no gradient through lse"

    dtypes: tuple[torch.dtype, ...] | None = FA4_DTYPES

    def unavailable(self, device: torch.device) -> str | None:
        kernels = load()
        return kernels if isinstance(kernels, str) else platform_reason(device)

    def cannot_take(self, call: Call) -> str | None:
        if not call.eager:
            return "traced (torch.compile or a dispatch mode): the FA4 path runs eagerly only"
        metadata = call.metadata
        return unsupported(call.q, call.k, call.v, metadata.boundaries, return_lse=call.return_lse, validate=metadata.validate)

    def preference(self, call: Call) -> int:
        call.metadata.check()  # the rule needs the layout, read with the verdict (one wait per batch)
        return 2 if fa4_is_faster(call.q, call.k, call.metadata) else 0

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        call.metadata.check()  # FA4 never runs on a malformed batch
        return fa4_attention(call.q, call.k, call.v, call.metadata, *call.mask, call.return_lse)
