"""What only a GPU run shows: the backend SDPA picks and what each backend returns on keyless rows, and the
workarounds' times (`gpu_probes`, recorded by `varlen-workbench repro sdpa-cudnn-masked-rows --device cuda --record ...`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F

from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.cases import CUDNN_FILL, GPU_LAYOUTS
from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.study import _fp64_math
from varlen_workbench.workbench.timing import time_call


def workaround_timing(dev: torch.device, batch: int = 8, seq: int = 2048, heads: int = 16, dim: int = 64) -> dict:
    """Forward+backward milliseconds (`varlen_workbench.workbench.timing.time_call`'s median of 20 after 5 warm-up runs, bf16, a padding mask with
    lengths seq, seq/2, ...): SDPA unpinned, unpinned + workaround (a), pinned to each backend (b)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, dim, generator=gen).to(dev, torch.bfloat16) for _ in range(3))
    lengths = torch.tensor([max(seq >> (i % 4), 2) for i in range(batch)], device=dev)
    real = torch.arange(seq, device=dev)[None, :] < lengths[:, None]
    mask = (real[:, :, None] & real[:, None, :] & torch.ones(seq, seq, dtype=torch.bool, device=dev).tril())[:, None]

    def step(backend, zero_rows):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        if zero_rows:
            out = out.masked_fill(~mask.any(-1, keepdim=True), 0)
        out.backward(torch.ones_like(out))

    timed = {}
    for name, backend, zero_rows in (
        ("unpinned", None, False),
        ("unpinned + (a) zero rows", None, True),
        ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION, False),
        ("EFFICIENT_ATTENTION", SDPBackend.EFFICIENT_ATTENTION, False),
        ("MATH", SDPBackend.MATH, False),
    ):
        try:
            timed[name] = time_call(functools.partial(step, backend, zero_rows), warmup=5, device=dev).median_ms
        except RuntimeError as exc:
            timed[name] = f"refused: {str(exc).splitlines()[0][:120]}"
    return {"shape": f"B={batch} H={heads} S={seq} D={dim} bf16", **timed}


