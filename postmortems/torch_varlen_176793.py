"""Post-mortem torch-varlen-176793: torch `varlen_attn` and rows beyond `cu_seqlens[-1]`.

The bug: `varlen_attn` (FlashAttention-2 underneath) allocates its output and gradients with
`empty_like` and writes only rows covered by `cu_seqlens`; TAIL rows (a padded token budget,
legal memory) return whatever the allocator left. We study it through a faithful Triton replica
of that mechanism (`kernels.replicas.torch_varlen`) on any machine, and through torch's own
`varlen_attn` on a GPU (recorded runs under data/gpu/, made by `record_gpu_run`).

`reproduce()` returns a `Results`; `claims` checks it. Everything the notebook shows comes from
here, so `workbench repro torch-varlen-176793` reaches the same verdicts without Jupyter.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels import INTERPRETED, default_device, varlen_attention
from kernels.contract import check_varlen_tensors
from kernels.replicas.torch_varlen import replica_varlen_attn
from workbench import Case, Fill, Region, cumulative, pack, poisoned_memory, probe, reference_attention
from workbench.audit import adapt
from workbench.explorer import explore
from workbench.health import GradientHealth
from workbench.nantrace import trace_nans
from workbench.plots import plot_nan_map, plot_token_norms
from workbench.postmortem import Claims, Link, Meta
from workbench.provenance import GPU_DATA, provenance
from workbench.sweep import SweepResult, sweep
from workbench.tinylm import LMConfig, SyntheticTask, TinyLM, train

META = Meta(
    id="torch-varlen-176793",
    title="torch varlen_attn leaves rows beyond cu_seqlens[-1] uninitialised in its output and gradients",
    component="PyTorch / torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen)",
    upstream_status="open",
    status_note="issue open; ValueError PRs #186786 and #188933 closed unmerged; unfixed through 2.14.1",
    detection="NaN or garbage in TAIL rows of the output and of dq/dk/dv; NaN weight gradients in training",
    fix_type="upstream proposal: raise ValueError (host sync); ours: TAIL rows defined as 0 on the device",
    tags=("varlen", "padding", "uninitialised memory", "backward", "torch.compile"),
    # The issue's own date is not in our sources; this is the earliest dated public account of
    # the mechanism (flash-attention#2324, by varlen_attn's author).
    reported="2026-03-10",
    published="2026-11-29",
    links=(
        Link("pytorch#176793", "https://github.com/pytorch/pytorch/issues/176793"),
        Link("PR #186786 (closed)", "https://github.com/pytorch/pytorch/pull/186786"),
        Link("PR #188933 (closed)", "https://github.com/pytorch/pytorch/pull/188933"),
        Link("flash-attention#2324", "https://github.com/Dao-AILab/flash-attention/pull/2324"),
        Link("varlen_attn API (#164502)", "https://github.com/pytorch/pytorch/pull/164502"),
    ),
    seed="000_1019a3997e440af2.txt",
)

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
GPU_PADS = (0, 1, 2, 8, 64, 512)
GPU_CASE = Case(seqlens_q=SEED_SEQLENS, heads=16, head_dim=64, dtype="bfloat16", fill=Fill.ZEROS, seed=176793)
CASES = tuple(STUDY.with_(seqlens_q=layout, tail_q=pad, tail_k=pad) for layout in LAYOUTS for pad in PADS) + tuple(
    GPU_CASE.with_(tail_q=pad, tail_k=pad) for pad in GPU_PADS
)
GPU_PREFILL_MB = 256  # NaN blocks left in the CUDA caching allocator before poisoned runs


def torch_style(varlen_fn: Callable, name: str) -> Callable:
    """A torch-style varlen function (the replica, torch's own) behind the contract's signature,
    through the workbench's "torch-varlen" adapter (either torch release's signature)."""
    return dataclasses.replace(adapt(varlen_fn, "torch-varlen"), name=name)


replica = torch_style(replica_varlen_attn, "replica")
IMPLS: dict[str, Callable] = {"replica": replica, "fixed": varlen_attention, "oracle": reference_attention}


# -- the seed's reproduction, and a correct one ---------------------------------------------


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


def seed_repro_on_cuda() -> dict[str, Any]:
    """Runs the seed's code verbatim with torch's `varlen_attn` (CUDA only) and reports its fate."""
    varlen_attn = _varlen_attn()
    t = seed_inputs("cuda")
    try:
        loss = varlen_attn(t["q"], t["k"], t["v"], t["cu_seqlens"], t["cu_seqlens"], 512, 512).sum()
        loss.backward()
        return {"raised": None, "loss": float(loss), "grad_tail_nonfinite": int((~torch.isfinite(t["x"].grad[944:])).sum())}
    except Exception as exc:  # the point of this run is to record which error, if any
        return {"raised": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


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
    the seed's `out.sum()` over every row.
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


# -- the upstream function, behind the contract ----------------------------------------------


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
            "with gpu_records()."
        )
    return torch_style(_varlen_attn(), "varlen_attn")


def upstream_signature() -> str:
    return f"varlen_attn{inspect.signature(_varlen_attn())}"


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


def fixed_torch_style(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    """Our fixed kernel in varlen_attn's call shape, without host-side validation (no sync)."""
    return varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, validate=False)


