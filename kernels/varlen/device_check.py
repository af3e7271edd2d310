"""`validate=True` on the device: the metadata's value checks run as a kernel, not on the host.

The host check (`varlen_workbench.kernels.contract.check_cu_seqlens`) needs the boundary values on the host: a
device->host copy that first waits for all the work queued before it, and leaves the GPU idle
while the host then checks and launches. Here one small kernel checks the values where they
live and writes a *safe copy* of them: the boundaries themselves when they pass, all zeros
when any check fails (every row is then padding: the attention kernels read no row and the
padding fills, which read the verdict, write NaN, never outside the tensors), a snapshot of the
values as they were, for the error message, beside its verdict the safe copy's layout
(`SafeLayout`) that the FA4 path needs, read in the same device->host copy, and the safe copy's
work lists, which the Triton path would otherwise launch a kernel to make. The kernels are
launched on the safe copy. Reading the verdict waits for the check, and so for all the work
queued before it: `varlen_workbench.kernels.varlen.metadata.VarlenMetadata` decides when it is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton.language as tl

from varlen_workbench.kernels.caches import instance
from varlen_workbench.kernels.contract import check_cu_seqlens
from varlen_workbench.kernels.runtime import jit
from varlen_workbench.kernels.varlen.kernel_common import write_block_starts
from varlen_workbench.kernels.varlen.launch import BLOCK_SIZES, SMALLEST_BLOCK_LOG2, work_lists_shape

CHUNK = 1024  # boundaries per step of the check's loops


class SafeLayout(NamedTuple):
    """What the check tells of its safe copy's layout: how many rows of q and of k are real
    (`cu_seqlens_q[-1]`, `cu_seqlens_k[-1]`), and whether padding lies between the sequences of
    q, of k (a real boundary differs from its padded one: GAP rows). All zeros after a failure."""

    real_q: int
    real_k: int
    gap_q: bool
    gap_k: bool


@jit
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


@jit(do_not_specialize=["n_seqs", "total_q", "total_k", "max_q", "max_k"])
def check_metadata_kernel(
    CuQ,
    CuK,
    CuQPadded,
    CuKPadded,
    Safe,
    Verdict,
    Work,
    n_seqs,
    total_q,
    total_k,
    max_q,
    max_k,
    stride_safe,
    stride_work_side,
    stride_work_size,
    SMALLEST_LOG2: tl.constexpr,
    N_SIZES: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program: Verdict[0] = how many checks fail; Verdict[1] = 1 if q or k has a row that
    is not real (its real lengths add up to fewer rows than it has: where the checks pass,
    every row is real otherwise); Verdict[2..5] = the layout of the safe copy: cu_seqlens_q[-1],
    cu_seqlens_k[-1], and 1 where a real boundary of q (of k) differs from its padded one (GAP
    rows); Safe[0..3] = the four vectors, or zeros if any check fails; Safe[4..7] = the four
    vectors as they are now (for the error message); Work = the work lists of the safe copy
    (`launch.work_lists`' layout), which the attention kernels then need no launch to make."""
    errors = _side_errors(CuQ, CuQPadded, n_seqs, total_q, max_q, CHUNK)
    errors += _side_errors(CuK, CuKPadded, n_seqs, total_k, max_k, CHUNK)
    real_q, real_k = tl.load(CuQ + n_seqs).to(tl.int64), tl.load(CuK + n_seqs).to(tl.int64)
    keep = errors == 0
    gaps_q, gaps_k = tl.zeros((), tl.int32), tl.zeros((), tl.int32)
    for first in range(0, n_seqs + 1, CHUNK):
        i = first + tl.arange(0, CHUNK)
        ok = i <= n_seqs
        q, k = tl.load(CuQ + i, mask=ok, other=0), tl.load(CuK + i, mask=ok, other=0)
        q_padded, k_padded = tl.load(CuQPadded + i, mask=ok, other=0), tl.load(CuKPadded + i, mask=ok, other=0)
        gaps_q += tl.sum((q != q_padded).to(tl.int32), 0)
        gaps_k += tl.sum((k != k_padded).to(tl.int32), 0)
        tl.store(Safe + i, tl.where(keep, q, 0), mask=ok)
        tl.store(Safe + stride_safe + i, tl.where(keep, k, 0), mask=ok)
        tl.store(Safe + 2 * stride_safe + i, tl.where(keep, q_padded, 0), mask=ok)
        tl.store(Safe + 3 * stride_safe + i, tl.where(keep, k_padded, 0), mask=ok)
        tl.store(Safe + 4 * stride_safe + i, q, mask=ok)
        tl.store(Safe + 5 * stride_safe + i, k, mask=ok)
        tl.store(Safe + 6 * stride_safe + i, q_padded, mask=ok)
        tl.store(Safe + 7 * stride_safe + i, k_padded, mask=ok)
    write_block_starts(CuQ, Work, n_seqs, stride_work_size, keep, SMALLEST_LOG2, N_SIZES, CHUNK)
    write_block_starts(CuK, Work + stride_work_side, n_seqs, stride_work_size, keep, SMALLEST_LOG2, N_SIZES, CHUNK)
    tl.store(Verdict + 1, ((real_q != total_q) | (real_k != total_k)).to(tl.int64))
    # the safe copy's layout: all zeros (no real row, no GAP) where a check fails
    tl.store(Verdict + 2, tl.where(keep, real_q, 0))
    tl.store(Verdict + 3, tl.where(keep, real_k, 0))
    tl.store(Verdict + 4, (keep & (gaps_q != 0)).to(tl.int64))
    tl.store(Verdict + 5, (keep & (gaps_k != 0)).to(tl.int64))
    tl.store(Verdict, errors.to(tl.int64))


