"""Does our cuDNN-ragged function compute attention at all? A first check on a GPU, before any audit.

    python scripts/cudnn_ragged_smoke.py            # needs CUDA and nvidia-cudnn-frontend==1.32.0

Runs `varlen_workbench.workbench.audit.adapters.cudnn_ragged.cudnn_ragged_attention` forward and backward on
packed layouts with GAP rows (cu_seqlens != cu_seqlens_padded) and TAIL rows, GQA, unequal
lengths, causal and not, bf16, and compares out, dq, dk, dv on REAL rows with the fp64
per-sequence reference (`varlen_workbench.workbench.reference.reference_attention`) within FlashAttention's bound (2x the
error of PyTorch's same computation in bf16). Padding rows are only reported: whether they are
0 is the audit's question (`varlen-workbench audit varlen_workbench.workbench.audit.adapters.cudnn_ragged:cudnn_ragged_attention
--device cuda`), not this script's.

Each stage is named when it fails (import, graph build, execution, numerics), with the exception,
and the last line is the verdict: SMOKE OK, or SMOKE FAILED with the first reason. Exit 0 / 1.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    # name: Case keywords (lengths, padded extents, TAIL rows, heads)
    "gap+tail": dict(seqlens_q=(37, 20, 64), padded_q=(40, 24, 64), tail_q=5, heads=4, kv_heads=2),
    "gap+tail unequal causal": dict(
        seqlens_q=(17, 30, 9),
        seqlens_k=(33, 30, 12),
        padded_q=(24, 32, 9),
        padded_k=(40, 32, 16),
        tail_q=3,
        tail_k=7,
        heads=4,
        kv_heads=1,
        causal=True,
    ),
    "packed, no padding": dict(seqlens_q=(64, 1, 31)),
}


def run(name: str, keywords: dict[str, Any]) -> str | None:
    """None if the layout passes, else the first reason it does not."""
    import torch

    from varlen_workbench.workbench.audit.adapters.cudnn_ragged import cudnn_ragged_attention
    from varlen_workbench.workbench.bounds import error_check
    from varlen_workbench.workbench.layout import Case, Fill, Region, pack
    from varlen_workbench.workbench.reference import reference_attention

    case = Case(head_dim=64, dtype="bfloat16", fill=Fill.ZEROS, **keywords)
    batch = pack(case, "cuda")
    d_out = torch.randn(batch.q.shape, generator=torch.Generator().manual_seed(1)).to(batch.q)
    kwargs = dict(
        cu_seqlens_q_padded=batch.cu_seqlens_q_padded, cu_seqlens_k_padded=batch.cu_seqlens_k_padded, causal=case.causal
    )
    stage = "forward (graph build and execution)"
    try:
        out = cudnn_ragged_attention(*batch.args(), **kwargs)
        torch.cuda.synchronize()
        stage = "backward (graph build and execution)"
        out.backward(d_out)
        torch.cuda.synchronize()
    except Exception:
        print(f"  {name}: {stage} raised:")
        traceback.print_exc(limit=6)
        return f"{name}: {stage} raised (traceback above)"
    got = {"out": out.detach(), "dq": batch.q.grad, "dk": batch.k.grad, "dv": batch.v.grad}

    def reference(dtype):
        leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in batch.inputs().items()}
        ref = reference_attention(
            leaves["q"],
            leaves["k"],
            leaves["v"],
            *batch.args()[3:],
            **kwargs,
            compute_dtype=dtype,
        )
        ref.backward(d_out.to(ref.dtype))
        return {"out": ref.detach(), "dq": leaves["q"].grad, "dk": leaves["k"].grad, "dv": leaves["v"].grad}

    oracle, baseline = reference(torch.float64), reference(torch.bfloat16)
    failure = None
    for tensor, value in got.items():
        real = batch.regions(tensor).to(value.device) == Region.REAL
        check = error_check(
            tensor,
            value[real].double(),
            oracle[tensor][real],
            baseline[tensor][real].double(),
            torch.bfloat16,
            **batch.reduction_lengths(),
        )
        padding = value[~real]
        note = (
            f"padding rows: {int((~torch.isfinite(padding)).any(-1).any(-1).sum())} non-finite, "
            f"{int((padding != 0).any(-1).any(-1).sum())} not 0, of {int((~real).sum())}"
        )
        verdict = "ok" if check.within else "OFF"
        print(f"  {name:26s} {tensor:4s} REAL error {check.error:.3g} (bound {check.bound:.3g}) {verdict}; {note}")
        if not check.within and failure is None:
            failure = f"{name}: {tensor} REAL rows off the fp64 reference ({check.error:.3g} > {check.bound:.3g})"
    return failure


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("SMOKE FAILED: no CUDA device (cuDNN's fused attention runs on CUDA only)")
        return 1
    try:
        import cudnn
    except ImportError as exc:
        print(f"SMOKE FAILED: cannot import cudnn ({exc}); pip install --no-deps nvidia-cudnn-frontend==1.32.0")
        return 1
    print(
        f"torch {torch.__version__}, cudnn-frontend {getattr(cudnn, '__version__', '?')}, "
        f"cuDNN backend {cudnn.backend_version()}, {torch.cuda.get_device_name()}"
    )
    failures = [reason for name, keywords in LAYOUTS.items() if (reason := run(name, keywords))]
    print("SMOKE OK: out, dq, dk, dv within the bound on every layout" if not failures else f"SMOKE FAILED: {failures[0]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
