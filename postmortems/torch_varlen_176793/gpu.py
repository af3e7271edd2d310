"""What only a GPU run shows: torch's own varlen_attn natively (`gpu_probes`, recorded by `varlen-workbench repro
torch-varlen-176793 --device cuda --record ...`), and the workarounds' times."""

from __future__ import annotations

import contextlib
import inspect
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.torch_varlen_176793.cases import (
    GPU_CASE,
    GPU_PADS,
    GPU_PREFILL_MB,
    GPU_TIMING_CASE,
    GPU_TRAILING,
)
from varlen_workbench.postmortems.torch_varlen_176793.mechanism import (
    _first_line,
    _masked_grad_out,
    _max_abs,
    corrected_repro,
    replica,
    seed_repro_on_cuda,
)
from varlen_workbench.postmortems.torch_varlen_176793.upstream import _varlen_attn, torch_style, upstream_signature
from varlen_workbench.postmortems.torch_varlen_176793.workarounds import (
    _subjects,
    compile_fullgraph,
    cuda_graph_capture,
    qkv_damage,
    workaround_checks,
    workarounds,
)
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.layout import Case, Region, pack
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.timing import time_call


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
    host syncs included (`varlen_workbench.workbench.timing.time_call`: median ms, the fastest call and the number
    of timed calls), and its ratio to `varlen_fn` as is."""
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
            timings.append({"workaround": name, "ms": timed.median_ms, "min_ms": timed.min_ms, "iters": timed.iters})
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
    impls = {"varlen_attn": torch_style(varlen_fn, "varlen_attn"), "fixed": varlen_attention_triton, "replica": replica}
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
    """The hook `varlen-workbench repro torch-varlen-176793 --device cuda --record FILE` calls: torch's
    own varlen_attn on the GPU (the original report's code verbatim, its padding rows with and without
    poisoning, the QKV damage, the workarounds and their cost, compile and CUDA-graph capture)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"gpu_probes(device={device!r}) needs a CUDA device: torch's varlen_attn is CUDA-only.")
    provenance = {"signature": upstream_signature(), "cuda": torch.version.cuda, "capability": torch.cuda.get_device_capability()}
    return {**provenance, "seed_repro": seed_repro_on_cuda(), **upstream_probes(_varlen_attn(), "cuda")}
