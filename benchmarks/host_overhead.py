"""Host time of one call of our op, layer by layer, beside torch varlen_attn's (CUDA only).

    python benchmarks/host_overhead.py [--calls 200] [--shape "short docs"]

Where a workload is host-bound (the GPU finishes a call before the host has issued the next,
see the benchmark's `host ms` column), the host time per call *is* the time. This times, on
one workload of `varlen_workbench.workbench.bench.kernels`, what the host spends to issue a call of each layer, from
the public function down to one Triton launch, with no sync inside the loop: the differences
say where the microseconds go (autograd wrapper, custom-op dispatch, launches). Use a
host-bound workload (the default): where the kernels outlast the host, the launch queue fills
and the host waits on the GPU inside the loop, so the numbers include GPU time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from varlen_workbench.kernels.varlen import launch, varlen_attention
from varlen_workbench.kernels.varlen.backends import triton
from varlen_workbench.workbench.bench.kernels import select_workloads
from varlen_workbench.workbench.layout import pack
from varlen_workbench.workbench.timing import host_us


def layers(shape: str) -> tuple[str, dict[str, Callable[[], object]]]:
    """The workload's name, and a zero-argument call per layer."""
    workload = select_workloads(shapes=[shape])[0]
    batch = pack(workload.case, device="cuda")
    q, k, v = (t.detach() for t in (batch.q, batch.k, batch.v))
    cu = (batch.cu_seqlens_q, batch.cu_seqlens_k, batch.cu_seqlens_q_padded, batch.cu_seqlens_k_padded)
    causal, scale = batch.case.causal, q.shape[-1] ** -0.5
    grad = torch.randn_like(q)

    def ours(leaf_q):
        return varlen_attention(
            leaf_q,
            batch.k,
            batch.v,
            batch.cu_seqlens_q,
            batch.cu_seqlens_k,
            batch.max_seqlen_q,
            batch.max_seqlen_k,
            causal=causal,
            validate=False,
            backend="triton",
        )

    def varlen_attn():
        from torch.nn.attention.varlen import varlen_attn as fa2

        return fa2(*batch.args(), window_size=(-1, 0) if causal else (-1, -1))

    out = launch.attention_forward(q, k, v, *cu, causal, scale)[0]
    return workload.name, {
        "ours: forward+backward": lambda: ours(batch.q).backward(grad),
        "ours: forward (autograd)": lambda: ours(batch.q),
        "ours: forward (no grad)": lambda: ours(q),
        "  custom op varlen_workbench::varlen_attention_fwd": lambda: triton._forward_op(q, k, v, *cu, causal, scale),
        "  launcher attention_forward (3 launches)": lambda: launch.attention_forward(q, k, v, *cu, causal, scale),
        "    one launch: work lists": lambda: launch.work_lists(batch.cu_seqlens_q, batch.cu_seqlens_k),
        "    one launch: padding fill": lambda: launch.fill_padding_rows(
            launch.Padding(out.view(out.shape[0], -1), 0.0, batch.cu_seqlens_q, batch.cu_seqlens_q_padded)
        ),
        "torch varlen_attn: forward+backward": lambda: varlen_attn().backward(grad),
        "torch varlen_attn: forward (no grad)": lambda: torch.no_grad()(varlen_attn)(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument(
        "--shape", default="short docs", help="a workload of varlen_workbench.workbench.bench.kernels, by part of its name"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA: host time per call only means something beside a GPU's")
    title, calls = layers(args.shape)
    print(f"host time per call, {title} ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    for name, fn in calls.items():
        print(f"{name:<48} {host_us(fn, args.calls, repeats=3, drain=torch.cuda.synchronize):8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