def _subjects(on_gpu: bool) -> dict[str, Callable]:
    """torch-style callables whose capture (compile, CUDA graphs) we compare; those with the
    check come last, so that a failed CUDA-graph capture cannot disturb the others."""
    plain = {"replica (as upstream: no check)": replica_varlen_attn, "fixed kernel, validate=False": fixed_torch_style}
    checked = {"replica + proposed check": with_proposed_check(replica_varlen_attn)}
    if on_gpu:
        varlen_attn = _varlen_attn()
        plain["varlen_attn"] = varlen_attn
        checked["varlen_attn + proposed check"] = with_proposed_check(varlen_attn)
    return plain | checked


def _outcome(run: Callable[[], Any]) -> dict[str, Any]:
    """{"ok": True, "error": None} or {"ok": False, "error": "<type>: <first line>"}: what a user sees."""
    try:
        run()
        return {"ok": True, "error": None}
    except Exception as exc:  # recorded, not hidden: the error is the result
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        return {"ok": False, "error": f"{type(exc).__name__}: {first[:240]}"}


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
        compile={name: compile_fullgraph(fn, no_tail) for name, fn in _subjects(on_gpu=False).items()},
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
    return plot_nan_map(result, rows="seqlens_q", cols="tail_q", facet="impl", title="non-finite elements, poisoned memory")


def explorer(result: SweepResult):
    """Sliders over trailing pad and sequence lengths (and the implementation): per-token norms."""

    def frame(tail_q: int, seqlens_q: tuple[int, ...], impl: str):
        return plot_token_norms(record_at(result, impl, seqlens_q, tail_q))

    return explore(frame, tail_q=list(PADS), seqlens_q=list(LAYOUTS), impl=list(IMPLS))


# -- why it matters in training ------------------------------------------------------------------

# Three sequences packed back to back, the buffer rounded up to a multiple of 16 rows: the
# trailing rows are a static token budget, the layout of the seed and of torch.compile users.
TRAIN_SEQLENS = ((12, 7, 10), (9, 14, 6))
TRAIN_CONFIG = LMConfig(vocab=24, dim=32, heads=2, layers=1, seed=0)


def token_budget_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, **padded_layout):
    """The replica as a varlen_attn user with a padded token budget calls it: real boundaries
    only. TinyLM describes the rows after the last real token as padding of the last sequence
    (`tail_align`); a torch-style call sees the same rows as rows beyond cu_seqlens[-1]."""
    return replica_varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=causal)


TRAIN_ATTENTION = {"replica": token_budget_attention, "fixed": varlen_attention}


