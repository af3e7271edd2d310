"""The workarounds a user of torch's varlen_attn has today, the proposed input check, and whether each compiles
and captures."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.replicas.torch_varlen import replica_varlen_attn
from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.postmortems.torch_varlen_176793.cases import STUDY
from varlen_workbench.postmortems.torch_varlen_176793.mechanism import (
    _allocator,
    _first_line,
    _masked_grad_out,
    _max_abs,
    _outcome,
)
from varlen_workbench.postmortems.torch_varlen_176793.upstream import torch_style
from varlen_workbench.workbench.layout import Case, cumulative, pack
from varlen_workbench.workbench.probes import probe


def as_dummy_sequence(varlen_fn: Callable) -> Callable:
    """Workaround (a): describe the trailing rows as one more sequence in cu_seqlens.

    `cu_seqlens` gains a last boundary at q.shape[0] (k.shape[0]): a tensor op on the device, no
    host sync. `max_q`/`max_k` must cover that dummy sequence; without a host read of its length
    the only safe bound is the buffer's row count, which only adds programs that exit at once.
    Safe when (1) the padding rows hold finite values (the dummy sequence attends over them) and
    (2) the loss ignores those rows; then their gradients are exactly 0. q and k need trailing
    rows alike (a dummy query sequence with no keys is a different edge case).
    """

    @functools.wraps(varlen_fn)
    def dummy_sequence(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs):
        cu_q = torch.cat([cu_seq_q, cu_seq_q.new_full((1,), query.shape[0])])
        cu_k = torch.cat([cu_seq_k, cu_seq_k.new_full((1,), key.shape[0])])
        return varlen_fn(query, key, value, cu_q, cu_k, max(max_q, query.shape[0]), max(max_k, key.shape[0]), *args, **kwargs)

    return dummy_sequence


def as_sliced(varlen_fn: Callable) -> Callable:
    """Workaround (b): run the op on rows < cu_seqlens[-1] only, pad the output back with zeros.

    Autograd's slice backward writes 0 into the TAIL rows of dq/dk/dv. `int(cu_seq_q[-1])` is a
    device->host read (a sync, and a data-dependent shape under torch.compile); where the total
    is known on the host, pass that instead. flash-attention#2324 proposed an opt-in autograd
    function for the same purpose (closed unmerged).
    """

    @functools.wraps(varlen_fn)
    def sliced(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs):
        total_q, total_k = int(cu_seq_q[-1]), int(cu_seq_k[-1])  # the host sync
        out = varlen_fn(query[:total_q], key[:total_k], value[:total_k], cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs)
        return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, query.shape[0] - total_q))

    return sliced


def _zero_rows_from(x: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(x.shape[0], device=x.device) >= end
    return torch.where(rows.view(-1, *([1] * (x.dim() - 1))), torch.zeros((), dtype=x.dtype, device=x.device), x)


class _ZeroRowsFrom(torch.autograd.Function):
    """Identity forward; backward zeroes gradient rows >= `end` (a 0-d device tensor): no sync."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(end)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (end,) = ctx.saved_tensors
        return _zero_rows_from(grad, end), None


def as_tail_zeroed(varlen_fn: Callable) -> Callable:
    """Workaround (c): what zero-initialised buffers would give, done on the device.

    varlen_attn allocates its own out/dq/dk/dv (no argument takes a buffer), so the user cannot
    zero-initialise them. Instead: rows >= cu_seqlens[-1] of the output are replaced by 0 with
    `torch.where` (NaN-proof, unlike a multiply by a mask), and an identity autograd function
    before the op does the same to dq/dk/dv in backward. No host sync, static shapes.
    """

    @functools.wraps(varlen_fn)
    def tail_zeroed(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs):
        end_q, end_k = cu_seq_q[-1], cu_seq_k[-1]
        q = _ZeroRowsFrom.apply(query, end_q)
        k, v = _ZeroRowsFrom.apply(key, end_k), _ZeroRowsFrom.apply(value, end_k)
        return _zero_rows_from(varlen_fn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs), end_q)

    return tail_zeroed


