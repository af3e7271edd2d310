"""Post-mortem torch-varlen-176793: torch `varlen_attn` and rows beyond `cu_seqlens[-1]`.

The bug: `varlen_attn` (FlashAttention-2 underneath) allocates its output and gradients with
`empty_like` and writes only rows covered by `cu_seqlens`; TAIL rows (a padded token budget,
legal memory) return whatever the allocator left. We study it through a Triton replica of that
mechanism (`kernels.replicas.torch_varlen`) on any machine, and through torch's own
`varlen_attn` on a GPU: `gpu_probes(device)` is what `workbench repro torch-varlen-176793
--device cuda --record data/gpu/torch-varlen-176793-h200.json` adds to the record.

`reproduce()` returns `Results`; `claims` checks them. The notebook shows only what is here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kernels import INTERPRETED, default_device, varlen_attention
from kernels.contract import check_varlen_tensors
from kernels.replicas.torch_varlen import replica_varlen_attn, stale_memory
from workbench import Case, Fill, Region, cumulative, pack, poisoned_memory, probe, reference_attention
from workbench.audit import adapt
from workbench.health import GradientHealth
from workbench.nantrace import trace_nans
from workbench.postmortem import (
    OURS,
    REPLICA,
    TOY,
    UPSTREAM_GPU,
    Claims,
    Link,
    Meta,
    Results,
    latest_gpu_record,
    source_at,
    table,
)
from workbench.sweep import SweepResult, sweep
from workbench.timing import time_call
from workbench.tinylm import LMConfig, SyntheticTask, TinyLM, train

META = Meta(
    id="torch-varlen-176793",
    title="torch varlen_attn leaves rows beyond cu_seqlens[-1] unwritten in its output and gradients",
    component="PyTorch / torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen)",
    category="training bug",
    impact="q/k/v longer than cu_seqlens[-1] (a padded token budget): garbage or NaN in the padding rows' gradients "
    "reaches the QKV weight gradient, silently when finite",
    upstream_status="open",
    status_note="issue open; the ValueError PRs #186786 and #188933 were closed without merging",
    our_verdict="mechanism confirmed on an H200 and in a replica; the report's 'forward is fine' holds only for rows "
    "the loss reads, and its proposed ValueError forbids a legal layout",
    detection="garbage or NaN in rows >= cu_seqlens[-1] of the output and of dq/dk/dv; wrong or NaN QKV weight gradients",
    fix_type="workarounds today: a dummy last sequence, slicing, or zeroing the rows on the device; "
    "ours: a kernel that writes 0 there",
    tags=("varlen", "padding", "uninitialised memory", "backward"),
    # The issue's own opening date, as recorded by NeuralDBG's tracking file for it (BUG-002):
    # "OPEN, since 2026-03-07"; flash-attention#2324 (same mechanism, by varlen_attn's author) follows on 03-10.
    reported="2026-03-07",
    published="2026-11-29",
    revised="2026-12-01",
    links=(
        Link("pytorch#176793", "https://github.com/pytorch/pytorch/issues/176793", "2026-03-07", "issue", "open"),
        Link(
            "flash-attention#2324: opt-in autograd function that zeroes the padding's gradient",
            "https://github.com/Dao-AILab/flash-attention/pull/2324",
            "2026-03-10",
            "PR",
            "closed, not merged",
        ),
        Link(
            "flash-linear-attention#892: zero-initialised gradient buffers, same root cause",
            "https://github.com/fla-org/flash-linear-attention/pull/892",
            "2026-05-12",
            "PR",
            "closed, not merged",
        ),
        Link(
            "pytorch#186786: raise ValueError if query.size(0) > cu_seq_q[-1]",
            "https://github.com/pytorch/pytorch/pull/186786",
            "2026-06-09",
            "PR",
            "closed, not merged",
        ),
        Link(
            "tilelang#2461: zero lse/Delta padding in its varlen backward example",
            "https://github.com/tile-ai/tilelang/pull/2461",
            "2026-06-26",
            "PR",
            "merged",
        ),
        Link(
            "pytorch#188933: the same ValueError, resubmitted",
            "https://github.com/pytorch/pytorch/pull/188933",
            "2026-07-03",
            "PR",
            "closed, not merged",
        ),
        Link("varlen_attn API (pytorch#164502)", "https://github.com/pytorch/pytorch/pull/164502"),
        Link(
            "flash-attention#1228: the same question for flash_attn_varlen_func",
            "https://github.com/Dao-AILab/flash-attention/issues/1228",
        ),
    ),
    seed="000_1019a3997e440af2.txt",
)

# The upstream source we read, at the commit we read it.
VARLEN_PY = source_at("pytorch/pytorch@255ac567c50191b57bf8674134ba731c0b64e3ef")  # torch/nn/attention/varlen.py

SEED_SEQLENS = (144, 288, 512)  # cu_seqlens [0, 144, 432, 944]: the seed's and both PRs' layout
CPU_SCALE = 8  # the Triton interpreter studies the seed's layout 8x smaller: (18, 36, 64)

# Inputs' padding rows hold zeros: every NaN the replica returns comes from memory, not data.
STUDY = Case(
    seqlens_q=tuple(n // CPU_SCALE for n in SEED_SEQLENS),
    tail_q=2,
    tail_k=2,
    heads=2,
    head_dim=32,
    dtype="float16",
    fill=Fill.ZEROS,
    seed=176793,
)
# The NaN map's grid, kept small for the interpreter: trailing rows (q and k alike) on its x axis
# (2: the seed's, 64: a whole block of the replica), sequence lengths on y.
PADS = (0, 2, 64)
LAYOUTS = ((17,), STUDY.seqlens_q, (40, 5))

# On a GPU, the seed's layout itself, with varlen_attn's usual shapes and dtype.
GPU_PADS = (0, 2, 64, 512)
GPU_CASE = Case(seqlens_q=SEED_SEQLENS, heads=16, head_dim=64, dtype="bfloat16", fill=Fill.ZEROS, seed=176793)
GPU_PREFILL_MB = 256  # NaN blocks left in the CUDA caching allocator before poisoned runs
GPU_TRAILING = 64  # trailing rows of the GPU workaround and damage probes
# Workaround timing at a training-sized batch too (the seed's 944 tokens are launch-bound):
# 8 documents of 2048 tokens, the benchmark's "8x2048 d64" workload, plus 64 trailing rows.
GPU_TIMING_CASE = Case(seqlens_q=(2048,) * 8, tail_q=64, tail_k=64, heads=16, head_dim=64, dtype="bfloat16", fill=Fill.ZEROS)
CASES = tuple(STUDY.with_(seqlens_q=layout, tail_q=pad, tail_k=pad) for layout in LAYOUTS for pad in PADS) + tuple(
    GPU_CASE.with_(tail_q=pad, tail_k=pad) for pad in GPU_PADS
)
GRADS = ("dq", "dk", "dv")


def torch_style(varlen_fn: Callable, name: str) -> Callable:
    """A torch-style varlen function (the replica, torch's own, a workaround) behind the
    contract's signature, through the workbench's "torch-varlen" adapter."""
    return dataclasses.replace(adapt(varlen_fn, "torch-varlen"), name=name)


replica = torch_style(replica_varlen_attn, "replica")
IMPLS: dict[str, Callable] = {"replica": replica, "fixed": varlen_attention, "oracle": reference_attention}


# -- the upstream function -------------------------------------------------------------------------


def _varlen_attn() -> Callable:
    """torch's own function (2.10+), imported only when used."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def upstream() -> Callable:
    """torch's own `varlen_attn` behind the contract's signature (either release's signature)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "torch.nn.attention.varlen.varlen_attn runs on CUDA only (FlashAttention-2, fp16/bf16, "
            "Ampere or newer); on this machine study the replica, and read the recorded GPU runs "
            "with gpu_record()."
        )
    return torch_style(_varlen_attn(), "varlen_attn")


def upstream_signature() -> str:
    return f"varlen_attn{inspect.signature(_varlen_attn())}"


# -- the seed's reproduction, and a correct one ------------------------------------------------------


def seed_inputs(device: str | torch.device = "meta") -> dict[str, Any]:
    """The seed's (and PR #188933's) inputs, verbatim; on the meta device nothing is computed."""
    cu_seqlens = torch.tensor([0, 144, 432, 944], dtype=torch.int32, device=device)
    x = torch.randn(944 + 2, 1024, device=device, requires_grad=True)
    q, k, v = x.chunk(3, dim=-1)
    return {"x": x, "q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens}


def seed_input_problems() -> dict[str, Any]:
    """What is wrong with the seed's inputs before any kernel runs: shapes, widths, dtype."""
    t = seed_inputs()
    try:
        check_varlen_tensors(t["q"], t["k"], t["v"])
        contract_error = None
    except (TypeError, ValueError) as exc:
        contract_error = f"{type(exc).__name__}: {exc}"
    return {
        "shapes": {n: tuple(t[n].shape) for n in "qkv"},
        "dims": {n: t[n].dim() for n in "qkv"},
        "dtype": str(t["q"].dtype),
        "contract_error": contract_error,
    }