@dataclass
class TrainingStudy:
    runs: dict[str, Any]  # impl -> tinylm.TrainingRun (losses per step)
    monitors: dict[str, GradientHealth]  # impl -> the gradient health monitor of that run
    culprit: Any  # nantrace.Culprit of the replica's first step (None if nothing went non-finite)
    uninitialised: list  # allocations that returned NaN in that step


def training(steps: int = 2) -> TrainingStudy:
    """The tiny packed LM trained with the replica and with the fixed kernel, memory poisoned.

    CPU only: `workbench.tinylm` builds its model and batches on the CPU, where the Triton
    kernels run through the interpreter.
    """
    task = SyntheticTask(vocab=TRAIN_CONFIG.vocab, seed=0)
    batches = [task.batch(TRAIN_SEQLENS[i % len(TRAIN_SEQLENS)], tail_align=16) for i in range(steps)]
    eval_batch = task.batch((11, 16), tail_align=16)
    runs, monitors = {}, {}
    with poisoned_memory():
        for name in ("replica", "fixed"):
            runs[name], monitors[name] = train(
                name,
                batches,
                eval_batch,
                config=TRAIN_CONFIG,
                attention=TRAIN_ATTENTION[name],
                monitor_factory=GradientHealth,
            )
            monitors[name].close()
        model = TinyLM(TRAIN_CONFIG, TRAIN_ATTENTION["replica"])
        with trace_nans(model) as trace:
            model.loss(batches[0]).backward()
    return TrainingStudy(runs, monitors, trace.culprit, trace.uninitialised)


# -- reproduce --------------------------------------------------------------------------------


@dataclass
class Results:
    seed: dict[str, Any]  # seed_input_problems()
    corrected: dict[str, Any]  # corrected_repro with the replica under poisoning, at CPU scale
    replica_unpoisoned: Any  # ProbeRecord: what the allocator happened to leave
    sweep: SweepResult  # run_sweep()
    check: CheckAssessment
    training: TrainingStudy | None  # None where the Triton kernels are compiled (a GPU machine)

    def at(self, impl: str, seqlens_q: tuple[int, ...] = STUDY.seqlens_q, tail_q: int = STUDY.tail_q):
        return record_at(self.sweep, impl, seqlens_q, tail_q)


def reproduce(device: str | torch.device | None = None) -> Results:
    with poisoned_memory():
        corrected = corrected_repro(
            replica_varlen_attn,
            seqlens=STUDY.seqlens_q,
            heads=STUDY.heads,
            head_dim=STUDY.head_dim,
            dtype=STUDY.torch_dtype,
            device=device,
        )
    return Results(
        seed=seed_input_problems(),
        corrected=corrected,
        replica_unpoisoned=probe(replica, pack(STUDY, device), name="replica"),
        sweep=run_sweep(device),
        check=assess_proposed_check(device),
        training=training() if INTERPRETED else None,
    )


def fixes_table(results: Results, gpu_record: dict[str, Any] | None = None) -> str:
    """The two fixes side by side, every cell read from the results (CUDA graphs from a GPU record)."""
    check, fixed = results.check, results.at("fixed")
    compile_ = check.compile
    graphs = (gpu_record or {}).get("capture", {}).get("cuda_graph", {})

    def outcome(o: dict[str, Any] | None) -> str:
        if o is None:
            return "GPU only: no record yet"
        return "captured" if o["ok"] else o["error"][:60]

    fixed_tail = "TAIL rows exactly 0" if fixed.padding_exactly_zero else "TAIL rows NOT zero"
    fixed_real = "REAL within bound" if fixed.real_within_bound else "REAL OUTSIDE bound"
    rows = [
        ("", "proposed check (PRs #186786/#188933)", "fixed kernel (ours)"),
        (f"{STUDY.tail_q} trailing rows (legal)", (check.rejects_tail["error"] or "passes")[:60], f"{fixed_tail}, {fixed_real}"),
        (
            "no trailing rows",
            "passes" if check.accepts_no_tail["ok"] else check.accepts_no_tail["error"][:60],
            "same kernel, same contract",
        ),
        ("host sync per call", "yes: cu_seq_q[-1].item()", "none with validate=False"),
        (
            "torch.compile(fullgraph=True)",
            "compiles" if compile_["replica + proposed check"]["ok"] else compile_["replica + proposed check"]["error"][:60],
            "compiles"
            if compile_["fixed kernel, validate=False"]["ok"]
            else compile_["fixed kernel, validate=False"]["error"][:60],
        ),
        (
            "CUDA graph capture",
            outcome(graphs.get("varlen_attn + proposed check")),
            outcome(graphs.get("fixed kernel, validate=False")),
        ),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}".rstrip() for r in rows)


