"""`validate=True` on the device: the metadata's value checks run as a kernel, not on the host.

The host check (`kernels.contract.check_cu_seqlens`) needs the boundary values on the host: a
device->host copy that first waits for all the work queued before it, and leaves the GPU idle
while the host then checks and launches. Here one small kernel checks the values where they
live and writes a *safe copy* of them: the boundaries themselves when they pass, all zeros
when any check fails (every row is then padding: the attention kernels read no row and write
zeros and -inf, never outside the tensors). The kernels are launched on the safe copy; only
then does the host wait, for the check alone (the attention kernels stay queued behind it, so
the GPU keeps working while the host goes on), and read one flag. A failed check reruns the
host check, which raises the message a CPU call gets, before `varlen_attention` returns: no
result of a malformed call ever reaches the caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # boundaries per step of the check's loops


@triton.jit
def _side_errors(Real, Padded, n_seqs, total, max_seqlen, CHUNK: tl.constexpr):
    """How many checks of one side fail: both vectors start at 0 and never decrease, a real
    length fits its padded slot and max_seqlen, the padded layout ends within `total` rows.
    Without padded boundaries `Padded` is `Real` (those checks then hold by themselves)."""
    errors = (tl.load(Real) != 0).to(tl.int32) + (tl.load(Padded) != 0).to(tl.int32)
    for first in range(0, n_seqs, CHUNK):
        seqs = first + tl.arange(0, CHUNK)
        ok = seqs < n_seqs
        # int64 differences: an int32 decrease across the whole range must not wrap to positive
        length = tl.load(Real + seqs + 1, mask=ok, other=0).to(tl.int64) - tl.load(Real + seqs, mask=ok, other=0).to(tl.int64)
        room = tl.load(Padded + seqs + 1, mask=ok, other=0).to(tl.int64) - tl.load(Padded + seqs, mask=ok, other=0).to(tl.int64)
        bad = (length < 0) | (room < 0) | (length > room) | (length > max_seqlen)
        errors += tl.sum(bad.to(tl.int32), 0)
    errors += (tl.load(Padded + n_seqs).to(tl.int64) > total).to(tl.int32)
    return errors


@triton.jit(do_not_specialize=["n_seqs", "total_q", "total_k", "max_q", "max_k"])
def check_metadata_kernel(
    CuQ,
    CuK,
    CuQPadded,
    CuKPadded,
    Safe,
    Errors,
    n_seqs,
    total_q,
    total_k,
    max_q,
    max_k,
    stride_safe,
    CHUNK: tl.constexpr,
):
    """One program: Errors[0] = how many checks fail; Safe[0..3] = the four vectors, or zeros
    if any check fails."""
    errors = _side_errors(CuQ, CuQPadded, n_seqs, total_q, max_q, CHUNK)
    errors += _side_errors(CuK, CuKPadded, n_seqs, total_k, max_k, CHUNK)
    keep = errors == 0
    for first in range(0, n_seqs + 1, CHUNK):
        i = first + tl.arange(0, CHUNK)
        ok = i <= n_seqs
        tl.store(Safe + i, tl.where(keep, tl.load(CuQ + i, mask=ok, other=0), 0), mask=ok)
        tl.store(Safe + stride_safe + i, tl.where(keep, tl.load(CuK + i, mask=ok, other=0), 0), mask=ok)
        tl.store(Safe + 2 * stride_safe + i, tl.where(keep, tl.load(CuQPadded + i, mask=ok, other=0), 0), mask=ok)
        tl.store(Safe + 3 * stride_safe + i, tl.where(keep, tl.load(CuKPadded + i, mask=ok, other=0), 0), mask=ok)
    tl.store(Errors, errors)


class DeviceCheck:
    """The outcome of one check, readable once the device has run it: on CUDA its count is
    copied into pinned host memory behind the check and an event marks the copy, so `failed()`
    waits for the check only, not for the work queued after it."""

    def __init__(self, errors: torch.Tensor) -> None:
        if errors.is_cuda:
            self.errors = torch.empty(1, dtype=torch.int32, pin_memory=True)
            self.errors.copy_(errors, non_blocking=True)
            self.copied: torch.cuda.Event | None = torch.cuda.Event()
            self.copied.record()
        else:  # the interpreter ran the check before returning
            self.errors, self.copied = errors, None

    def failed(self) -> bool:
        if self.copied is not None:
            self.copied.synchronize()
        return bool(self.errors.item())


def check_on_device(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor | None,
    cu_seqlens_k_padded: torch.Tensor | None,
    total_q: int,
    total_k: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], DeviceCheck]:
    """Launches the check of the boundary values (the host check's value checks, the same
    rules); returns the safe copies of (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded,
    cu_seqlens_k_padded), absent padded vectors standing as the real ones, for the kernels to
    use in their place, and the check's outcome. The tensors' kinds, shapes and devices must
    have passed `check_cu_seqlens_tensors`. No host sync."""
    vectors = (
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded,
        cu_seqlens_k if cu_seqlens_k_padded is None else cu_seqlens_k_padded,
    )
    n_seqs = cu_seqlens_q.numel() - 1
    dtype = torch.int32 if all(v.dtype == torch.int32 for v in vectors) else torch.int64
    # rows padded to 32 bytes keep every safe vector 16-byte aligned, as Triton specializes on it
    safe = torch.empty((4, (n_seqs + 4) // 4 * 4), dtype=dtype, device=cu_seqlens_q.device)
    errors = torch.empty(1, dtype=torch.int32, device=cu_seqlens_q.device)
    check_metadata_kernel[(1,)](
        *vectors, safe, errors, n_seqs, total_q, total_k, max_seqlen_q, max_seqlen_k, safe.stride(0), CHUNK=CHUNK
    )
    q, k, q_padded, k_padded = (row[: n_seqs + 1] for row in safe)
    return (q, k, q_padded, k_padded), DeviceCheck(errors)
