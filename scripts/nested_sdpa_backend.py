"""Which kernel torch's SDPA on nested jagged tensors runs for a packed batch (the sdpa-nested row).

    python scripts/nested_sdpa_backend.py                  # CPU: the dispatch, with the device checks as on an H200
    python scripts/nested_sdpa_backend.py --device cuda    # GPU: the dispatch as it is, then each call and its error
    python scripts/nested_sdpa_backend.py --device cuda --layouts fuzz-raises   # one batch (a fault loses the context)

The H200 fuzzer's failing batches of the sdpa-nested row are causal and hold an empty sequence.
torch's jagged SDPA (torch/nested/_internal/sdpa.py, `_select_sdp_backend`) tries flash, then
memory-efficient, then math, then cuDNN: the first two refuse a batch with a sequence of length 0,
math refuses is_causal=True, and cuDNN is left. On the CPU the device checks (`can_use_flash_attention`,
`can_use_efficient_attention`, `can_use_cudnn_attention`) answer for the CPU, so here they pass, as
they do on an H200 for these bfloat16 batches of head dim 64; the nested checks run as they are.
On CUDA nothing is patched: the dispatch, then forward and backward of each batch (is_causal=True,
bfloat16, 2 heads of 64, the adapter's call) against float64 attention per sequence, with the
largest error of out, dq, dk, dv in units of the bfloat16 tolerance, or what the call raised.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nested._internal import sdpa as jagged_sdpa

HEADS, HEAD_DIM, DTYPE, TOLERANCE = 2, 64, torch.bfloat16, 6e-2  # bfloat16's bound, as the audit's snippet has it
LAYOUTS = {
    "fuzz-real-accuracy": (273, 0, 129, 82),  # the H200 fuzzer's failing batches, as drawn
    "fuzz-raises": (63, 65, 0, 106, 230),
    "sanitizer": (37, 0, 100, 64),  # the batch compute-sanitizer watched (its GAP and TAIL rows do not reach SDPA)
    "one-token": (273, 1, 129, 82),  # control: the empty sequence holds one token
}
DEVICE_CHECKS = ("can_use_flash_attention", "can_use_efficient_attention", "can_use_cudnn_attention")


@contextlib.contextmanager
def device_checks_pass() -> Iterator[None]:
    """The dispatch's device checks answer yes, as on an H200 for these batches; the nested checks run as they are."""
    saved = {name: getattr(jagged_sdpa, name) for name in DEVICE_CHECKS}
    for name in DEVICE_CHECKS:
        setattr(jagged_sdpa, name, lambda params, debug=False: True)
    try:
        yield
    finally:
        for name, check in saved.items():
            setattr(jagged_sdpa, name, check)


def packed(lengths: tuple[int, ...], device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (total, heads, dim) requiring grad, offsets) of one side of the batch."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    values = torch.randn(int(offsets[-1]), HEADS, HEAD_DIM, generator=generator).to(device, DTYPE).requires_grad_()
    return values, offsets


def jagged(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(batch, heads, jagged, dim), as the sdpa-nested adapter builds it."""
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets).transpose(1, 2)


def backend(lengths: tuple[int, ...], causal: bool, device: str) -> str:
    """The backend `_select_sdp_backend` picks for the batch (on the CPU: with the device checks passing)."""
    (q, off), (k, _), (v, _) = (packed(lengths, device, seed) for seed in range(3))
    patch = device_checks_pass() if device == "cpu" else contextlib.nullcontext()
    with patch:
        return jagged_sdpa._select_sdp_backend(jagged(q, off), jagged(k, off), jagged(v, off), None, 0.0, causal, False).name


def errors(lengths: tuple[int, ...], device: str, causal: bool = True) -> dict[str, float]:
    """The call, forward and backward: each tensor's largest error over float64 attention per
    sequence, in units of TOLERANCE * (1 + the reference's largest magnitude)."""
    (q, off), (k, _), (v, _) = (packed(lengths, device, seed) for seed in range(3))
    out = (
        F.scaled_dot_product_attention(jagged(q, off), jagged(k, off), jagged(v, off), is_causal=causal).transpose(1, 2).values()
    )
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device, DTYPE)
    out.backward(d_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pieces = []
    for start, end in zip(off.tolist(), off.tolist()[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in leaves)
            pieces.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
    want = torch.cat(pieces)
    want.backward(d_out.double())
    got = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    ref = {"out": want.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    return {
        name: float(
            ((got[name].double() - ref[name]).abs().max() / (TOLERANCE * (1 + ref[name].abs().max()))).nan_to_num(float("inf"))
        )
        for name in got
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"which batches (default {','.join(LAYOUTS)})")
    args = parser.parse_args()
    names = args.layouts.split(",")
    if set(names) - set(LAYOUTS):
        parser.error(f"--layouts: unknown {sorted(set(names) - set(LAYOUTS))}; choose from {list(LAYOUTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("nested_sdpa_backend: --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)  # the dispatch logs every backend it cannot use
    print(f"torch {torch.__version__}" + (f", cuDNN {torch.backends.cudnn.version()}" if args.device == "cuda" else ""))
    for name in names:
        lengths = LAYOUTS[name]
        picks = {causal: backend(lengths, causal, args.device) for causal in (True, False)}
        line = f"{name:<22} q=k={list(lengths)}: causal -> {picks[True]}, not causal -> {picks[False]}"
        if args.device == "cuda":
            try:
                line += "; causal call, error / bound: " + ", ".join(f"{n} {e:.3g}" for n, e in errors(lengths, "cuda").items())
            except Exception as exc:  # a fault loses the context: later batches report it too
                line += f"; causal call raised {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