# -- claims ---------------------------------------------------------------------------------------

claims = Claims()
GRADS = ("dq", "dk", "dv")


@claims("the seed's repro passes 2-D q, k, v of unequal widths, not varlen_attn's (T, H, D)")
def _seed_shapes(r: Results):
    p = r.seed
    two_d = all(d == 2 for d in p["dims"].values())
    unequal = len({shape[1] for shape in p["shapes"].values()}) > 1
    evidence = (
        ", ".join(f"{n} {p['shapes'][n]}" for n in "qkv") + f" {p['dtype']}; contract: {str(p['contract_error']).split(':')[0]}"
    )
    return two_d and unequal and p["contract_error"] is not None, evidence


@claims("corrected seed repro, replica, poisoned: out.sum() is already NaN; only TAIL rows of out and x.grad are non-finite")
def _corrected(r: Results):
    c = r.corrected
    holds = math.isnan(c["loss"]) and c["out_tail_nonfinite"] > 0 and c["grad_tail_nonfinite"] > 0
    holds = holds and c["out_real_nonfinite"] == 0 and c["grad_real_nonfinite"] == 0
    return holds, f"loss {c['loss']}; non-finite TAIL out {c['out_tail_nonfinite']}, x.grad {c['grad_tail_nonfinite']}; REAL 0"


@claims("replica under poisoning: non-finite values in TAIL rows of out, dq, dk, dv, none in REAL rows")
def _replica_tail(r: Results):
    rec = r.at("replica")
    tail = {t: rec.nonfinite[t]["TAIL"] for t in ("out",) + GRADS}
    holds = all(n > 0 for n in tail.values()) and rec.real_finite and rec.real_within_bound
    return holds, "TAIL non-finite " + ", ".join(
        f"{t} {n}" for t, n in tail.items()
    ) + f"; REAL within bound: {rec.real_within_bound}"


@claims("replica: no TAIL rows, no symptom; every trailing pad > 0 gives non-finite TAIL rows in out, dq, dk, dv")
def _replica_map(r: Results):
    points = [(p["tail_q"], p["record"]) for p in r.sweep.where(impl="replica")]
    clean = sum(rec.nonfinite_in("TAIL") == 0 and rec.real_finite for pad, rec in points if pad == 0)
    broken = sum(
        all(rec.nonfinite[t]["TAIL"] > 0 for t in ("out",) + GRADS) and rec.real_finite for pad, rec in points if pad > 0
    )
    n0 = sum(pad == 0 for pad, _ in points)
    return clean == n0 and broken == len(
        points
    ) - n0, f"pad 0 clean {clean}/{n0}; pad > 0 non-finite TAIL {broken}/{len(points) - n0}"


@claims(
    "fixed kernel: TAIL rows of out and all gradients exactly zero, REAL rows within the relative bound of the oracle, at every sweep point"
)
def _fixed_sweep(r: Results):
    points = [p["record"] for p in r.sweep.where(impl="fixed")]
    good = sum(rec.padding_exactly_zero and rec.real_within_bound for rec in points)
    return good == len(points) > 0, f"{good}/{len(points)} points (poisoned memory)"


