"""The one timer of the workbench: every time the benchmark and the post-mortems report.

`time_call(fn)` runs `fn` `warmup` times, then `iters` (at least `MIN_ITERS`) timed calls back to
back, and reports the minimum and the median milliseconds per call and the host time to issue
one. On a GPU each call sits between two CUDA events recorded on the stream, with no host sync
between calls (as in training, and as in `triton.testing.do_bench`): the GPU time of a call is
measured, host dispatch counts only where the GPU outruns it, and a call that syncs on the host
(a `.item()`) has its stall inside its own span. Without CUDA, each call is timed on the host.
The median is the figure to compare; the minimum says how much of it is noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

MIN_ITERS = 20  # fewer timed calls make a median that a single slow call can move


@dataclass(frozen=True)
class CallTime:
    """Milliseconds per call of one timed function."""

    min_ms: float
    median_ms: float
    host_ms: float  # host time to issue one call (Python, dispatch, launches)
    iters: int


def time_call(
    fn: Callable[[], object], *, warmup: int = 3, iters: int = MIN_ITERS, device: str | torch.device | None = None
) -> CallTime:
    """Times `fn()` on `device` (default: CUDA when available): see the module's docstring."""
    if iters < MIN_ITERS:
        raise ValueError(f"time_call: iters={iters}; time at least {MIN_ITERS} calls (iters={MIN_ITERS}) for a stable median.")
    if warmup < 0:
        raise ValueError(f"time_call: warmup={warmup} must be >= 0.")
    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(iters):
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
        return CallTime(min(times), statistics.median(times), statistics.fmean(times), iters)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    began = time.perf_counter()
    for start, end in events:
        start.record()
        fn()
        end.record()
    host_ms = (time.perf_counter() - began) * 1e3 / iters
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return CallTime(min(times), statistics.median(times), host_ms, iters)


def host_us(
    fn: Callable[[], object], calls: int, repeats: int, warmup: int = 20, drain: Callable[[], object] | None = None
) -> float:
    """Host microseconds per call of `fn`, for code whose device work is stubbed or negligible
    (no GPU time is measured): the least over `repeats` runs of the mean of `calls` back-to-back
    calls, after `warmup`. Contention from other processes only adds time, so the least run is
    the best estimate of the code's own cost. `drain` (e.g. torch.cuda.synchronize) runs before
    each timed run, outside the timing, so no run starts behind the last one's device work."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        if drain is not None:
            drain()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - began) / calls * 1e6)
    return min(runs)