def _first_line(exc: BaseException) -> str:
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:240]}"


def seed_repro_on_cuda() -> dict[str, Any]:
    """Runs the seed's code verbatim with torch's `varlen_attn` (CUDA only) and reports its fate."""
    t = seed_inputs("cuda")
    try:
        loss = _varlen_attn()(t["q"], t["k"], t["v"], t["cu_seqlens"], t["cu_seqlens"], 512, 512).sum()
        loss.backward()
        return {"raised": None, "loss": float(loss)}
    except Exception as exc:  # the point of this run is to record which error, if any
        return {"raised": _first_line(exc)}


def corrected_repro(
    varlen_fn: Callable,
    *,
    trailing: int = 2,
    seqlens: tuple[int, ...] = SEED_SEQLENS,
    heads: int = 16,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """The seed's experiment with valid inputs, for any torch-style `varlen_fn`.

    A fused QKV activation `x` of (T + trailing, 3*H*D) is viewed as (T, 3, H, D) and split into
    q, k, v of (T, H, D); `cu_seqlens` covers T rows, so `trailing` rows are TAIL. The loss is
    the seed's `out.sum()` over every row, TAIL rows included.
    """
    device = torch.device(device) if device is not None else default_device()
    cu = cumulative(seqlens, device)
    rows = sum(seqlens) + trailing
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3 * heads * head_dim, generator=generator).to(dtype).to(device).requires_grad_()
    q, k, v = x.view(rows, 3, heads, head_dim).unbind(1)
    out = varlen_fn(q, k, v, cu, cu, max(seqlens), max(seqlens))
    loss = out.float().sum()
    loss.backward()
    real = sum(seqlens)
    return {
        "shapes": {"x": tuple(x.shape), "q": tuple(q.shape)},
        "loss": float(loss.detach()),
        "out_real_nonfinite": int((~torch.isfinite(out[:real])).sum()),
        "out_tail_nonfinite": int((~torch.isfinite(out[real:])).sum()),
        "grad_real_nonfinite": int((~torch.isfinite(x.grad[:real])).sum()),
        "grad_tail_nonfinite": int((~torch.isfinite(x.grad[real:])).sum()),
    }


# -- check your run ----------------------------------------------------------------------------------


def tail_rows_report(out: torch.Tensor, grads: dict[str, torch.Tensor], cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor):
    """What a user's check prints: per tensor, rows >= cu_seqlens[-1], non-finite and max |x|.

    The reader's check (`torch.utils.deterministic.fill_uninitialized_memory`) makes unwritten
    rows NaN; any row here that is not exactly 0 or a value your own code put there is a hit.
    """
    rows = {"out": (out, cu_seq_q), "dq": (grads["dq"], cu_seq_q), "dk": (grads["dk"], cu_seq_k), "dv": (grads["dv"], cu_seq_k)}
    body = []
    for name, (t, cu) in rows.items():
        tail = t.detach()[int(cu[-1]) :].float()
        finite = tail[torch.isfinite(tail)]
        body.append(
            (name, tail.shape[0], int((~torch.isfinite(tail)).sum()), float(finite.abs().max()) if finite.numel() else 0.0)
        )
    return table(("tensor", "rows >= cu_seqlens[-1]", "non-finite", "max |finite|"), body)


# -- workarounds with upstream torch today ----------------------------------------------------------


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


def _zero_rows_from(x: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(x.shape[0], device=x.device) >= end
    return torch.where(rows.view(-1, *([1] * (x.dim() - 1))), torch.zeros((), dtype=x.dtype, device=x.device), x)


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
    return varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal, validate=False)


def workarounds(varlen_fn: Callable) -> dict[str, Callable]:
    """The ways to call torch-style `varlen_fn` today, in the order the page presents them."""
    return {
        "as is": varlen_fn,
        "(a) dummy last sequence": as_dummy_sequence(varlen_fn),
        "(b) slice to cu_seqlens[-1]": as_sliced(varlen_fn),
        "(c) zero TAIL rows on device": as_tail_zeroed(varlen_fn),
        "(d) our fixed kernel": fixed_torch_style,
    }


def _masked_grad_out(batch) -> torch.Tensor:
    """dO of the probe's seed with TAIL rows 0: what a loss that ignores padding rows sends back."""
    from workbench.probe import grad_output

    d_out = grad_output(batch).clone()
    d_out[batch.regions_q != Region.REAL] = 0
    return d_out


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


def workaround_table(points: list[dict[str, Any]]):
    def verdict(p):
        if "error" in p:
            return p["error"][:70]
        if p["tail_nonfinite"]:
            return f"{p['tail_nonfinite']} non-finite"
        return "exactly 0" if p["tail_zero"] else f"finite, max |x| {p['tail_max_abs']:.3g}"

    rows = [
        (p["workaround"], p["loss"], verdict(p), "" if "error" in p else ("yes" if p["real_within_bound"] else "NO"))
        for p in points
    ]
    return table(("workaround", "loss reads", "TAIL rows of out, dq, dk, dv", "REAL rows within bound"), rows)