def fixed_torch_style(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
    """Workaround (d): our fixed kernel in varlen_attn's (2.10) call shape, without host-side
    validation (no sync); rows beyond cu_seqlens[-1] of out and of every gradient are 0."""
    return varlen_attention(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, validate=False, backend="triton"
    )


def workarounds(varlen_fn: Callable) -> dict[str, Callable]:
    """The ways to call torch-style `varlen_fn` today, in the order the page presents them."""
    return {
        "as is": varlen_fn,
        "(a) dummy last sequence": as_dummy_sequence(varlen_fn),
        "(b) slice to cu_seqlens[-1]": as_sliced(varlen_fn),
        "(c) zero TAIL rows on device": as_tail_zeroed(varlen_fn),
        "(d) our fixed kernel": fixed_torch_style,
    }


def workaround_checks(varlen_fn: Callable, case: Case, device=None, *, poisoned: bool = True) -> list[dict[str, Any]]:
    """Each workaround on `case` (memory poisoned): with the loss over every row (dO on TAIL
    rows too) and with a loss mask (dO = 0 there). Per point: TAIL rows of out/dq/dk/dv
    non-finite and max |x|, exactly zero or not, REAL rows within the oracle's bound."""
    batch = pack(case, device)
    points = []
    for name, fn in workarounds(varlen_fn).items():
        for loss in ("every row", "loss mask"):
            d_out = "randn" if loss == "every row" else _masked_grad_out(batch)
            point = {"workaround": name, "loss": loss}
            try:
                record = probe(torch_style(fn, name), batch, name=name, poisoned=poisoned, grad_out=d_out)
                point.update(
                    tail_nonfinite=record.nonfinite_in("TAIL"),
                    tail_max_abs=max(record.max_abs[t]["TAIL"] for t in record.max_abs),
                    tail_zero=record.padding_exactly_zero,
                    real_within_bound=record.real_within_bound,
                )
            except Exception as exc:  # recorded: a workaround that raises is a result
                point["error"] = _first_line(exc)
            points.append(point)
    return points


def proposed_check(query: torch.Tensor, key: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor) -> None:
    """The check of PRs #186786/#188933, as proposed: `.item()` reads the last boundary on the host."""
    total_q = cu_seq_q[-1].item()
    if query.size(0) > total_q:
        raise ValueError(
            f"query has {query.size(0)} tokens but cu_seq_q[-1] = {total_q}. query length must not "
            "exceed cu_seq_q[-1] to avoid NaN gradients. See https://github.com/pytorch/pytorch/issues/176793."
        )
    total_k = cu_seq_k[-1].item()
    if key.size(0) > total_k:
        raise ValueError(f"key has {key.size(0)} tokens but cu_seq_k[-1] = {total_k}.")


def with_proposed_check(varlen_fn: Callable) -> Callable:
    """A torch-style `varlen_fn` with the proposed check in front, where the PRs put it."""

    @functools.wraps(varlen_fn)  # keeps the signature: the adapter still finds is_causal or window_size
    def checked(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs):
        proposed_check(query, key, cu_seq_q, cu_seq_k)
        return varlen_fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs)

    return checked


def _subjects(base: Callable = replica_varlen_attn, name: str = "replica") -> dict[str, Callable]:
    """torch-style callables whose capture (compile, CUDA graphs) we compare; those with the
    check come last, so that a failed CUDA-graph capture cannot disturb the others."""
    plain = {
        f"{name} (no check)": base,
        f"{name} + (a) dummy last sequence": as_dummy_sequence(base),
        f"{name} + (c) zero TAIL rows on device": as_tail_zeroed(base),
        "fixed kernel, validate=False": fixed_torch_style,
    }
    checked = {f"{name} + (b) slice (host sync)": as_sliced(base), f"{name} + proposed check": with_proposed_check(base)}
    return plain | checked


def compile_fullgraph(varlen_fn: Callable, batch) -> dict[str, Any]:
    """Does `torch.compile(fullgraph=True)` capture a forward of torch-style `varlen_fn` in one graph?

    `backend="eager"`: fullgraph capture is decided by Dynamo's tracing whatever the backend, and
    the eager backend skips code generation that would only cost time here.
    """
    max_q, max_k = batch.max_seqlen_q, batch.max_seqlen_k

    def forward(q, k, v, cu_q, cu_k):
        return varlen_fn(q, k, v, cu_q, cu_k, max_q, max_k)

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    try:
        return _outcome(lambda: compiled(batch.q, batch.k, batch.v, batch.cu_seqlens_q, batch.cu_seqlens_k))
    finally:
        torch._dynamo.reset()


