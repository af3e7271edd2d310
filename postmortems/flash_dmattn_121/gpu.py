"""What only a GPU run shows: 1.2.2's Triton kernel natively in bf16, the successor, and the speed beside ours
(`gpu_probes`, recorded by `varlen-workbench repro flash-dmattn-121 --device cuda --record ...`)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import itertools
import time
from dataclasses import replace

import torch

from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.flash_dmattn_121.cases import GPU_SEEDS, SEED, UPSTREAM_CASES, UPSTREAM_TENSORS, MaskCase
from varlen_workbench.postmortems.flash_dmattn_121.study import (
    oracle,
    tensor_check,
    upstream_call_errors,
    upstream_cases,
    upstream_run,
)
from varlen_workbench.postmortems.flash_dmattn_121.upstream import (
    SUCCESSOR_PACKAGE,
    import_successor,
    upstream_triton_func,
    upstream_version,
)
from varlen_workbench.workbench.bounds import FACTORS
from varlen_workbench.workbench.timing import time_call
from varlen_workbench.workbench.upstream import stubbed

TIMING_SEQLENS = (1024, 896, 768, 640)  # a right-padded batch of 4 (the workaround layout), 8 heads of 64, causal

TIMING_HEADS, TIMING_HEAD_DIM = 8, 64


def _outcome(run) -> dict:
    try:
        return {"ok": True, **run()}
    except Exception as exc:  # a probe that fails is recorded, not fatal: the rest still runs
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}


def speed_vs_upstream(device) -> dict:
    """Forward + backward time of 1.2.2's Triton kernel on a right-padded dense batch (boolean mask,
    the workaround layout) and of our varlen_attention on the same tokens packed, bf16, causal."""
    func = upstream_triton_func(device)
    batch, n = len(TIMING_SEQLENS), max(TIMING_SEQLENS)
    generator = torch.Generator().manual_seed(121)
    shape = (batch, n, TIMING_HEADS, TIMING_HEAD_DIM)
    dense = [torch.randn(shape, generator=generator).to(torch.bfloat16).to(device).requires_grad_() for _ in range(3)]
    d_out = torch.randn(shape, generator=generator).to(torch.bfloat16).to(device)
    mask = torch.zeros(batch, TIMING_HEADS, n, n, dtype=torch.bool, device=device)
    for i, length in enumerate(TIMING_SEQLENS):
        mask[i, :, :, :length] = True
    bias = torch.zeros(mask.shape, dtype=torch.bfloat16, device=device)

    def upstream_step():
        for t in dense:
            t.grad = None
        func(*dense, mask, bias, True, None).backward(d_out)

    rows = torch.cat([torch.arange(length) + i * n for i, length in enumerate(TIMING_SEQLENS)]).to(device)
    packed = [t.detach().reshape(-1, TIMING_HEADS, TIMING_HEAD_DIM)[rows].clone().requires_grad_() for t in dense]
    packed_d_out = d_out.reshape(-1, TIMING_HEADS, TIMING_HEAD_DIM)[rows]
    cu = torch.tensor([0, *itertools.accumulate(TIMING_SEQLENS)], dtype=torch.int32, device=device)

    def ours_step():
        for t in packed:
            t.grad = None
        varlen_attention_triton(*packed, cu, cu, n, n, causal=True).backward(packed_d_out)

    upstream_ms, ours_ms = (time_call(step, device=device).median_ms for step in (upstream_step, ours_step))
    return {
        "seqlens": list(TIMING_SEQLENS),
        "heads": TIMING_HEADS,
        "head_dim": TIMING_HEAD_DIM,
        "upstream_ms": upstream_ms,
        "ours_ms": ours_ms,
        "ours_over_upstream": ours_ms / upstream_ms,
    }


def successor_probe(device) -> dict:
    """flash-sparse-attn (the successor): does it import, and its dense kernel on the original report's configuration."""
    found: dict = {}
    try:
        found["version"] = importlib.metadata.version(SUCCESSOR_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False}
    found["installed"] = True
    found["plain_import"] = _outcome(lambda: {"module": importlib.import_module("flash_sparse_attn").__name__})
    if not found["plain_import"]["ok"]:
        import_successor()
        found["stubbed"] = stubbed()

    def dense(case: MaskCase):
        fsa = import_successor()
        x = case.inputs(device)
        leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]  # (B, S, H, D), as 1.2.2
        # is_autotune=False: its default 64 x 64 tiles, no autotuning sweep (minutes of compilation)
        out = fsa.flash_dense_attn_func(*leaves, is_causal=case.causal, is_autotune=False)
        out.backward(x["d_out"])
        ref = oracle(case, str(device))
        tensors = dict(zip(UPSTREAM_TENSORS, (out.detach(), *(t.grad for t in leaves))))
        return {
            "error_over_bound": {n: tensor_check(n, t, ref, case).ratio / FACTORS[n] for n, t in tensors.items()},
            "nonfinite": {n: int((~torch.isfinite(t.float())).sum()) for n, t in tensors.items()},
        }

    for case in (SEED, UPSTREAM_CASES[1]):  # the original report's configuration, and the same at 200 tokens
        found[case.name] = _outcome(lambda c=case: dense(replace(c, dtype="bfloat16")))
    return found


def _seed_runs(device) -> dict:
    seeds = {}
    for poisoned in (False, True):
        runs = [
            _outcome(lambda s=s, p=poisoned: upstream_run(replace(SEED, dtype="bfloat16", seed=s), device, poisoned=p).summary())
            for s in GPU_SEEDS
        ]
        seeds["poisoned" if poisoned else "plain"] = {
            "runs": len(runs),
            "errors": sorted({r["error"] for r in runs if not r["ok"]}),
            "nonfinite_runs": sum(r["ok"] and any(r["nonfinite"].values()) for r in runs),
            "dv_nonfinite_runs": sum(r["ok"] and r["nonfinite"]["dv"] > 0 for r in runs),
            "worst_error_over_bound": max((max(r["error_over_bound"].values()) for r in runs if r["ok"]), default=None),
        }
    return seeds


def gpu_probes(device) -> dict:
    """What `varlen-workbench repro flash-dmattn-121 --device cuda --record ...` adds to the GPU record:
    flash-dmattn 1.2.2's own Triton kernel run natively in bf16 (the original report's dtype): the report's
    snippet, every upstream case, the original report's configuration over GPU_SEEDS with and without NaN-filled
    fresh memory, the successor package, and 1.2.2's speed beside our kernel, in that order (a
    probe that fails is recorded as failed, and the next one runs)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"gpu_probes(device={device}): run it on CUDA (varlen-workbench repro ... --device cuda).")
    start = time.monotonic()
    found: dict = {"upstream_version": upstream_version(), "dtype": "bfloat16"}
    steps = (
        ("call_errors", lambda: _outcome(lambda: upstream_call_errors(device))),
        ("cases", lambda: {c.name: _outcome(lambda c=c: upstream_run(c, device).summary()) for c in upstream_cases("bfloat16")}),
        ("seed_config_seeds", lambda: _seed_runs(device)),
        ("successor", lambda: _outcome(lambda: successor_probe(device))),
        ("speed", lambda: _outcome(lambda: speed_vs_upstream(device))),
    )
    for name, probe_fn in steps:
        print(f"gpu_probes: {name} at {time.monotonic() - start:.0f} s", flush=True)
        found[name] = probe_fn()
    found["seconds"] = round(time.monotonic() - start, 1)
    print(f"gpu_probes: done in {found['seconds']} s", flush=True)
    return found
