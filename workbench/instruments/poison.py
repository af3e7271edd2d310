"""Making uninitialised-memory bugs deterministic.

A kernel that forgets to write some rows of a `torch.empty` buffer returns whatever the
allocator handed out: zeros on a fresh process, stale activations in training, NaN after a
NaN step. Under `poisoned_memory()` every fresh buffer holds NaN (integers: their maximum),
so such a bug shows up the same way on every run, on CPU and on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _prefill_cuda_cache(megabytes: int, device: torch.device) -> None:
    """Leaves the caching allocator holding NaN-filled free blocks of many sizes.

    Later allocations that reuse them start with NaN even outside deterministic mode, the
    way real leftovers from a NaN step would look.
    """
    blocks = []
    size = 512  # bytes; doubling sizes cover the allocator's small and large pools
    budget = megabytes << 20
    while budget > 0 and size <= budget:
        blocks.append(torch.full((size // 4,), float("nan"), dtype=torch.float32, device=device))
        budget -= size
        size *= 2
    del blocks  # freed into the cache, contents intact


@contextlib.contextmanager
def poisoned_memory(*, cuda_prefill_mb: int = 0) -> Iterator[None]:
    """Within the block, `torch.empty*` returns NaN-filled memory (deterministically).

    Uses `torch.use_deterministic_algorithms(True, warn_only=True)` with
    `torch.utils.deterministic.fill_uninitialized_memory = True`; `warn_only` keeps ops that
    lack a deterministic implementation working. With `cuda_prefill_mb > 0` and CUDA present,
    the caching allocator is also pre-filled with NaN blocks. Every global setting is
    restored on exit, also when the block raises.
    """
    if cuda_prefill_mb < 0:
        raise ValueError(f"cuda_prefill_mb = {cuda_prefill_mb} must be >= 0 (0 disables the pre-fill).")
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        if cuda_prefill_mb and torch.cuda.is_available():
            _prefill_cuda_cache(cuda_prefill_mb, torch.device("cuda", torch.cuda.current_device()))
        yield
    finally:
        enabled, warn_only, fill = saved
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