@claims("the ValueError fix rejects a layout the fixed kernel handles correctly")
def _check_rejects(r: Results):
    c = r.check
    error = c.rejects_tail["error"] or "nothing"
    fixed = r.at("fixed")  # the same layout, in the sweep
    fixed_ok = fixed.padding_exactly_zero and fixed.real_within_bound
    holds = error.startswith("ValueError") and c.accepts_no_tail["ok"] and fixed_ok
    return (
        holds,
        f"{STUDY.tail_q} TAIL rows: the check raises {error.split(':')[0]}; fixed kernel TAIL exactly 0, REAL within bound: {fixed_ok}",
    )


@claims(
    "the check's .item() breaks torch.compile(fullgraph=True); without it (replica, fixed kernel with validate=False) the call compiles"
)
def _check_compile(r: Results):
    c = r.check.compile
    holds = (
        not c["replica + proposed check"]["ok"]
        and c["replica (as upstream: no check)"]["ok"]
        and c["fixed kernel, validate=False"]["ok"]
    )
    return holds, "; ".join(f"{name}: {'compiles' if o['ok'] else o['error'].split(':')[0]}" for name, o in c.items())


@claims("training under poisoned memory: the replica's loss goes NaN after one step, the fixed kernel's stays finite")
def _training_loss(r: Results):
    if r.training is None:
        return False, "not run: the training study needs the Triton interpreter (CPU)"
    replica_losses, fixed_losses = r.training.runs["replica"].losses, r.training.runs["fixed"].losses
    first_nan = next((i for i, x in enumerate(replica_losses) if not math.isfinite(x)), None)
    holds = first_nan is not None and 0 < first_nan and all(math.isfinite(x) for x in fixed_losses)
    return (
        holds,
        f"replica loss non-finite from step {first_nan} of {len(replica_losses)}; fixed: {sum(map(math.isfinite, fixed_losses))}/{len(fixed_losses)} finite",
    )


@claims("the health monitor names the first non-finite gradient and the NaN tracer names the replica's forward op")
def _training_diagnosis(r: Results):
    if r.training is None:
        return False, "not run: the training study needs the Triton interpreter (CPU)"
    first = r.training.monitors["replica"].causal_chain().first_parameter
    culprit = r.training.culprit
    names_op = culprit is not None and culprit.phase == "forward" and "torch_varlen_fwd" in culprit.op
    clean = not r.training.monitors["fixed"].causal_chain()
    op = f"{culprit.op} in {culprit.module or '<no module>'}" if culprit else "none"
    return (
        first is not None and names_op and clean,
        f"first non-finite gradient: {first}; culprit op: {op}; fixed run: no non-finite value",
    )


# -- on a GPU: torch's own varlen_attn, recorded ----------------------------------------------


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


