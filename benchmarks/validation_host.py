"""The cost of `validate=True` in host time, up to the first launch (whole training steps:
`benchmarks/validate_cost.py`).

    python benchmarks/validation_host.py [--device cpu|cuda] [--seqs 8 64 1024]

Host time: `varlen_attention` with its launchers replaced by an exception (as
docs/contract_errors.py does), so only the argument checks run: validate=False, validate=True on
new metadata tensors each call (the host check: one device->host copy of the four boundary
vectors, then the checks), and validate=True on the same tensors (remembered, not read again).
The layout is N sequences of 2048 tokens, bf16, 16 heads of 128, padded boundaries given. On
CUDA the GPU is idle, so the copy's sync costs only its latency.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

from contract_errors import Launched, checks_only  # noqa: E402

import varlen_workbench.kernels.varlen.op as op  # noqa: E402
from varlen_workbench.workbench.timing import host_us  # noqa: E402


def call(q: torch.Tensor, cu: torch.Tensor, same: list[torch.Tensor], validate: bool, fresh: bool) -> None:
    """One call up to its launch: on new boundary tensors (`fresh`) or on `same` each time."""
    m = [cu.clone() for _ in range(4)] if fresh else same
    try:
        op.varlen_attention(
            q, q, q, m[0], m[1], 2048, 2048, cu_seqlens_q_padded=m[2], cu_seqlens_k_padded=m[3], validate=validate
        )
    except Launched:
        pass


def host_times(device: torch.device, seqs: list[int]) -> None:
    print(f"device {device}, torch {torch.__version__}; microseconds of host time per call")
    for n in seqs:
        cu = torch.arange(0, 2048 * (n + 1), 2048, dtype=torch.int32, device=device)
        q = torch.empty(2048 * n, 16, 128, dtype=torch.bfloat16, device=device)
        same = [cu.clone() for _ in range(4)]

        with checks_only():
            row = {
                "validate=False": host_us(partial(call, q, cu, same, False, True), 300, repeats=7, warmup=50),
                "validate=True, new metadata": host_us(partial(call, q, cu, same, True, True), 300, repeats=7, warmup=50),
                "validate=True, same metadata": host_us(partial(call, q, cu, same, True, False), 300, repeats=7, warmup=50),
            }
        print(f"{n:5d} sequences: " + "  ".join(f"{k} {v:7.1f}" for k, v in row.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 64, 1024])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    host_times(torch.device(args.device), args.seqs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