# -- the proposed ValueError, capture, and the sweep ---------------------------------------------------


# -- fix (a): the proposed ValueError ----------------------------------------------------------


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


def _outcome(run: Callable[[], Any]) -> dict[str, Any]:
    """{"ok": True, "error": None} or {"ok": False, "error": "<type>: <first line>"}: what a user sees."""
    try:
        run()
        return {"ok": True, "error": None}
    except Exception as exc:  # recorded, not hidden: the error is the result
        return {"ok": False, "error": _first_line(exc)}


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


def _max_abs(x: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return float("nan") if bool(torch.isnan(x).any()) else float(x.abs().max())


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


# -- the study: sweep, NaN map, explorer -----------------------------------------------------


def probe_point(case: Case, impl: str, device: str | torch.device | None = None) -> dict[str, Any]:
    """One sweep point: `impl` on `case` (TAIL rows on q and k alike) under poisoned memory.

    Returns the probe's summary plus the record itself (for token-norm plots and the explorer).
    """
    case = case.with_(tail_k=case.tail_q)
    record = probe(IMPLS[impl], pack(case, device), name=impl, poisoned=True)
    return {**record.summary(), "record": record}


def run_sweep(device: str | torch.device | None = None, progress: bool = False) -> SweepResult:
    """LAYOUTS x PADS x (replica, fixed, oracle): the NaN map's grid, STUDY among its points."""
    return sweep(
        functools.partial(probe_point, device=device),
        base=STUDY,
        progress=progress,
        desc="NaN map",
        seqlens_q=list(LAYOUTS),
        tail_q=list(PADS),
        impl=list(IMPLS),
    )


def record_at(result: SweepResult, impl: str, seqlens_q: tuple[int, ...] = STUDY.seqlens_q, tail_q: int = STUDY.tail_q):
    """The ProbeRecord of one sweep point (default: the STUDY case)."""
    (point,) = result.where(impl=impl, seqlens_q=tuple(seqlens_q), tail_q=tail_q)
    if not point["ok"]:
        raise RuntimeError(f"sweep point {impl} {seqlens_q} tail {tail_q} failed: {point['error_type']}: {point['error']}")
    return point["record"]


def nan_map(result: SweepResult):
    """Non-finite elements in out, dq, dk, dv over trailing pad x sequence lengths, per implementation."""
    from workbench.plots import plot_nan_map

    return plot_nan_map(result, rows="seqlens_q", cols="tail_q", facet="impl", title="non-finite elements, poisoned memory")


# -- the commonest damage: finite garbage in the QKV weight gradient --------------------------------


@contextlib.contextmanager
def _stale_cuda_blocks(like: torch.Tensor, count: int = 8, scale: float = 1.0) -> Iterator[None]:
    """Leaves `count` freed blocks shaped like `like`, holding finite values, in the CUDA caching
    allocator: the stale activations a training step leaves behind for the next `empty_like`.
    The cache is emptied first, so that blocks of earlier (poisoned) runs are not handed out."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    generator = torch.Generator(device=like.device).manual_seed(0)
    blocks = [torch.randn(like.shape, generator=generator, device=like.device, dtype=like.dtype) * scale for _ in range(count)]
    del blocks
    yield


def _allocator(garbage: str, like: torch.Tensor, seed: int):
    """The memory state `qkv_damage` runs under: "stale" finite values (the replica's
    `stale_memory()`, and on CUDA freed finite blocks for upstream's own allocations), or
    "as left": whatever the allocator hands back (on CUDA after emptying its cache, so that
    NaN blocks of earlier poisoned runs in this process are not what is measured)."""
    stack = contextlib.ExitStack()
    if garbage == "stale":
        stack.enter_context(stale_memory(scale=1.0, seed=seed))
        if like.is_cuda:
            stack.enter_context(_stale_cuda_blocks(like))
    elif garbage == "as left":
        if like.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    else:
        raise ValueError(f"qkv_damage(garbage={garbage!r}): give 'stale' or 'as left'.")
    return stack


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


# -- why it matters in training -------------------------------------------------------------------

# Three sequences packed back to back in a buffer with trailing rows: a static token budget.
TRAIN_SEQLENS = ((12, 7, 10), (9, 14, 6))
TRAIN_CONFIG = LMConfig(vocab=24, dim=32, heads=2, layers=1, seed=0)
# The gradient-norm explorer: trailing rows of the token budget (the first value is what the
# explorer opens on: one that shows the bug), steps trained per run.
NORM_PADS = (16, 0, 3, 48)
NORM_STEPS = 6


def token_budget_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, **padded_layout):
    """The replica as a varlen_attn user with a padded token budget calls it: real boundaries
    only. TinyLM describes the rows after the last real token as padding of the last sequence
    (`cu_seqlens_*_padded`); a torch-style call sees them as rows beyond cu_seqlens[-1]."""
    return replica_varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=causal)


TRAIN_ATTENTION = {"replica": token_budget_attention, "fixed": varlen_attention}


def budget_batches(pad: int, steps: int, seed: int = 0):
    """`steps` training batches (TRAIN_SEQLENS in turn) with `pad` trailing rows, and an eval batch."""
    task = SyntheticTask(vocab=TRAIN_CONFIG.vocab, seed=seed)

    def batch(seqlens):
        return task.batch(seqlens, tail_align=sum(seqlens) + pad) if pad else task.batch(seqlens)

    return [batch(TRAIN_SEQLENS[i % len(TRAIN_SEQLENS)]) for i in range(steps)], batch((11, 16))


@dataclass
class TrainingStudy:
    runs: dict[str, Any]  # impl -> tinylm.TrainingRun (losses per step)
    monitors: dict[str, GradientHealth]  # impl -> the gradient health monitor of that run
    culprit: Any  # nantrace.Culprit of the replica's first step (None if nothing went non-finite)


def training(steps: int = 2) -> TrainingStudy:
    """The tiny packed LM trained with the replica and with the fixed kernel, memory poisoned
    (NaN). CPU only: `workbench.tinylm` builds its model and batches on the CPU."""
    batches, eval_batch = budget_batches(pad=3, steps=steps)
    runs, monitors = {}, {}
    with poisoned_memory():
        for name in ("replica", "fixed"):
            runs[name], monitors[name] = train(
                name, batches, eval_batch, config=TRAIN_CONFIG, attention=TRAIN_ATTENTION[name], monitor_factory=GradientHealth
            )
            monitors[name].close()
        model = TinyLM(TRAIN_CONFIG, TRAIN_ATTENTION["replica"])
        with trace_nans(model) as trace:
            model.loss(batches[0]).backward()
    return TrainingStudy(runs, monitors, trace.culprit)


def gradient_norms(pads: tuple[int, ...] = NORM_PADS, steps: int = NORM_STEPS) -> dict[int, dict[str, GradientHealth]]:
    """Per trailing pad, the gradient health monitors of the tiny LM trained with the replica
    and with the fixed kernel on the same batches, the replica's unwritten rows holding finite
    stale values (`stale_memory()`): nothing turns NaN, the norms just grow. CPU only."""
    studies = {}
    for pad in pads:
        batches, eval_batch = budget_batches(pad, steps)
        monitors = {}
        for label, name in (("varlen_attn replica", "replica"), ("fixed kernel", "fixed")):
            with stale_memory(scale=1.0, seed=pad):
                _, monitors[label] = train(
                    name,
                    batches,
                    eval_batch,
                    config=TRAIN_CONFIG,
                    attention=TRAIN_ATTENTION[name],
                    monitor_factory=GradientHealth,
                )
            monitors[label].close()
        studies[pad] = monitors
    return studies


QKV = "blocks.0.qkv.weight"


def norm_inflation(monitors: dict[str, GradientHealth], param: str = QKV) -> float:
    """Largest ratio, over steps, of the replica's gradient norm of `param` to the fixed kernel's."""
    buggy, fixed = monitors["varlen_attn replica"].norms(param), monitors["fixed kernel"].norms(param)
    return max(b / f for b, f in zip(buggy, fixed))


NORM_PARAMS = ("blocks.0.qkv.weight", "blocks.0.proj.weight", "blocks.0.mlp.0.weight", "embed.weight")


def gradient_norm_explorer(studies: dict[int, dict[str, GradientHealth]]):
    """A slider over trailing rows: per-parameter gradient norms over training, replica beside fixed."""
    from workbench.explorer import explore
    from workbench.plots import plot_health

    def frame(trailing_rows: int):
        title = f"{trailing_rows} trailing rows, stale finite memory"
        return plot_health(studies[trailing_rows], params=list(NORM_PARAMS), title=title)

    return explore(frame, trailing_rows=sorted(studies))  # slider values in order


# -- reproduce -------------------------------------------------------------------------------------


@dataclass
class TorchVarlenResults(Results):
    seed: dict[str, Any]  # seed_input_problems()
    corrected: dict[str, dict[str, Any]]  # corrected_repro with the replica: "poisoned" and "stale"
    sweep: SweepResult  # run_sweep()
    workarounds: list[dict[str, Any]]  # workaround_checks(replica) on STUDY, poisoned
    damage: dict[str, Any]  # qkv_damage(replica), stale finite memory
    check: CheckAssessment
    training: TrainingStudy | None  # None where the Triton kernels are compiled (a GPU machine)
    norms: dict[int, dict[str, GradientHealth]] | None  # gradient_norms(); None on a GPU machine
    gpu: dict[str, Any] | None  # latest_gpu_record(META, "points"): torch's own varlen_attn on a GPU
    gpu_damage: dict[str, Any] | None = None  # latest_gpu_record(META, "damage"): the QKV damage and workaround timings

    def at(self, impl: str, seqlens_q: tuple[int, ...] = STUDY.seqlens_q, tail_q: int = STUDY.tail_q):
        return record_at(self.sweep, impl, seqlens_q, tail_q)

    def summary(self) -> dict[str, Any]:
        """What a record keeps: counts and verdicts, not monitors or tensors."""
        return {
            "seed": self.seed,
            "corrected": self.corrected,
            "sweep": [{k: v for k, v in p.items() if k != "record"} for p in self.sweep],
            "workarounds": self.workarounds,
            "damage": self.damage,
            "check": dataclasses.asdict(self.check),
        }


def reproduce(device: str | torch.device | None = None) -> TorchVarlenResults:
    small = dict(seqlens=STUDY.seqlens_q, heads=STUDY.heads, head_dim=STUDY.head_dim, dtype=STUDY.torch_dtype, device=device)
    corrected = {}
    with poisoned_memory():
        corrected["poisoned"] = corrected_repro(replica_varlen_attn, **small)
    with stale_memory():
        corrected["stale"] = corrected_repro(replica_varlen_attn, **small)
    return TorchVarlenResults(
        seed=seed_input_problems(),
        corrected=corrected,
        sweep=run_sweep(device),
        workarounds=workaround_checks(replica_varlen_attn, STUDY, device),
        damage=qkv_damage(replica_varlen_attn, device=device),
        check=assess_proposed_check(device),
        training=training() if INTERPRETED else None,
        norms=gradient_norms() if INTERPRETED else None,
        gpu=latest_gpu_record(META, "points"),
        gpu_damage=latest_gpu_record(META, "damage"),
    )


# -- tables ----------------------------------------------------------------------------------------


def capture_table(compile_: dict[str, dict[str, Any]], graphs: dict[str, dict[str, Any]] | None = None):
    """torch.compile(fullgraph=True) (and, from a GPU record, CUDA-graph capture) per subject."""

    def outcome(o: dict[str, Any] | None, ok: str) -> str:
        if o is None:
            return "not run"
        return ok if o["ok"] else o["error"].split(":")[0]

    rows = [(name, outcome(o, "compiles"), outcome((graphs or {}).get(name), "captured")) for name, o in compile_.items()]
    return table(("subject", "torch.compile(fullgraph=True)", "CUDA graph capture"), rows)


def fixed_kernel_speed():
    """Our fixed kernel's forward+backward time beside torch varlen_attn's, per workload of the
    committed H200 benchmark (data/gpu/bench-*.json): speed-up > 1 means ours is faster."""
    from workbench.records import load_records

    rows = []
    for record in load_records("bench-*.json", how="python -m workbench.bench --record data/gpu/bench-h200.json"):
        by = {(r["workload"], r["impl"]): r for r in record["rows"]}
        for (workload, impl), r in by.items():
            theirs = by.get((workload, "torch varlen_attn"))
            if impl == "ours" and theirs and not r["error"] and not theirs["error"]:
                speedup = theirs["forward_backward_ms"] / r["forward_backward_ms"]
                rows.append((workload, theirs["forward_backward_ms"], r["forward_backward_ms"], speedup))
        device = record["provenance"].get("device", "?")
    return table(("workload", "varlen_attn fwd+bwd ms", "fixed kernel fwd+bwd ms", "speed-up"), rows, title=f"on {device}")


def gpu_points_table(record: dict[str, Any]):
    """One row per (memory, pad, impl) of a GPU record: non-finite counts and peak |x| in TAIL
    rows of out/dq/dk/dv, REAL rows against the fp64 oracle, and the REAL-row gap to our kernel."""
    points = record["probes"]["points"]
    agreement = {
        (p["pad"], p["poisoned"], p["impl"].split(" vs ")[0]): p["real_max_abs_diff"] for p in points if " vs " in p["impl"]
    }
    rows = []
    for p in points:
        if " vs " in p["impl"]:
            continue
        memory = "poisoned" if p["poisoned"] else "as left"
        if "error" in p:
            rows.append((memory, p["pad"], p["impl"], p["error"][:60], "", "", ""))
            continue
        counts = "/".join(str(p["nonfinite"][t]["TAIL"]) for t in ("out",) + GRADS)
        peak = max((p["max_abs"][t]["TAIL"] for t in p["max_abs"]), key=lambda x: math.inf if x != x else x)
        diff = agreement.get((p["pad"], p["poisoned"], p["impl"]))
        gap = "" if diff is None else max(diff.values(), key=lambda x: math.inf if x != x else x)
        rows.append((memory, p["pad"], p["impl"], counts, peak, "within" if p["real_within_bound"] else "OUTSIDE", gap))
    return table(
        ("memory", "trailing rows", "impl", "TAIL non-finite out/dq/dk/dv", "TAIL max |x|", "REAL vs fp64", "REAL vs fixed"),
        rows,
        fold=10,
    )


def workaround_evidence(results: TorchVarlenResults, prefix: str):
    """One workaround (name starting with `prefix`): the replica on this machine, and torch's
    varlen_attn from the GPU record when there is one, with its time relative to varlen_attn as is."""

    def tail(p):
        if "error" in p:
            return p["error"][:60]
        if p["tail_nonfinite"]:
            return f"{p['tail_nonfinite']} non-finite"
        return "exactly 0" if p["tail_zero"] else f"finite, max |x| {p['tail_max_abs']:.3g}"

    sources = [("replica (CPU, interpreter)", results.workarounds, {}, {})]
    if results.gpu:
        probes = results.gpu["probes"]
        timed = (results.gpu_damage or results.gpu)["probes"]
        small = {t["workaround"]: t for t in timed["timing"]}
        large = {t["workaround"]: t for t in timed.get("timing_large", [])}
        sources.append((f"varlen_attn ({results.gpu['provenance'].get('device', 'GPU')})", probes["workarounds"], small, large))

    def ratio(timing: dict[str, Any], name: str) -> str:
        if not timing:
            return "not timed"
        t = timing.get(name, {})
        return f"{t['vs_as_is']:.2f}x" if "vs_as_is" in t else t.get("error", "missing")[:40]

    rows = []
    for where, points, small, large in sources:
        for p in points:
            if p["workaround"].startswith(prefix):
                within = "" if "error" in p else ("yes" if p["real_within_bound"] else "NO")
                name = p["workaround"]
                rows.append((where, p["loss"], tail(p), within, ratio(small, name), ratio(large, name)))
    header = ("run", "loss reads", "TAIL rows of out, dq, dk, dv (poisoned)", "REAL rows within bound")
    return table(header + ("time vs as is, 944 tokens", "time vs as is, 8x2048 tokens"), rows)


def gpu_workaround_table(record: dict[str, Any]):
    """The workarounds on torch's varlen_attn (GPU): correctness under poisoning and time."""
    probes = record["probes"]
    timing = {t["workaround"]: t for t in probes["timing"]}
    rows = []
    for p in probes["workarounds"]:
        if p["loss"] != "loss mask":
            continue
        t = timing.get(p["workaround"], {})
        rows.append(
            (
                p["workaround"],
                p.get("error", "exactly 0" if p.get("tail_zero") else f"{p.get('tail_nonfinite')} non-finite")[:60],
                "yes" if p.get("real_within_bound") else "no",
                t.get("ms", math.nan),
                t.get("vs_as_is", math.nan),
            )
        )
    return table(("workaround (loss mask)", "TAIL rows, poisoned", "REAL within bound", "fwd+bwd ms", "time / as is"), rows)


# -- on a GPU: torch's own varlen_attn --------------------------------------------------------------


def _probe_data(record) -> dict[str, Any]:
    """What a recorded GPU point keeps of a ProbeRecord: counts, peaks, errors (no tensors)."""
    return {
        "nonfinite": record.nonfinite,
        "max_abs": record.max_abs,
        "errors": {
            n: {"error": e.error, "bound": e.bound, "within": e.within, "ratio": e.ratio} for n, e in record.errors.items()
        },
        "real_within_bound": record.real_within_bound,
        "padding_exactly_zero": record.padding_exactly_zero,
        "forward_s": record.forward_s,
        "backward_s": record.backward_s,
    }


def _real_agreement(a, b) -> dict[str, float]:
    """Max |a - b| on REAL rows of each tensor of two ProbeRecords of the same batch."""
    out = {}
    for name in a.tensors:
        real = a.regions(name) == Region.REAL
        out[name] = _max_abs(a.tensors[name][real].double() - b.tensors[name][real].double())
    return out


def _error_text() -> str:
    return traceback.format_exc(limit=2).strip().splitlines()[-1][:400]


def _memory(poisoned: bool, prefill_mb: int):
    return poisoned_memory(cuda_prefill_mb=prefill_mb) if poisoned else contextlib.nullcontext()


def probe_points(
    impls: dict[str, Callable], case: Case, pads: tuple[int, ...], *, device, prefill_mb: int = 0
) -> Iterator[dict[str, Any]]:
    """Yields one JSON-ready point per (poisoned, pad, impl), then each impl's REAL-row agreement
    with "fixed". Unpoisoned points come first: poisoning leaves NaN in the allocator's cache.
    A point that raises is yielded with its error: the run goes on.
    """
    for poisoned in (False, True):
        for pad in pads:
            batch = pack(case.with_(tail_q=pad, tail_k=pad), device)
            records = {}
            for name, impl in impls.items():
                point = {"impl": name, "pad": pad, "poisoned": poisoned}
                try:
                    with _memory(poisoned, prefill_mb):
                        records[name] = probe(impl, batch, name=name, poisoned=poisoned)
                    point.update(_probe_data(records[name]))
                except Exception:  # recorded per point
                    point["error"] = _error_text()
                yield point
            if "fixed" in records:
                for name in records.keys() - {"fixed"}:
                    yield {
                        "impl": f"{name} vs fixed",
                        "pad": pad,
                        "poisoned": poisoned,
                        "real_max_abs_diff": _real_agreement(records[name], records["fixed"]),
                    }


def time_workarounds(varlen_fn: Callable, case: Case, device=None) -> list[dict[str, Any]]:
    """Forward + backward time per call of each workaround on `case` (loss mask on TAIL rows),
    host syncs included (`workbench.timing.time_call`: median ms, and the minimum), and its
    ratio to `varlen_fn` as is."""
    batch = pack(case, device)
    d_out = _masked_grad_out(batch)
    timings = []
    for name, fn in workarounds(varlen_fn).items():
        q, k, v = (t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v))

        def step(fn=fn, q=q, k=k, v=v):
            out = fn(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k)
            out.backward(d_out)

        try:
            timed = time_call(step, device=batch.device)
            timings.append({"workaround": name, "ms": timed.median_ms, "min_ms": timed.min_ms})
        except Exception as exc:  # recorded: the run goes on
            timings.append({"workaround": name, "error": _first_line(exc)})
    base = timings[0].get("ms")
    for t in timings:
        if "ms" in t and base:
            t["vs_as_is"] = t["ms"] / base
    return timings


def damage_probes(
    varlen_fn: Callable,
    device,
    *,
    case: Case = GPU_CASE,
    trailing: int = GPU_TRAILING,
    timing_case: Case | None = GPU_TIMING_CASE,
) -> dict[str, Any]:
    """The QKV damage with the allocator as left, then with stale finite blocks (run it first in
    a fresh process: poisoned runs leave NaN in the CUDA cache), and each workaround's time."""
    shape = dict(seqlens=case.seqlens_q, heads=case.heads, head_dim=case.head_dim, dtype=case.torch_dtype, device=device)
    data: dict[str, Any] = {
        "damage": {g: qkv_damage(varlen_fn, trailing=trailing, garbage=g, **shape) for g in ("as left", "stale")}
    }
    data["timing"] = time_workarounds(varlen_fn, case.with_(tail_q=trailing, tail_k=trailing), device)
    if timing_case is not None:
        data["timing_large"] = time_workarounds(varlen_fn, timing_case, device)
    return data


def upstream_probes(
    varlen_fn: Callable,
    device,
    *,
    case: Case = GPU_CASE,
    pads: tuple[int, ...] = GPU_PADS,
    trailing: int = GPU_TRAILING,
    prefill_mb: int = GPU_PREFILL_MB,
    timing_case: Case | None = GPU_TIMING_CASE,
    on_gpu: bool = True,
) -> dict[str, Any]:
    """Everything `gpu_probes` measures, for any torch-style `varlen_fn` (tests pass the replica on CPU).

    In order: `damage_probes` (damage before anything is poisoned, and timings), the probe
    points over `pads` (unpoisoned first: poisoning leaves NaN in the allocator's cache), the
    corrected repro, the workarounds under poisoning, and capture.
    """
    shape = dict(seqlens=case.seqlens_q, heads=case.heads, head_dim=case.head_dim, dtype=case.torch_dtype, device=device)
    data: dict[str, Any] = {"signature": f"{getattr(varlen_fn, '__name__', 'fn')}{inspect.signature(varlen_fn)}"}
    data.update(damage_probes(varlen_fn, device, case=case, trailing=trailing, timing_case=timing_case))
    impls = {"varlen_attn": torch_style(varlen_fn, "varlen_attn"), "fixed": varlen_attention, "replica": replica}
    data["points"] = list(probe_points(impls, case, pads, device=device, prefill_mb=prefill_mb))
    data["corrected_repro"] = {}
    for rows in (2, trailing):
        for poisoned in (False, True):
            try:
                with _memory(poisoned, prefill_mb):
                    outcome = corrected_repro(varlen_fn, trailing=rows, **shape)
            except Exception as exc:  # recorded: the run goes on
                outcome = {"error": _first_line(exc)}
            data["corrected_repro"][f"trailing={rows} poisoned={poisoned}"] = outcome
    tail_case = case.with_(tail_q=trailing, tail_k=trailing)
    with _memory(True, prefill_mb):
        data["workarounds"] = workaround_checks(varlen_fn, tail_case, device, poisoned=True)
    batch = pack(case, device)  # no TAIL rows: a layout every subject accepts
    subjects = _subjects(base=varlen_fn, name="varlen_attn")
    data["capture"] = {"compile_fullgraph": {n: compile_fullgraph(fn, batch) for n, fn in subjects.items()}}
    if on_gpu:
        data["capture"]["cuda_graph"] = {n: cuda_graph_capture(fn, batch) for n, fn in subjects.items()}
    return data


def gpu_probes(device) -> dict[str, Any]:
    """The hook `workbench repro torch-varlen-176793 --device cuda --record FILE` calls: torch's
    own varlen_attn on the GPU (the seed's code verbatim, its padding rows with and without
    poisoning, the QKV damage, the workarounds and their cost, compile and CUDA-graph capture)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"gpu_probes(device={device!r}) needs a CUDA device: torch's varlen_attn is CUDA-only.")
    provenance = {"signature": upstream_signature(), "cuda": torch.version.cuda, "capability": torch.cuda.get_device_capability()}
    return {**provenance, "seed_repro": seed_repro_on_cuda(), **upstream_probes(_varlen_attn(), "cuda")}


# -- claims ----------------------------------------------------------------------------------------


def upstream_code(module: str = "torch.nn.attention.varlen") -> str:
    """The executable code of the installed torch's `module`, docstrings stripped."""
    import ast
    import importlib

    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            if isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


claims = Claims()


@claims(
    "upstream source: varlen_attn hands q, k, v at full length to aten._flash_attention_forward/_backward, with no "
    "check of cu_seq_q[-1] and no zeroing of any row (installed torch read too)",
    evidence=VARLEN_PY,
)
def _source(r: TorchVarlenResults):
    code = upstream_code()
    calls = "_flash_attention_forward" in code and "_flash_attention_backward" in code
    guards = [token for token in (".item()", "[-1]", "zero_(", "masked_fill", "torch.where") if token in code]
    return calls and not guards, f"installed torch {torch.__version__}: calls FA2 ops {calls}; guards found: {guards or 'none'}"


@claims(
    "replica, memory poisoned (NaN-filled fresh buffers): the seed's out.sum() is NaN in the forward, only TAIL rows "
    "of out and x.grad are non-finite; the GPU record checks this on varlen_attn itself",
    evidence=REPLICA,
)
def _corrected_poisoned(r: TorchVarlenResults):
    c = r.corrected["poisoned"]
    holds = math.isnan(c["loss"]) and c["out_tail_nonfinite"] > 0 and c["grad_tail_nonfinite"] > 0
    holds = holds and c["out_real_nonfinite"] == 0 and c["grad_real_nonfinite"] == 0
    return holds, f"loss {c['loss']}; non-finite TAIL out {c['out_tail_nonfinite']}, x.grad {c['grad_tail_nonfinite']}; REAL 0"


@claims(
    "replica, stale finite memory instead: the same out.sum() is finite and x.grad has no NaN, so nothing warns "
    "(replica only: what torch's allocator leaves varies)",
    evidence=REPLICA,
)
def _corrected_stale(r: TorchVarlenResults):
    c = r.corrected["stale"]
    nonfinite = c["out_tail_nonfinite"] + c["grad_tail_nonfinite"] + c["out_real_nonfinite"] + c["grad_real_nonfinite"]
    return math.isfinite(c["loss"]) and nonfinite == 0, f"loss {c['loss']:.4g}; non-finite elements {nonfinite}"


@claims(
    "replica, stale finite memory, loss over real rows only: no NaN anywhere, yet the TAIL rows of d(qkv) hold "
    "garbage and the QKV weight gradient is wrong by more than 10%; the GPU record checks varlen_attn itself",
    evidence=REPLICA,
)
def _damage(r: TorchVarlenResults):
    d = r.damage
    holds = d["weight_grad_finite"] and d["dqkv_tail_nonfinite"] == 0 and d["dqkv_tail_max_abs"] > 0
    holds = holds and d["weight_grad_rel_error"] > 0.1 and d["correct_tail_zero"] and math.isfinite(d["loss"])
    return holds, (
        f"weight grad finite {d['weight_grad_finite']}; TAIL d(qkv) max |x| {d['dqkv_tail_max_abs']:.3g}; "
        f"relative error {d['weight_grad_rel_error']:.3g}"
    )


@claims(
    "replica: no TAIL rows, no symptom; every trailing pad > 0 gives non-finite TAIL rows in out, dq, dk, dv", evidence=REPLICA
)
def _replica_map(r: TorchVarlenResults):
    points = [(p["tail_q"], p["record"]) for p in r.sweep.where(impl="replica")]
    clean = sum(rec.nonfinite_in("TAIL") == 0 and rec.real_finite for pad, rec in points if pad == 0)
    broken = sum(
        all(rec.nonfinite[t]["TAIL"] > 0 for t in ("out",) + GRADS) and rec.real_finite for pad, rec in points if pad > 0
    )
    n0 = sum(pad == 0 for pad, _ in points)
    return clean == n0 and broken == len(
        points
    ) - n0, f"pad 0 clean {clean}/{n0}; pad > 0 non-finite TAIL {broken}/{len(points) - n0}"


def _workaround(r_points, name: str, loss: str) -> dict[str, Any]:
    (point,) = [p for p in r_points if p["workaround"] == name and p["loss"] == loss]
    return point


def _zero_and_right(p: dict[str, Any]) -> bool:
    return "error" not in p and p["tail_zero"] and p["real_within_bound"]


@claims(
    "workaround (a) on the replica, poisoned: with a loss mask the dummy sequence's rows get exactly 0 gradients; "
    "without one they get finite non-zero gradients (the padding is trained)",
    evidence=REPLICA,
)
def _dummy(r: TorchVarlenResults):
    masked = _workaround(r.workarounds, "(a) dummy last sequence", "loss mask")
    every = _workaround(r.workarounds, "(a) dummy last sequence", "every row")
    unmasked_ok = "error" not in every and every["tail_nonfinite"] == 0 and not every["tail_zero"] and every["real_within_bound"]
    return _zero_and_right(
        masked
    ) and unmasked_ok, f"loss mask: TAIL 0 {masked.get('tail_zero')}; every row: max |x| {every.get('tail_max_abs')}"


@claims(
    "workarounds (b) slice and (c) device zeroing on the replica, poisoned: TAIL rows of out, dq, dk, dv exactly 0, "
    "REAL rows within bound, whatever the loss reads",
    evidence=REPLICA,
)
def _slice_and_zero(r: TorchVarlenResults):
    names = ("(b) slice to cu_seqlens[-1]", "(c) zero TAIL rows on device")
    good = [p for p in r.workarounds if p["workaround"] in names and _zero_and_right(p)]
    return len(good) == 4, f"{len(good)}/4 (workaround x loss) points exactly 0 and within bound"


@claims(
    "fixed kernel: TAIL rows of out and all gradients exactly zero, REAL rows within the relative bound of the oracle, "
    "at every sweep point",
    evidence=OURS,
)
def _fixed_sweep(r: TorchVarlenResults):
    points = [p["record"] for p in r.sweep.where(impl="fixed")]
    good = sum(rec.padding_exactly_zero and rec.real_within_bound for rec in points)
    return good == len(points) > 0, f"{good}/{len(points)} points (poisoned memory)"


@claims(
    "the proposed ValueError (PRs #186786/#188933), wrapped around the replica, rejects a layout the fixed kernel handles "
    "correctly",
    evidence=REPLICA,
)
def _check_rejects(r: TorchVarlenResults):
    c = r.check
    error = c.rejects_tail["error"] or "nothing"
    fixed = r.at("fixed")
    fixed_ok = fixed.padding_exactly_zero and fixed.real_within_bound
    holds = error.startswith("ValueError") and c.accepts_no_tail["ok"] and fixed_ok
    return holds, f"{STUDY.tail_q} TAIL rows: the check raises {error.split(':')[0]}; fixed kernel exact: {fixed_ok}"


@claims(
    "around the replica, host reads (the check's .item(), the slice's int()) break torch.compile(fullgraph=True); "
    "the dummy sequence, device zeroing and the fixed kernel compile",
    evidence=REPLICA,
)
def _compile(r: TorchVarlenResults):
    c = r.check.compile
    breaks = [n for n in c if n.endswith("proposed check") or "(b) slice" in n]
    holds = all(not c[n]["ok"] for n in breaks) and all(c[n]["ok"] for n in c if n not in breaks) and len(breaks) == 2
    return holds, "; ".join(f"{n}: {'compiles' if o['ok'] else o['error'].split(':')[0]}" for n, o in c.items())


@claims("toy LM, memory poisoned: the replica's loss goes NaN after one step, the fixed kernel's stays finite", evidence=TOY)
def _training_loss(r: TorchVarlenResults):
    if r.training is None:
        return False, "not run: the training study needs the Triton interpreter (CPU)"
    replica_losses, fixed_losses = r.training.runs["replica"].losses, r.training.runs["fixed"].losses
    first_nan = next((i for i, x in enumerate(replica_losses) if not math.isfinite(x)), None)
    holds = first_nan is not None and 0 < first_nan and all(math.isfinite(x) for x in fixed_losses)
    return (
        holds,
        f"replica loss non-finite from step {first_nan}; fixed: {sum(map(math.isfinite, fixed_losses))}/{len(fixed_losses)} finite",
    )


@claims("the health monitor names the first non-finite gradient and the NaN tracer names the replica's forward op", evidence=TOY)
def _training_diagnosis(r: TorchVarlenResults):
    if r.training is None:
        return False, "not run: the training study needs the Triton interpreter (CPU)"
    first = r.training.monitors["replica"].causal_chain().first_parameter
    culprit = r.training.culprit
    names_op = culprit is not None and culprit.phase == "forward" and "torch_varlen_fwd" in culprit.op
    clean = not r.training.monitors["fixed"].causal_chain()
    op = f"{culprit.op} in {culprit.module or '<no module>'}" if culprit else "none"
    return first is not None and names_op and clean, f"first non-finite gradient: {first}; culprit op: {op}"


@claims(
    "toy LM, stale finite memory: with trailing rows the replica's qkv.weight gradient norm exceeds the fixed "
    "kernel's by 2x or more at some step, with no NaN; without trailing rows the two runs agree",
    evidence=TOY,
)
def _norms(r: TorchVarlenResults):
    if r.norms is None:
        return False, "not run: the gradient-norm study needs the Triton interpreter (CPU)"
    ratios = {pad: norm_inflation(m) for pad, m in r.norms.items()}
    finite = all(math.isfinite(x) for m in r.norms.values() for h in m.values() for x in h.norms(QKV))
    holds = finite and all(ratio >= 2 for pad, ratio in ratios.items() if pad > 0) and abs(ratios.get(0, math.nan) - 1) < 0.05
    return holds, "max ratio per trailing rows: " + ", ".join(f"{pad}: {ratio:.3g}" for pad, ratio in ratios.items())


# -- claims read from the GPU record (registered when a record with probes exists) -------------------


def _gpu_points(r: TorchVarlenResults, impl: str, poisoned: bool) -> list[dict[str, Any]]:
    return [p for p in r.gpu["probes"]["points"] if p["impl"] == impl and p["poisoned"] is poisoned]


def register_gpu_claims(target: Claims) -> None:
    """Registers in `target` the claims read from a GPU record's probes (`results.gpu`)."""

    @target("H200: the seed's code verbatim (2-D float32 chunks) stops with an error in varlen_attn", evidence=UPSTREAM_GPU)
    def _gpu_seed(r: TorchVarlenResults):
        raised = r.gpu["probes"]["seed_repro"].get("raised")
        return bool(raised), f"raised: {raised}"

    @target(
        "H200, varlen_attn, memory poisoned: every trailing pad > 0 leaves non-finite TAIL rows in out, dq, dk and dv; "
        "no trailing rows, none; REAL rows within bound of fp64 at every point",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_poisoned(r: TorchVarlenResults):
        points = [p for p in _gpu_points(r, "varlen_attn", True) if "error" not in p]
        broken = [p["pad"] for p in points if p["pad"] > 0 and all(p["nonfinite"][t]["TAIL"] > 0 for t in ("out",) + GRADS)]
        clean = [p["pad"] for p in points if p["pad"] == 0 and sum(p["nonfinite"][t]["TAIL"] for t in p["nonfinite"]) == 0]
        real = all(p["real_within_bound"] for p in points)
        expected = sorted(p for p in GPU_PADS if p > 0)
        holds = sorted(broken) == expected and clean == [0] and real and len(points) == len(GPU_PADS)
        return holds, f"broken at pads {broken}; clean at {clean}; REAL within bound everywhere: {real}"

    @target(
        "H200, varlen_attn: the seed's out.sum() is NaN only when memory is poisoned; as the allocator left it, it "
        "was finite in this run",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_corrected(r: TorchVarlenResults):
        runs = r.gpu["probes"]["corrected_repro"]
        poisoned = [k for k, v in runs.items() if "poisoned=True" in k and math.isnan(v.get("loss", 0.0))]
        as_left = [k for k, v in runs.items() if "poisoned=False" in k and math.isfinite(v.get("loss", math.nan))]
        return len(poisoned) == 2 and len(as_left) == 2, f"NaN when poisoned: {poisoned}; finite as left: {as_left}"

    @target(
        "H200, varlen_attn, fresh process, loss over real rows only: with the allocator as left and with finite blocks "
        "staged, the padding rows of d(qkv) held garbage that included NaN bit patterns, and the QKV weight gradient "
        "was NaN; the sliced (correct) run's padding rows are exactly 0",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_damage(r: TorchVarlenResults):
        runs = r.gpu_damage["probes"]["damage"]
        holds = all(
            not d["weight_grad_finite"] and d["dqkv_tail_nonfinite"] > 0 and d["correct_tail_zero"] for d in runs.values()
        )
        return holds, "; ".join(f"{g}: non-finite TAIL d(qkv) {d['dqkv_tail_nonfinite']}" for g, d in runs.items())

    @target(
        "H200, varlen_attn as left (that point unpoisoned), 64 trailing rows: the padding rows of out, dq, dk, dv held finite, "
        "non-zero garbage and no NaN, the case a NaN check never sees; our kernel's were exactly 0",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_finite_garbage(r: TorchVarlenResults):
        ours = [p for p in _gpu_points(r, "varlen_attn", False) if p["pad"] == GPU_TRAILING and "error" not in p]
        fixed = [p for p in _gpu_points(r, "fixed", False) if p["pad"] == GPU_TRAILING and "error" not in p]
        if len(ours) != 1 or len(fixed) != 1:
            return False, f"the record has no unpoisoned point at {GPU_TRAILING} trailing rows"
        (p,), (f,) = ours, fixed
        nonfinite = sum(p["nonfinite"][t]["TAIL"] for t in p["nonfinite"])
        peak = max(p["max_abs"][t]["TAIL"] for t in p["max_abs"])
        return nonfinite == 0 and peak > 0 and f["padding_exactly_zero"], f"non-finite {nonfinite}; max |x| {peak:.3g}"

    @target(
        "H200 timing, forward+backward with a loss mask: (a) the dummy sequence is the cheapest of the upstream "
        "workarounds at 944 and at 8x2048 tokens; our kernel is slower than varlen_attn as is at 944 tokens and faster "
        "at 8x2048",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_timing(r: TorchVarlenResults):
        probes = r.gpu_damage["probes"]
        ratios = {
            size: {t["workaround"][:3]: t["vs_as_is"] for t in probes[key]}
            for size, key in (("944", "timing"), ("8x2048", "timing_large"))
        }
        cheapest = all(min(("(a)", "(b)", "(c)"), key=v.get) == "(a)" for v in ratios.values())
        ours = ratios["944"]["(d)"] > 1 > ratios["8x2048"]["(d)"]
        return cheapest and ours, "; ".join(
            f"{size}: " + ", ".join(f"{k} {x:.2f}x" for k, x in v.items() if k != "as ") for size, v in ratios.items()
        )

    @target(
        "H200, varlen_attn, poisoned, loss mask: workarounds (a) dummy sequence, (b) slice, (c) device zeroing and "
        "(d) our kernel all leave TAIL rows exactly 0 and REAL rows within bound",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_workarounds(r: TorchVarlenResults):
        points = [p for p in r.gpu["probes"]["workarounds"] if p["loss"] == "loss mask" and p["workaround"] != "as is"]
        good = [p["workaround"] for p in points if _zero_and_right(p)]
        return len(good) == len(points) == 4, f"exact and within bound: {good}"

    @target(
        "H200: CUDA-graph capture works for varlen_attn as is, with (a) the dummy sequence, with (c) device zeroing and "
        "for our kernel; it fails for (b) the slice and for the proposed check (host reads)",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_capture(r: TorchVarlenResults):
        graphs = r.gpu["probes"]["capture"]["cuda_graph"]
        host = {n for n in graphs if n.endswith("proposed check") or "(b) slice" in n}
        holds = (
            len(host) == 2 and all(not graphs[n]["ok"] for n in host) and all(graphs[n]["ok"] for n in graphs if n not in host)
        )
        return holds, "; ".join(f"{n}: {'captured' if o['ok'] else o['error'].split(':')[0]}" for n, o in graphs.items())

    @target(
        "H200: torch.compile(fullgraph=True) captures varlen_attn as is and with workarounds (a), (b) and (c); only "
        "the proposed check's data-dependent branch breaks the graph",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_compile(r: TorchVarlenResults):
        compiled = r.gpu["probes"]["capture"]["compile_fullgraph"]
        broken = [n for n, o in compiled.items() if not o["ok"]]
        return broken == ["varlen_attn + proposed check"], "; ".join(
            f"{n}: {'compiles' if o['ok'] else o['error'].split(':')[0]}" for n, o in compiled.items()
        )


register_gpu_claims(claims)
