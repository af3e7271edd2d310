"""Overhead of `GradientHealth` on a training step, measured side by side in one run.

    python benchmarks/health_overhead.py [--steps 20] [--repeats 9] [--threads 1]

Trains `TinyPackedLM` (one attention block over a packed batch of ~200 tokens, with the
oracle as attention) on the CPU with Adam, alternating blocks of steps with and without the
monitor (gradient hooks, per-step classification, optimizer-state check, per-token norms of
the embeddings), and prints the median step times and their ratio. Target: < 5 % overhead.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from workbench.health import GradientHealth
from workbench.layout import Case
from workbench.specimens import TinyPackedLM, packed_tokens


def _train(model, optimizer, data, steps: int, monitor: GradientHealth | None) -> float:
    """Seconds per step, averaged over `steps` steps."""
    watch = None
    if monitor is not None:
        watch = lambda name, x: monitor.watch_tokens(name, x, data["regions"])  # noqa: E731
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(data["tokens"], data["cu_seqlens"], data["cu_seqlens_padded"], data["max_seqlen"], watch=watch)
        loss = torch.nn.functional.cross_entropy(logits, data["targets"])
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
    torch.manual_seed(0)
    case = Case(seqlens_q=(40, 17, 64, 33), align=16, tail_q=8)
    model = TinyPackedLM(vocab=256, dim=64, heads=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = packed_tokens(case, vocab=256)
    _train(model, optimizer, data, 5, None)  # warm-up: allocator, Adam state
    plain, watched = [], []
    for _ in range(args.repeats):
        plain.append(_train(model, optimizer, data, args.steps, None))
        with GradientHealth(model, optimizer) as monitor:
            watched.append(_train(model, optimizer, data, args.steps, monitor))
    base, with_monitor = statistics.median(plain), statistics.median(watched)
    print(f"tokens per step        {data['tokens'].numel()}   parameters {sum(p.numel() for p in model.parameters())}   threads {torch.get_num_threads()}")
    print(f"step without monitor   {base * 1e3:8.3f} ms (median of {args.repeats} x {args.steps} steps)")
    print(f"step with monitor      {with_monitor * 1e3:8.3f} ms")
    print(f"overhead ratio         {with_monitor / base:8.4f}  ({(with_monitor / base - 1) * 100:+.2f} %, target < 5 %)")


if __name__ == "__main__":
    main()
