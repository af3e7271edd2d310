"""The Hugging Face swap's CPU training step against transformers' sdpa, side by side in one run.

    python benchmarks/hf_cpu_step.py [--head-dims 32 80] [--steps 10]

A 2-layer Llama built from a config (`realclient.llama`; GQA, 4 heads over 2) takes one packed
row of four documents (`realclient.pack`: 256 tokens, position_ids restarting per document),
once with `attn_implementation="sdpa"` and once with `varlen_workbench.kernels.hf.register()`,
whose `backend="auto"` picks the `torch` backend on a CPU. Prints the median step time of each and their ratio, per head dim.
Target: the swap within 2x of sdpa.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from varlen_workbench.kernels import hf
from varlen_workbench.kernels.varlen.op import auto_backend
from varlen_workbench.workbench.instruments import realclient

SIZE = realclient.Size(
    layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=1000, documents=(40, 90, 30, 96), tail=0
)


def median_step(attn_implementation: str, size: realclient.Size, steps: int) -> float:
    """Median seconds of forward + backward over `steps` steps, after one warm-up step."""
    model = realclient.llama(size)
    realclient.set_implementation(model, attn_implementation)
    inputs = realclient.pack(size)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model(**inputs).loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[32, 80], help="head dims to time")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    args = parser.parse_args()
    ours = hf.register()
    for head_dim in args.head_dims:
        size = dataclasses.replace(SIZE, head_dim=head_dim)
        backend = auto_backend(torch.device("cpu"), torch.float32, head_dim)
        sdpa, swap = (median_step(impl, size, args.steps) for impl in ("sdpa", ours))
        print(
            f"head_dim {head_dim}: sdpa {sdpa * 1e3:.1f} ms, {ours} (auto: {backend}) {swap * 1e3:.1f} ms, "
            f"ratio {swap / sdpa:.2f}x (target < 2x)"
        )


if __name__ == "__main__":
    main()
