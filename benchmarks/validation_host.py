"""The cost of `validate=True`: host time up to the first launch, and (on CUDA) whole steps.

    python benchmarks/validation_host.py [--device cpu|cuda] [--seqs 8 64 1024]
    python benchmarks/validation_host.py --steps [--iters 50]      # CUDA only

Host time: `varlen_attention` with its launchers replaced by an exception (as
docs/contract_errors.py does), so only the argument checks run: validate=False, validate=True on
new metadata tensors each call (the host check: one device->host copy of the four boundary
vectors, then the checks), and validate=True on the same tensors (remembered, not read again).
The layout is N sequences of 2048 tokens, bf16, 16 heads of 128, padded boundaries given. On
CUDA the GPU is idle, so the copy's sync costs only its latency.

`--steps` times what a training step pays: forward+backward on new metadata tensors every call,
`--iters` calls queued without a sync (as in training) and timed by CUDA events, median of 5
runs, for validate=False, validate=True as it runs natively (the boundary values checked by a
kernel, the host waiting for that check only) and validate=True with the host check instead
(what it cost before: the copy waits for all queued work, then the GPU idles while the host
checks and launches). The last column is the target: validate=True at most 5% over False.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

from contract_errors import Launched, checks_only  # noqa: E402

import kernels.varlen.op as op  # noqa: E402


def per_call_us(call, repeats: int = 7, calls: int = 300) -> float:
    """Median over `repeats` of the mean microseconds per call."""
    for _ in range(50):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def call(q: torch.Tensor, cu: torch.Tensor, same: list[torch.Tensor], validate: bool, fresh: bool) -> None:
    """One call up to its launch: on new boundary tensors (`fresh`) or on `same` each time."""
    m = [cu.clone() for _ in range(4)] if fresh else same
    try:
        op.varlen_attention(
            q, q, q, m[0], m[1], 2048, 2048, cu_seqlens_q_padded=m[2], cu_seqlens_k_padded=m[3], validate=validate
        )
    except Launched:
        pass


def host_times(device: torch.device, seqs: list[int]) -> None:
    print(f"device {device}, torch {torch.__version__}; microseconds of host time per call")
    for n in seqs:
        cu = torch.arange(0, 2048 * (n + 1), 2048, dtype=torch.int32, device=device)
        q = torch.empty(2048 * n, 16, 128, dtype=torch.bfloat16, device=device)
        same = [cu.clone() for _ in range(4)]

        with checks_only():
            row = {
                "validate=False": per_call_us(partial(call, q, cu, same, False, True)),
                "validate=True, new metadata": per_call_us(partial(call, q, cu, same, True, True)),
                "validate=True, same metadata": per_call_us(partial(call, q, cu, same, True, False)),
            }
        print(f"{n:5d} sequences: " + "  ".join(f"{k} {v:7.1f}" for k, v in row.items()))


def step_ms(qkv: list[torch.Tensor], cu: torch.Tensor, length: int, causal: bool, validate: bool, iters: int) -> float:
    """Median over 5 runs of the milliseconds per forward+backward, `iters` calls queued."""

    def step():
        m = [cu.clone() for _ in range(4)]  # new metadata every call, as every new batch brings
        out = op.varlen_attention(
            *qkv,
            m[0],
            m[1],
            length,
            length,
            cu_seqlens_q_padded=m[2],
            cu_seqlens_k_padded=m[3],
            causal=causal,
            validate=validate,
            backend="triton",
        )
        out.backward(grad)

    grad = torch.randn_like(qkv[0])
    for _ in range(3):  # tiles chosen, kernels compiled
        step()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / iters)
    return statistics.median(runs)


def step_times(iters: int) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per forward+backward, new metadata each call")
    print("workload                   validate=False  True (device check)  True (host check)  device check cost")
    for n, length, head_dim, causal in ((8, 2048, 64, False), (8, 2048, 128, False), (8, 2048, 128, True), (64, 256, 128, True)):
        qkv = [torch.randn(n * length, 16, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        cu = torch.arange(0, length * (n + 1), length, dtype=torch.int32, device="cuda")
        timed = partial(step_ms, qkv, cu, length, causal, iters=iters)
        plain, device = timed(validate=False), timed(validate=True)
        with mock.patch.object(op, "_checks_on_device", lambda: False):
            host = timed(validate=True)
        name = f"{n}x{length} d{head_dim}{' causal' if causal else ''}"
        print(f"{name:26s} {plain:14.3f} {device:20.3f} {host:18.3f} {device / plain - 1:+17.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--steps", action="store_true", help="time forward+backward steps on CUDA")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.steps:
        if not torch.cuda.is_available():
            parser.error("--steps times the kernels natively: it needs CUDA")
        step_times(args.iters)
        return 0
    host_times(torch.device(args.device), args.seqs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