def _gpu_run(inputs, attn, d_out, sdpa_kernel, backend) -> dict[str, torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    if backend is None:
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=attn)
    else:
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=attn)
    out.backward(d_out)
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def probe_points(dev: torch.device, layouts: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = GPU_LAYOUTS) -> list:
    """The points of `gpu_probes` on `dev` (on a CPU the cuDNN and efficient points read "refused")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {int(b.value): name for name, b in SDPBackend.__members__.items()}
    points = []
    for layout, (lens_q, lens_k) in layouts.items():
        for dtype in (torch.float16, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            bsz, heads, dim = len(lens_q), 2, 64
            sq, sk = max(lens_q), max(max(lens_k), 2)  # cuDNN refuses a key length of 1
            rq = torch.arange(sq)[None, :] < torch.tensor(lens_q)[:, None]
            rk = torch.arange(sk)[None, :] < torch.tensor(lens_k)[:, None]

            def draw(*shape, gen=gen, dtype=dtype):  # rounded to `dtype`: the fp64 reference sees what the GPU sees
                return torch.randn(*shape, generator=gen).to(dtype).float()

            # Padded slots hold one "pad token" (as a model's pad-token activations would), not zeros.
            q = torch.where(rq[:, None, :, None], draw(bsz, heads, sq, dim), draw(1, heads, 1, dim))
            k = torch.where(rk[:, None, :, None], draw(bsz, heads, sk, dim), draw(1, heads, 1, dim))
            v = torch.where(rk[:, None, :, None], draw(bsz, heads, sk, dim), draw(1, heads, 1, dim))
            rows = torch.arange(sq)[None, :, None]
            cols = torch.arange(sk)[None, None, :]
            shift = (torch.tensor(lens_k) - torch.tensor(lens_q))[:, None, None]
            mask = (rq[:, :, None] & rk[:, None, :] & (cols <= rows + shift))[:, None]  # (B, 1, S_q, S_k)
            keyless = (rq[:, None, :] & ~mask.any(-1)).expand(bsz, heads, sq)  # REAL rows without a key
            d_out = draw(bsz, heads, sq, dim) * rq[:, None, :, None]  # a loss that ignores padded queries
            ref = _fp64_math(q, k, v, mask, d_out)
            unmasked = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
            mean_v = v.double().mean(2, keepdim=True).expand_as(unmasked)
            inputs = [t.to(dev, dtype) for t in (q, k, v)]
            mask_d, d_out_d = mask.to(dev), d_out.to(dev, dtype)
            choice = int(torch._fused_sdp_choice(*inputs, attn_mask=mask_d))
            variants = [
                ("default", None, "bool"),
                ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION, "bool"),
                ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION, "float -inf"),
                ("CUDNN_ATTENTION", SDPBackend.CUDNN_ATTENTION, "float -65504"),
                ("EFFICIENT_ATTENTION", SDPBackend.EFFICIENT_ATTENTION, "bool"),
                ("MATH", SDPBackend.MATH, "bool"),
            ]
            first_runs: dict[str, dict[str, torch.Tensor]] = {}  # backend -> its boolean-mask run
            for backend_name, backend, mask_kind in variants:
                point: dict[str, Any] = {
                    "layout": layout,
                    "dtype": str(dtype).replace("torch.", ""),
                    "backend": backend_name,
                    "mask": mask_kind,
                    "default_choice": names.get(choice, str(choice)),
                }
                if mask_kind == "bool":
                    attn = mask_d
                else:
                    fill = float("-inf") if mask_kind == "float -inf" else CUDNN_FILL
                    attn = torch.zeros(mask_d.shape, dtype=dtype, device=dev).masked_fill(~mask_d, fill)
                try:
                    runs = [_gpu_run(inputs, attn, d_out_d, sdpa_kernel, backend) for _ in range(2)]
                except RuntimeError as exc:
                    point["error"] = str(exc).splitlines()[0][:200]
                    points.append(point)
                    continue
                got = {n: t.double().cpu() for n, t in runs[0].items()}
                point["deterministic"] = all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
                if mask_kind == "bool":
                    first_runs[backend_name] = runs[0]
                elif backend_name in first_runs:  # the hypothesis: a boolean mask is this float mask for cuDNN
                    point["bitwise_equal_to_bool_mask"] = all(
                        torch.equal(runs[0][n], first_runs[backend_name][n]) for n in runs[0]
                    )
                point["nonfinite"] = {n: int((~torch.isfinite(t)).sum()) for n, t in got.items()}
                point["keyless_rows"] = int(keyless[:, 0].sum())
                if keyless.any():
                    point["keyless_out_max_abs"] = float(got["out"][keyless].abs().max())
                    point["keyless_dq_max_abs"] = float(got["dq"][keyless].abs().max())
                    point["vs_unmasked"] = float((got["out"][keyless] - unmasked[keyless]).abs().max())
                    point["vs_mean_v"] = float((got["out"][keyless] - mean_v[keyless]).abs().max())
                real_q = (rq[:, None, :] & ~keyless[:, :1]).expand(bsz, heads, sq)
                real_k = rk[:, None, :].expand(bsz, heads, sk)
                point["real_errors"] = {
                    "out": float((got["out"] - ref["out"])[real_q].abs().max()),
                    "dq": float((got["dq"] - ref["dq"])[real_q].abs().max()),
                    "dk": float((got["dk"] - ref["dk"])[real_k].abs().max()),
                    "dv": float((got["dv"] - ref["dv"])[real_k].abs().max()),
                }
                points.append(point)
    return points


def gpu_probes(device) -> dict[str, Any]:
    """What only the GPU shows, with torch alone: per layout, dtype and backend (SDPA unpinned, cuDNN,
    efficient, math), causal bottom-right masks built as a user builds them, and for cuDNN also an
    additive float mask with -inf and with the finite fill. Per point: which backend SDPA picked,
    max |out| and |dq| on REAL rows with no visible key, their distance to unmasked attention over
    every key slot (the replica's mechanism) and to mean(V), REAL-row errors of out/dq/dk/dv
    against fp64 math, and whether two identical runs are bitwise equal."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {"skipped": f"gpu_probes needs a CUDA device, got {device!r}"}
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(dev),
        "points": probe_points(dev),
        "timing_ms": workaround_timing(dev),
    }
