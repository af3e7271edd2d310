"""Overhead of `GradientHealth` on a training step, measured side by side in one run.

    python benchmarks/health_overhead.py [--steps 20] [--repeats 9] [--threads 1]

Trains `varlen_workbench.workbench.instruments.tinylm.TinyLM` (2 pre-norm blocks, causal varlen attention through
`dense_attention`, ~200 packed tokens) on the CPU with AdamW, alternating timed blocks of steps
without and with the monitor (gradient hooks, per-step classification, optimizer-state and
parameter checks, per-token norms of the embeddings), and prints the median step times and
their ratio. Target: < 5 % overhead.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from varlen_workbench.workbench.instruments.health import GradientHealth
from varlen_workbench.workbench.instruments.tinylm import LMConfig, SyntheticTask, TinyLM
from varlen_workbench.workbench.layout import region_labels


def _train(model, optimizer, batch, steps: int, monitor: GradientHealth | None) -> float:
    """Seconds per step, averaged over `steps` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        loss = model.loss(batch)
        loss.backward()
        optimizer.step()
        if monitor is not None:
            monitor.step(loss)
        optimizer.zero_grad()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed block")
    parser.add_argument("--repeats", type=int, default=9, help="timed blocks per variant (alternating)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest timings on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = TinyLM(LMConfig(vocab=64, dim=64, heads=2, layers=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = SyntheticTask(vocab=64).batch((40, 17, 64, 33, 29), align=16)
    regions = region_labels(batch.cu_seqlens, batch.cu_seqlens_padded, batch.tokens.numel())
    _train(model, optimizer, batch, 5, None)  # warm-up: allocator, AdamW state
    plain, watched = [], []
    for _ in range(args.repeats):
        plain.append(_train(model, optimizer, batch, args.steps, None))
        with GradientHealth(model, optimizer) as monitor:
            monitor.watch_tokens("embeddings", model.embed, regions)
            watched.append(_train(model, optimizer, batch, args.steps, monitor))
    base, with_monitor = statistics.median(plain), statistics.median(watched)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"tokens per step        {batch.tokens.numel()}   parameters {params} in {len(list(model.parameters()))} tensors   threads {args.threads}"
    )
    print(f"step without monitor   {base * 1e3:8.3f} ms (median of {args.repeats} blocks x {args.steps} steps)")
    print(f"step with monitor      {with_monitor * 1e3:8.3f} ms")
    print(f"overhead ratio         {with_monitor / base:8.4f}  ({(with_monitor / base - 1) * 100:+.2f} %, target < 5 %)")


if __name__ == "__main__":
    main()
