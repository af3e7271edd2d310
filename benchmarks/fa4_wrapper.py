"""What the contract costs on FlashAttention-4: `varlen_attention(backend="fa4")` against FA4 called bare.

    python benchmarks/fa4_wrapper.py [--iters 30]      # CUDA, sm90/sm100, flash-attn-4 installed

Forward+backward, bf16, 16 heads of 128, per workload: FA4's `flash_attn_varlen_func` called
directly (no padding, so it needs no wrapping), our wrapper on the same batch (validate=True on
the same metadata: remembered after the first call, as in the layers of one step), our wrapper
on new metadata tensors every call (the device check of each new batch), and the Triton kernel.
The last workload has TAIL rows (a batch padded to a fixed size): there the wrapper hands FA4
views of q, k, v that end at the last real row and has it write into full-size out, lse and
gradients whose TAIL rows it zeroes (no appended copy); bare FA4 reads the TAIL rows into its
last tiles. Calls are queued without a sync and timed by CUDA events, median of 5 runs; the
target is the wrapper within 5% of bare FA4 (ratio >= 0.95).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.kernels.varlen.fa4 import unsupported

WORKLOADS = {  # name: (sequence lengths, causal, TAIL rows)
    "8x2048 d128": ([2048] * 8, False, 0),
    "8x2048 d128 causal": ([2048] * 8, True, 0),
    "4x16384 d128 causal": ([16384] * 4, True, 0),
    "64x256 d128 causal": ([256] * 64, True, 0),
    "8x2048 d128 causal +TAIL": ([2048] * 8, True, 256),
}


def ms_per_step(step: Callable[[], torch.Tensor], grad: torch.Tensor, iters: int) -> float:
    for _ in range(3):
        step().backward(grad)
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            step().backward(grad)
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / iters)
    return statistics.median(runs)


def workload_times(lengths: list[int], causal: bool, tail: int, iters: int) -> list[float]:
    """ms per step: FA4 bare, the wrapper (same metadata), the wrapper (new metadata), Triton."""
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).cuda()
    q, k, v = (
        torch.randn(sum(lengths) + tail, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn_like(q)
    longest = max(lengths)
    reason = unsupported(q, k, v, (cu, cu, None, None), return_lse=False, validate=True)
    if reason:
        raise SystemExit(f"the FA4 path cannot run here: {reason}")
    from flash_attn.cute import flash_attn_varlen_func as fa4  # FA4's public function: the bare call

    def bare():
        return fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=causal)[0]

    def ours(backend: str, fresh: bool):
        def step():
            metadata = (cu.clone(), cu.clone()) if fresh else (cu, cu)
            return varlen_attention(q, k, v, *metadata, longest, longest, causal=causal, backend=backend)

        return step

    return [ms_per_step(f, grad, iters) for f in (bare, ours("fa4", False), ours("fa4", True), ours("triton", False))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per forward+backward")
    print(f"{'workload':26s} {'FA4 bare':>9s} {'fa4 same md':>12s} {'fa4 new md':>11s} {'triton':>8s} {'bare/wrapped':>13s}")
    for name, (lengths, causal, tail) in WORKLOADS.items():
        times = workload_times(lengths, causal, tail, args.iters)
        print(f"{name:26s} {times[0]:9.3f} {times[1]:12.3f} {times[2]:11.3f} {times[3]:8.3f} {times[0] / times[1]:13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
