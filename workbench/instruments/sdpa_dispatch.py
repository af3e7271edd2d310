"""Which backend `scaled_dot_product_attention` runs when nobody asks for one, read off the profiler.

`torch._fused_sdp_choice` says what the dispatcher *would* pick; the profiler says what ran. Each
SDPA backend is one aten op (`aten::_scaled_dot_product_cudnn_attention` and its `_backward`, ...),
so the ops recorded over one forward+backward name the backend without guessing from kernel
names; the CUDA kernels launched inside are kept beside them as the second witness.

Run it the way an ordinary user runs: no `sdpa_kernel` context, deterministic algorithms off
(torch refuses cuDNN SDPA under them), no memory poisoning.

    python -m varlen_workbench.workbench.instruments.sdpa_dispatch --record data/gpu/sdpa-default-backend-h200.json
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

# aten op (forward; its backward op carries the suffix `_backward`) -> SDPBackend name.
BACKEND_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "CUDNN_ATTENTION",
    "aten::_scaled_dot_product_flash_attention": "FLASH_ATTENTION",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "FLASH_ATTENTION",
    "aten::_scaled_dot_product_efficient_attention": "EFFICIENT_ATTENTION",
    "aten::_scaled_dot_product_fused_attention_overrideable": "OVERRIDEABLE",
    "aten::_scaled_dot_product_attention_math": "MATH",
}
# Substrings of the CUDA kernels that belong to attention (the rest are copies and fills).
KERNEL_HINTS = ("cudnn", "sdpa", "fmha", "flash", "attention", "softmax")


@dataclass(frozen=True)
class Setting:
    """One SDPA call as a model makes it: shapes, dtype and the kind of mask."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    dtype: str
    mask: str  # "none-causal" (is_causal=True), "bool" or "float" (a padding + causal mask)


# Padded batches as Hugging Face models build them (B, 1, S, S masks), and the maskless causal call.
SETTINGS = (
    Setting("llama-like bool mask", 4, 32, 32, 2048, 128, "bfloat16", "bool"),
    Setting("llama-like bool mask, GQA 32/8", 4, 32, 8, 2048, 128, "bfloat16", "bool"),
    Setting("small bool mask", 8, 16, 16, 1024, 64, "bfloat16", "bool"),
    Setting("small bool mask fp16", 8, 16, 16, 1024, 64, "float16", "bool"),
    Setting("llama-like float mask", 4, 32, 32, 2048, 128, "bfloat16", "float"),
    Setting("llama-like is_causal, no mask", 4, 32, 32, 2048, 128, "bfloat16", "none-causal"),
)


def backends_of(op_names: Iterable[str]) -> dict[str, str | None]:
    """The backend of the forward and of the backward among the profiled op names (None: not seen)."""
    names = set(op_names)
    found: dict[str, str | None] = {"forward": None, "backward": None}
    for op, backend in BACKEND_OPS.items():
        if op in names:
            found["forward"] = found["forward"] or backend
        if op + "_backward" in names:
            found["backward"] = found["backward"] or backend
    return found


def _inputs(s: Setting, device: torch.device) -> tuple[list[torch.Tensor], dict[str, Any]]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = getattr(torch, s.dtype)
    shapes = ((s.batch, s.heads, s.seq, s.head_dim), *[(s.batch, s.kv_heads, s.seq, s.head_dim)] * 2)
    leaves = [torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_() for shape in shapes]
    kwargs: dict[str, Any] = {"enable_gqa": True} if s.kv_heads != s.heads else {}
    if s.mask == "none-causal":
        return leaves, {**kwargs, "is_causal": True}
    # Right padding: sequence b has seq >> (b % 4) real tokens; causal within them.
    lengths = torch.tensor([max(s.seq >> (b % 4), 2) for b in range(s.batch)])
    real = torch.arange(s.seq)[None, :] < lengths[:, None]
    keep = (real[:, :, None] & real[:, None, :] & torch.ones(s.seq, s.seq, dtype=torch.bool).tril())[:, None]
    mask = keep if s.mask == "bool" else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    return leaves, {**kwargs, "attn_mask": mask.to(device)}


def observe(s: Setting, device: str | torch.device) -> dict[str, Any]:
    """One forward+backward of `s` under the profiler: the dispatcher's choice, the backends that ran
    (by aten op) and the attention kernels launched."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    leaves, kwargs = _inputs(s, device)
    fused_kwargs = {k: v for k, v in kwargs.items() if k in ("attn_mask", "is_causal", "enable_gqa")}
    choice = int(torch._fused_sdp_choice(*leaves, **fused_kwargs))
    names = {int(b.value): name for name, b in torch.nn.attention.SDPBackend.__members__.items()}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        out = F.scaled_dot_product_attention(*leaves, **kwargs)
        out.backward(torch.ones_like(out))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    ops = {e.name for e in prof.events()}
    kernels = sorted(
        {
            e.name[:160]
            for e in prof.events()
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
            and any(h in e.name.lower() for h in KERNEL_HINTS)
        }
    )
    return {**asdict(s), "dispatcher_choice": names.get(choice, str(choice)), **backends_of(ops), "kernels": kernels}


def study(device: str | torch.device, settings: Iterable[Setting] = SETTINGS) -> dict[str, Any]:
    """`observe` for every setting, with the versions that decide the dispatch."""
    if torch.are_deterministic_algorithms_enabled():
        raise RuntimeError("study(): turn deterministic algorithms off first; torch refuses cuDNN SDPA under them.")
    device = torch.device(device)
    versions: dict[str, Any] = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    if device.type == "cuda":
        versions |= {"gpu": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device))}
    return {**versions, "settings": [observe(s, device) for s in settings]}


def main(argv: list[str] | None = None) -> int:
    from varlen_workbench.workbench.records import write_record

    parser = argparse.ArgumentParser(
        prog="python -m varlen_workbench.workbench.instruments.sdpa_dispatch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--record", metavar="FILE", help="write the study with provenance as JSON")
    args = parser.parse_args(argv)
    found = study(args.device)
    for row in found["settings"]:
        print(f"{row['name']:36s} dispatcher {row['dispatcher_choice']:20s} ran fwd {row['forward']} / bwd {row['backward']}")
    if args.record:
        write_record(args.record, found)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
