"""The mechanism on the replica: the original report's inputs, the corrected reproduction, TAIL rows under poisoned and stale
memory, the pad sweep and the QKV damage."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.contract import check_varlen_tensors
from varlen_workbench.kernels.replicas.torch_varlen import replica_varlen_attn, stale_memory
from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.torch_varlen_176793.cases import LAYOUTS, PADS, SEED_SEQLENS, STUDY
from varlen_workbench.postmortems.torch_varlen_176793.upstream import _varlen_attn, torch_style
from varlen_workbench.workbench.layout import Case, Region, cumulative, pack
from varlen_workbench.workbench.postmortem import table
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.reference import reference_attention
from varlen_workbench.workbench.sweeps import SweepResult, sweep

replica = torch_style(replica_varlen_attn, "replica")

IMPLS: dict[str, Callable] = {"replica": replica, "fixed": varlen_attention_triton, "oracle": reference_attention}


def seed_inputs(device: str | torch.device = "meta") -> dict[str, Any]:
    """The original report's (and PR #188933's) inputs, verbatim; on the meta device nothing is computed."""
    cu_seqlens = torch.tensor([0, 144, 432, 944], dtype=torch.int32, device=device)
    x = torch.randn(944 + 2, 1024, device=device, requires_grad=True)
    q, k, v = x.chunk(3, dim=-1)
    return {"x": x, "q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens}


def seed_input_problems() -> dict[str, Any]:
    """What is wrong with the original report's inputs before any kernel runs: shapes, widths, dtype."""
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
    """Runs the original report's code verbatim with torch's `varlen_attn` (CUDA only) and reports its fate."""
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
    """The original report's experiment with valid inputs, for any torch-style `varlen_fn`.

    A fused QKV activation `x` of (T + trailing, 3*H*D) is viewed as (T, 3, H, D) and split into
    q, k, v of (T, H, D); `cu_seqlens` covers T rows, so `trailing` rows are TAIL. The loss is
    the original report's `out.sum()` over every row, TAIL rows included.
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


def _masked_grad_out(batch) -> torch.Tensor:
    """dO of the probe's seed with TAIL rows 0: what a loss that ignores padding rows sends back."""
    from varlen_workbench.workbench.probes import grad_output

    d_out = grad_output(batch).clone()
    d_out[batch.regions_q != Region.REAL] = 0
    return d_out


def _outcome(run: Callable[[], Any]) -> dict[str, Any]:
    """{"ok": True, "error": None} or {"ok": False, "error": "<type>: <first line>"}: what a user sees."""
    try:
        run()
        return {"ok": True, "error": None}
    except Exception as exc:  # recorded, not hidden: the error is the result
        return {"ok": False, "error": _first_line(exc)}


def _max_abs(x: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return float("nan") if bool(torch.isnan(x).any()) else float(x.abs().max())


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
    from varlen_workbench.workbench.plots import plot_nan_map

    return plot_nan_map(result, rows="seqlens_q", cols="tail_q", facet="impl", title="non-finite elements, poisoned memory")


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