def record_gpu_run(path: str | Path, *, pads: tuple[int, ...] = GPU_PADS, prefill_mb: int = GPU_PREFILL_MB) -> dict[str, Any]:
    """Probes torch's `varlen_attn`, our fixed kernel and the replica on the seed's layout, on CUDA.

    For every trailing pad in `pads`: without poisoning (whatever the caching allocator left),
    then with poisoning (`poisoned_memory(cuda_prefill_mb=prefill_mb)`: NaN-filled fresh
    buffers). Also: the seed's code verbatim, the corrected repro, and whether each subject
    survives `torch.compile(fullgraph=True)` and CUDA-graph capture. Writes JSON to `path`
    after every pad, so a run cut short still leaves its data.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("record_gpu_run needs a CUDA device: it studies torch's varlen_attn, which is CUDA-only.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "postmortem": META.id,
        "command": f"python -m {__spec__.name if __spec__ else __name__} --record {path}"
        + ("" if pads == GPU_PADS else f" --pads {' '.join(map(str, pads))}"),
        "provenance": provenance()
        | {"cuda": torch.version.cuda, "capability": ".".join(map(str, torch.cuda.get_device_capability()))},
        "varlen_attn_signature": upstream_signature(),
        "case": GPU_CASE.to_dict(),
        "pads": list(pads),
        "prefill_mb": prefill_mb,
        "points": [],
    }

    def save():
        path.write_text(json.dumps(data, indent=1, default=str) + "\n")

    data["seed_repro"] = seed_repro_on_cuda()
    save()
    impls = {"varlen_attn": upstream(), "fixed": varlen_attention, "replica": replica}
    for point in probe_points(impls, GPU_CASE, pads, device="cuda", prefill_mb=prefill_mb):
        data["points"].append(point)
        if " vs " in point["impl"]:
            save()
    data["corrected_repro"] = {}
    for trailing in (2, 64):
        for poisoned in (False, True):
            key = f"trailing={trailing} poisoned={poisoned}"
            try:
                with _memory(poisoned, prefill_mb):
                    data["corrected_repro"][key] = corrected_repro(_varlen_attn(), trailing=trailing, device="cuda")
            except Exception:  # recorded: the run goes on
                data["corrected_repro"][key] = {"error": _error_text()}
    save()
    batch = pack(GPU_CASE, "cuda")  # no TAIL rows: a layout the check accepts
    data["capture"] = {"compile_fullgraph": {}, "cuda_graph": {}}
    for name, fn in _subjects(on_gpu=True).items():
        data["capture"]["compile_fullgraph"][name] = compile_fullgraph(fn, batch)
        data["capture"]["cuda_graph"][name] = cuda_graph_capture(fn, batch)
        save()
    return data


def gpu_records(directory: Path = GPU_DATA) -> list[dict[str, Any]]:
    """Every committed GPU record of this post-mortem (data/gpu/torch-varlen-176793*.json)."""
    return [json.loads(p.read_text()) for p in sorted(directory.glob(f"{META.id}*.json"))]


def gpu_table(record: dict[str, Any]) -> str:
    """One line per (poisoned, pad, impl): non-finite counts and peak |x| in TAIL rows, the REAL
    rows' verdict against the fp64 oracle, and the largest REAL-row difference from our kernel."""
    agreement = {
        (p["pad"], p["poisoned"], p["impl"].split(" vs ")[0]): p["real_max_abs_diff"]
        for p in record["points"]
        if " vs " in p["impl"]
    }
    lines = [
        f"{'poisoned':>8} {'pad':>4}  {'impl':<11}  {'TAIL non-finite out/dq/dk/dv':<28}  {'TAIL max|x|':>11}  {'REAL vs fp64':<12}  REAL vs fixed"
    ]
    for p in record["points"]:
        if " vs " in p["impl"]:
            continue
        head = f"{str(p['poisoned']):>8} {p['pad']:>4}  {p['impl']:<11}"
        if "error" in p:
            lines.append(f"{head}  error: {p['error']}")
            continue
        counts = "/".join(str(p["nonfinite"][t]["TAIL"]) for t in ("out",) + GRADS)
        peak = max((p["max_abs"][t]["TAIL"] for t in p["max_abs"]), key=lambda x: math.inf if x != x else x)
        real = "within bound" if p["real_within_bound"] else "OUTSIDE"
        diff = agreement.get((p["pad"], p["poisoned"], p["impl"]))
        diff_text = "" if diff is None else f"{max(diff.values(), key=lambda x: math.inf if x != x else x):.3g}"
        lines.append(f"{head}  {counts:<28}  {peak:>11.3g}  {real:<12}  {diff_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__name__}", description=f"{META.id}: record a GPU run of torch's varlen_attn."
    )
    parser.add_argument(
        "--record", metavar="FILE", required=True, help="JSON file to write, e.g. data/gpu/torch-varlen-176793-h200.json"
    )
    parser.add_argument("--pads", type=int, nargs="+", default=list(GPU_PADS), help="trailing rows to probe")
    args = parser.parse_args(argv)
    try:
        data = record_gpu_run(args.record, pads=tuple(args.pads))
    except RuntimeError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    print(gpu_table(data))
    print(f"recorded to {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