class _HostVerdicts:
    """Pinned host buffers for the verdicts of checks on CUDA, each with the event that marks its
    copy, taken by a check and given back once its verdict is read: a check on new metadata then
    allocates no pinned memory and creates no event (microseconds of host time each). A buffer
    comes back only after its copy has completed and its values are kept by the check that read
    them, so no copy is ever in flight into a buffer that is handed out."""

    KEPT = 4  # per device: a step's checks are read one by one, the next reuses the last buffer

    def __init__(self) -> None:
        self.free: dict[torch.device, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def take(self, verdict: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        free = self.free.get(verdict.device)
        if free:
            return free.pop()
        return torch.empty(verdict.shape, dtype=verdict.dtype, pin_memory=True), torch.cuda.Event()

    def give(self, device: torch.device, buffer: torch.Tensor, event: torch.cuda.Event) -> None:
        free = self.free.setdefault(device, [])
        if len(free) < self.KEPT:
            free.append((buffer, event))


class DeviceCheck:
    """The outcome of one check, readable once the device has run it: on CUDA its verdict (and
    the layout the FA4 path needs) is copied into pinned host memory behind the check and an
    event marks the copy (both reused, `_HostVerdicts`). `done()` asks without waiting; `failed()`
    and `layout()` wait, for the check and all the work queued before it, and read the verdict
    and the layout together.

    `snapshot` holds the boundary vectors as the check saw them (None for an absent padded
    one), `limits` the call's (total_q, total_k, max_seqlen_q, max_seqlen_k): a failure is
    explained by the host check of those values, whatever the tensors hold by the time it
    surfaces."""

    def __init__(
        self, verdict: torch.Tensor, snapshot: Sequence[torch.Tensor | None], limits: Sequence[int], work: torch.Tensor
    ) -> None:
        self.snapshot, self.limits = tuple(snapshot), tuple(limits)
        self.work = work  # the work lists of the safe copy, written by the check: nothing writes them after
        self.device_verdict = verdict  # read on the device by the padding fills: NaN after a failure
        self.outcome: bool | None = None  # failed or not, once read
        self.padding = True  # whether q or k has padding rows, once read (until then: maybe)
        self.read_layout = SafeLayout(0, 0, False, False)  # once read
        # the pinned buffer and event taken from the process's _HostVerdicts, given back once read
        self.taken: tuple[torch.device, torch.Tensor, torch.cuda.Event] | None = None
        if verdict.is_cuda:
            self.verdict, event = instance(_HostVerdicts).take(verdict)
            self.verdict.copy_(verdict, non_blocking=True)
            event.record(torch.cuda.current_stream(verdict.device))  # the stream the copy is queued on
            self.copied: torch.cuda.Event | None = event
            self.taken = (verdict.device, self.verdict, event)
        else:  # the interpreter ran the check before returning
            self.verdict, self.copied = verdict, None

    def done(self) -> bool:
        """Whether the device has run the check (never waits)."""
        return self.outcome is not None or self.copied is None or self.copied.query()

    def failed(self) -> bool:
        if self.outcome is None:
            if self.copied is not None:
                self.copied.synchronize()
            errors, padding, real_q, real_k, gap_q, gap_k = self.verdict.tolist()  # the one host read
            self.outcome, self.padding = bool(errors), bool(padding)
            self.read_layout = SafeLayout(real_q, real_k, bool(gap_q), bool(gap_k))
            if self.taken is not None:  # read: its buffer and event serve the next check
                instance(_HostVerdicts).give(*self.taken)
                self.taken = None
        return self.outcome

    def layout(self) -> SafeLayout:
        """The safe copy's layout, read with the verdict (waits for the check if it is not read yet)."""
        self.failed()
        return self.read_layout

    def all_rows_real(self) -> bool:
        """Whether the check is known, without waiting, to have passed on boundaries under which
        every row of q and k is real: then no padding row is left to fill."""
        return self.done() and not self.failed() and not self.padding

    def raise_if_failed(self, when: str = "") -> None:
        """Waits for the check; if it failed, raises the host check's error for the checked
        values, after `when` (which says which call it was, where it is not the current one)."""
        if not self.failed():
            return
        q, k, q_padded, k_padded = self.snapshot
        total_q, total_k, max_q, max_k = self.limits
        try:
            check_cu_seqlens(
                q, k, max_q, max_k, cu_seqlens_q_padded=q_padded, cu_seqlens_k_padded=k_padded, total_q=total_q, total_k=total_k
            )
        except (TypeError, ValueError) as error:
            if not when:
                raise
            raise type(error)(f"{when}{error}") from None
        raise AssertionError(
            "the device check of the metadata failed where the host check passes: a bug of varlen_workbench.kernels.varlen.device_check"
        )


def _bounded(limit) -> int:
    """A max_seqlen as a kernel argument: past int64's range any bound is as good as 2**62 (or -1)."""
    return max(min(int(limit), 1 << 62), -1)


Vectors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
DeviceChecked = tuple[Vectors, DeviceCheck]  # the safe copies and the outcome of one check


def check_on_device(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor | None,
    cu_seqlens_k_padded: torch.Tensor | None,
    total_q: int,
    total_k: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> DeviceChecked:
    """Launches the check of the boundary values (the host check's value checks, the same
    rules); returns the safe copies of (cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded,
    cu_seqlens_k_padded), absent padded vectors standing as the real ones, for the kernels to
    use in their place, and the check's outcome (with the safe copy's work lists). The tensors' kinds, shapes and devices must
    have passed `check_cu_seqlens_tensors`, the max_seqlens `check_max_seqlen`. No host sync."""
    vectors = (
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded,
        cu_seqlens_k if cu_seqlens_k_padded is None else cu_seqlens_k_padded,
    )
    n_seqs = cu_seqlens_q.numel() - 1
    dtype = torch.int32 if all(v.dtype == torch.int32 for v in vectors) else torch.int64
    # rows padded to 32 bytes keep every safe vector 16-byte aligned, as Triton specializes on it
    safe = torch.empty((8, (n_seqs + 4) // 4 * 4), dtype=dtype, device=cu_seqlens_q.device)
    # failed checks, padding rows, the safe copy's layout: one device->host copy reads them all
    verdict = torch.empty(6, dtype=torch.int64, device=cu_seqlens_q.device)
    work = torch.empty(work_lists_shape(n_seqs), dtype=torch.int32, device=cu_seqlens_q.device)
    check_metadata_kernel[(1,)](
        *vectors,
        safe,
        verdict,
        work,
        n_seqs,
        total_q,
        total_k,
        _bounded(max_seqlen_q),
        _bounded(max_seqlen_k),
        safe.stride(0),
        work.stride(0),
        work.stride(1),
        SMALLEST_LOG2=SMALLEST_BLOCK_LOG2,
        N_SIZES=len(BLOCK_SIZES),
        CHUNK=CHUNK,
    )
    q, k, q_padded, k_padded, *snapshot = safe[:, : n_seqs + 1].unbind()  # two view ops, not sixteen
    for side, given in ((2, cu_seqlens_q_padded), (3, cu_seqlens_k_padded)):
        if given is None:
            snapshot[side] = None
    limits = (total_q, total_k, max_seqlen_q, max_seqlen_k)
    return (q, k, q_padded, k_padded), DeviceCheck(verdict, snapshot, limits, work)