def cuda_graph_capture(varlen_fn: Callable, batch) -> dict[str, Any]:
    """Can a forward of torch-style `varlen_fn` be captured in a CUDA graph? Replays once if so."""
    args = (
        batch.q.detach(),
        batch.k.detach(),
        batch.v.detach(),
        batch.cu_seqlens_q,
        batch.cu_seqlens_k,
        batch.max_seqlen_q,
        batch.max_seqlen_k,
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture: compilation, allocator pools
        _outcome(lambda: varlen_fn(*args))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()

    def capture_and_replay():
        with torch.cuda.graph(graph):
            varlen_fn(*args)
        graph.replay()
        torch.cuda.synchronize()

    return _outcome(capture_and_replay)


@dataclass
class CheckAssessment:
    """The proposed check on the study case (TAIL rows) and without TAIL rows, and its cost."""

    rejects_tail: dict[str, Any]  # outcome of the checked replica on STUDY
    accepts_no_tail: dict[str, Any]  # outcome on STUDY with no TAIL rows
    compile: dict[str, dict[str, Any]]  # subject -> torch.compile(fullgraph=True) outcome, no TAIL rows


def assess_proposed_check(device: str | torch.device | None = None) -> CheckAssessment:
    batch = pack(STUDY, device)
    checked = torch_style(with_proposed_check(replica_varlen_attn), "replica + proposed check")
    no_tail = pack(STUDY.with_(tail_q=0, tail_k=0), device)
    return CheckAssessment(
        rejects_tail=_outcome(lambda: batch.call(checked)),
        accepts_no_tail=_outcome(lambda: no_tail.call(checked)),
        # On a layout the check accepts: its cost is paid by every call, legal ones included.
        compile={name: compile_fullgraph(fn, no_tail) for name, fn in _subjects().items()},
    )


def qkv_damage(
    varlen_fn: Callable,
    *,
    seqlens: tuple[int, ...] = STUDY.seqlens_q,
    trailing: int = 8,
    heads: int = STUDY.heads,
    head_dim: int = STUDY.head_dim,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device | None = None,
    garbage: str = "stale",
    seed: int = 0,
) -> dict[str, Any]:
    """A QKV projection, `varlen_fn`, and a loss that reads only real rows (a loss mask).

    `garbage`: "stale" leaves finite values where the op allocates (the replica's
    `stale_memory()` on CPU, freed finite blocks in the CUDA caching allocator), "as left"
    takes whatever the allocator hands back. Compares the QKV weight gradient with the correct
    one (the same op on the sliced rows, whose TAIL gradient is 0 by construction): finite or
    not, relative error, and the TAIL rows of d(qkv).
    """
    device = torch.device(device) if device is not None else default_device()
    generator = torch.Generator().manual_seed(seed)
    dim, real = heads * head_dim, sum(seqlens)
    rows = real + trailing
    x = torch.randn(rows, dim, generator=generator).to(device, dtype)
    weight0 = (torch.randn(3 * dim, dim, generator=generator) * dim**-0.5).to(device, dtype)
    probe_dir = torch.randn(real, heads, head_dim, generator=generator).to(device, torch.float32)
    cu = cumulative(seqlens, device)

    def weight_grad(fn: Callable, garbage_on: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
        weight = weight0.clone().requires_grad_()
        qkv = x @ weight.T
        qkv.retain_grad()
        q, k, v = qkv.view(rows, 3, heads, head_dim).unbind(1)
        with _allocator(garbage, q, seed) if garbage_on else contextlib.nullcontext():
            out = fn(q, k, v, cu, cu, max(seqlens), max(seqlens))
            loss = (out[:real].float() * probe_dir).sum()  # the loss reads real rows only
            loss.backward()
        return weight.grad.float(), qkv.grad.float(), float(loss.detach())

    correct, correct_dqkv, loss_ok = weight_grad(as_sliced(varlen_fn), garbage_on=False)
    grad, dqkv, loss = weight_grad(varlen_fn, garbage_on=True)
    tail = dqkv[real:]
    return {
        "garbage": garbage,
        "trailing": trailing,
        "loss": loss,
        "loss_correct": loss_ok,
        "weight_grad_finite": bool(torch.isfinite(grad).all()),
        "dqkv_tail_nonfinite": int((~torch.isfinite(tail)).sum()),
        "dqkv_tail_max_abs": _max_abs(tail),
        "dqkv_real_max_abs_diff": _max_abs(dqkv[:real] - correct_dqkv[:real]),
        "weight_grad_rel_error": float((grad - correct).norm() / correct.norm()),
        "correct_tail_zero": bool((correct_dqkv[real:] == 0).all()),
    }


# The keywords torch's varlen_attn gained after 2.11: what our drop-in does with each.
LATER_KEYWORDS = ("enable_gqa", "seqused_k", "block_table", "num_splits")


@functools.cache
def swap_in_keywords() -> dict[str, str]:
    """What `varlen_workbench.kernels.varlen.varlen_attn` does with each keyword of LATER_KEYWORDS, run
    here on a small GQA batch (4 query heads on 2 key/value heads): 'runs, matches K/V repeated per
    query head' (enable_gqa=True), or the exception it raises, as 'ValueError: <its message up to the first ;>'."""
    from varlen_workbench.kernels.varlen import varlen_attn

    case = Case((5, 3), heads=4, kv_heads=2, head_dim=16, dtype="float16", seed=0)
    b = pack(case, "cpu", requires_grad=False)
    args = (b.q, b.k, b.v, b.cu_seqlens_q, b.cu_seqlens_k, b.max_seqlen_q, b.max_seqlen_k)
    given = {
        "enable_gqa": True,
        "seqused_k": b.cu_seqlens_k.diff(),
        "block_table": torch.zeros(2, 1, dtype=torch.int32),
        "num_splits": 1,
    }
    found = {}
    for name in LATER_KEYWORDS:
        try:
            out = varlen_attn(*args, **{name: given[name]})
        except Exception as exc:  # the behaviour asked about: which exception, saying what
            found[name] = f"{type(exc).__name__}: {str(exc).split(';')[0]}"
            continue
        repeated = varlen_attn(b.q, *(t.repeat_interleave(2, dim=1) for t in (b.k, b.v)), *args[3:])
        same = isinstance(out, torch.Tensor) and torch.allclose(out.float(), repeated.float(), atol=1e-3)
        found[name] = "runs, matches K/V repeated per query head" if same else "runs, differs from K/V repeated per query head"
    return found
