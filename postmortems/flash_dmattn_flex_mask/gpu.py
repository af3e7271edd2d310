"""What only a GPU run shows: every implementation compiled, over seeds and dtypes (`gpu_probes`, recorded by
`varlen-workbench repro flash-dmattn-flex-mask --device cuda --record ...`)."""

from __future__ import annotations

import time
from typing import Any

import torch

from varlen_workbench.postmortems.flash_dmattn_flex_mask.cases import AUDITED, GPU_SEEDS, IMPLS
from varlen_workbench.postmortems.flash_dmattn_flex_mask.study import (
    as_thd,
    causal_default,
    flex_with_mask,
    mask_as_bias,
    mask_effect,
)
from varlen_workbench.postmortems.flash_dmattn_flex_mask.upstream import compile_room, upstream_function, upstream_module
from varlen_workbench.workbench.layout import pack
from varlen_workbench.workbench.probes import probe


def _probe_all(device, budget_s, backward, dtypes, seeds) -> dict[str, Any]:
    start = time.monotonic()
    fn = upstream_function(device)
    found: dict[str, Any] = {
        "transformers_used": upstream_module().transformers_used,
        "backward": backward,
        "mask_effect": mask_effect(fn, device),
        "causal": causal_default(fn, device),
        "runs": [],
        "skipped": [],
    }
    impls = {IMPLS[0]: as_thd(fn), IMPLS[1]: as_thd(mask_as_bias(fn)), IMPLS[2]: as_thd(flex_with_mask(device))}
    for dtype in dtypes:
        for seed in seeds:
            for check, (case, kwargs) in AUDITED.items():
                for name, impl in impls.items():
                    label = {"impl": name, "check": check, "dtype": dtype, "seed": seed}
                    if time.monotonic() - start > budget_s:
                        found["skipped"].append(label)
                        continue
                    varied = case.with_(dtype=dtype, seed=seed)
                    try:
                        record = probe(impl, pack(varied, device), name=name, backward=backward, padding_fill=case.fill, **kwargs)
                    except Exception as exc:
                        found["runs"].append({**label, "error": f"{type(exc).__name__}: {exc}"[:300]})
                        continue
                    found["runs"].append(
                        {
                            **label,
                            "ratios": {n: e.ratio for n, e in record.errors.items()},
                            "within": record.real_within_bound,
                            "finite": record.real_finite,
                        }
                    )
    found["seconds"] = round(time.monotonic() - start, 1)
    return found


def probe_all(
    device,
    *,
    budget_s: float,
    backward: bool = True,
    dtypes: tuple[str, ...] = ("float16", "bfloat16"),
    seeds: tuple[int, ...] = GPU_SEEDS,
) -> dict[str, Any]:
    """`gpu_probes`' work on any device: the bit test, then every (dtype, seed, audited case,
    implementation) probed in that order, each run's error ratios, or the exception it raised
    (a probe that raises is a finding, recorded, not a crash); past `budget_s` the rest is skipped."""
    device = torch.device(device)
    with compile_room(device):
        return _probe_all(device, budget_s, backward, dtypes, seeds)


def gpu_probes(device, budget_s: float = 200.0) -> dict[str, Any]:
    """What `varlen-workbench repro flash-dmattn-flex-mask --device cuda --record FILE` adds: upstream's own
    compiled FlexAttention path on the GPU, forward and backward, fp16 and bf16, as is and with the two
    workarounds, over `GPU_SEEDS` seeds of every audited case; and the mask bit test there.
    Imports torch, triton and the upstream wheels only (plus transformers if installed). A probe that
    would start past `budget_s` is recorded as skipped."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"gpu_probes(device={device!r}) needs a CUDA device: it records the compiled FlexAttention path.")
    found = probe_all(device, budget_s=budget_s)
    return {**found, "capability": list(torch.cuda.get_device_capability(device))}
