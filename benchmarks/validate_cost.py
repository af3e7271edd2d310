"""What `validate=True` costs a training step: forward+backward, side by side in one run.

    python -m benchmarks.validate_cost [--iters 50]     # on the GPU
    python -m benchmarks.validate_cost --quick          # each variant once on a tiny layout, untimed (CI)

Each workload is timed as `varlen_workbench.workbench.bench.kernels` times it (`varlen_workbench.workbench.timing.time_call`: CUDA events
around each call, no host sync between calls, median and fastest of `--iters` calls), every
call on a `VarlenMetadata` as a training step passes it, for: validate=False; validate=True on
the same metadata every call (checked once, as the layers of one step share it); validate=True
on new metadata every call (as each new batch brings: the device check runs every call, its
verdict read in the backward); and the same with the host check instead (a device->host copy,
the cost the device check removes). The ratios are to validate=False; the target is new
metadata at most 5% over it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import nullcontext
from unittest import mock

import torch

import varlen_workbench.kernels.varlen.metadata as metadata
from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.varlen import VarlenMetadata, varlen_attention
from varlen_workbench.workbench.timing import MIN_ITERS, CallTime, time_call

# (name, sequence lengths, head dim, causal)
WORKLOADS = (
    ("8x2048 d128", [2048] * 8, 128, False),
    ("8x2048 d128 causal", [2048] * 8, 128, True),
    ("8x2048 d64 causal", [2048] * 8, 64, True),
    ("32k short docs (16-256) d128 causal", None, 128, True),
)
QUICK = (("2x16 d16 causal, 1 head", [16, 16], 16, True),)
VARIANTS = ("validate=False", "True, same metadata", "True, new metadata", "True, new metadata, host check")


def short_documents(total: int = 32768, low: int = 16, high: int = 256, seed: int = 0) -> list[int]:
    """Lengths drawn uniformly in [low, high] until they fill `total` tokens (the last one cut)."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(low, high + 1, (1,), generator=generator)), total - sum(lengths)))
    return lengths


def step(
    qkv: list[torch.Tensor], cu: torch.Tensor, longest: int, causal: bool, grad: torch.Tensor, **kwargs
) -> Callable[[], None]:
    """One forward+backward; `fresh`: on new metadata each call (from clones of `cu`)."""
    fresh, validate = kwargs.pop("fresh"), kwargs.pop("validate")

    def batch() -> VarlenMetadata:
        q, k, q_padded, k_padded = (cu.clone() for _ in range(4))
        return VarlenMetadata.for_tensors(
            *qkv[:2], q, k, longest, longest, cu_seqlens_q_padded=q_padded, cu_seqlens_k_padded=k_padded, validate=validate
        )

    same = batch()

    def run() -> None:
        out = varlen_attention(*qkv, metadata=batch() if fresh else same, causal=causal, **kwargs)
        out.backward(grad)

    return run


def measure(
    lengths: list[int], heads: int, head_dim: int, causal: bool, device: torch.device, iters: int | None
) -> dict[str, CallTime | None]:
    """Each variant timed over `iters` calls, or run once untimed (None)."""
    total = sum(lengths)
    qkv = [torch.randn(total, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    common = dict(qkv=qkv, cu=cu, longest=max(lengths), causal=causal, grad=torch.randn_like(qkv[0]), backend="triton")
    runs = {
        VARIANTS[0]: step(**common, validate=False, fresh=True),
        VARIANTS[1]: step(**common, validate=True, fresh=False),
        VARIANTS[2]: step(**common, validate=True, fresh=True),
        VARIANTS[3]: step(**common, validate=True, fresh=True),
    }
    times: dict[str, CallTime | None] = {}
    for name, run in runs.items():
        host_check = (
            mock.patch.object(metadata, "checks_on_device", lambda boundary: False) if name == VARIANTS[3] else nullcontext()
        )
        with host_check:
            times[name] = time_call(run, warmup=3, iters=iters, device=device) if iters else run()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50, help=f"timed calls per cell (at least {MIN_ITERS})")
    parser.add_argument("--quick", action="store_true", help="each variant once on a tiny layout, untimed")
    args = parser.parse_args(argv)
    device = default_device()
    workloads, iters, heads = (QUICK, None, 1) if args.quick else (WORKLOADS, args.iters, 16)
    timing = f"median (fastest) of {iters} calls" if iters else "untimed"
    print(f"{device}, torch {torch.__version__}; ms per forward+backward, {timing}, bf16, {heads} heads; ratio to validate=False")
    print(f"{'workload':36s}" + "".join(f"{v:>32s}" for v in VARIANTS))
    for name, lengths, head_dim, causal in workloads:
        times = measure(lengths or short_documents(), heads, head_dim, causal, device, iters)
        base = times[VARIANTS[0]]
        cells = [
            "ran (not timed)"
            if t is None or base is None
            else f"{t.median_ms:.3f} ({t.min_ms:.3f}) {t.median_ms / base.median_ms - 1:+.1%}"
            for t in times.values()
        ]
        print(f"{name:36s}" + "".join(f"{c:>32s}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
