"""What each candidate tile costs on a GPU, found by compiling without one: registers, spills,
shared memory. This is how `tuner.NATIVE_TILES` was chosen: a tile that spills or overflows
shared memory is slow or fails, and compiling tells so for free, before any GPU time is spent.

    python -m varlen_workbench.kernels.varlen.tiles [--arch 90] [--head-dims 64 128] [--head-dim-v 128] [--dtype bfloat16]

prints one JSON row per (kernel, head_dim, mask, tile), the mask being none, causal or
sliding (a left and a right bound); `--head-dim-v` gives v another head dim than q and k
(DeepSeek-style 192/128). Compiling needs no GPU; a process whose Triton library is
interpreted (TRITON_INTERPRET=1) compiles in a child process (`resource_table`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile

import torch

from varlen_workbench.kernels.interpreter import run_compiling_child
from varlen_workbench.kernels.runtime import triton_library_interpreted
from varlen_workbench.kernels.varlen.hopper import DEFAULT_FORWARD, ForwardConfig
from varlen_workbench.kernels.varlen.launch import lanes, native_tiles
from varlen_workbench.kernels.varlen.tuner import Tile

HOPPER = 90
SHARED_LIMIT = 227 * 1024  # bytes a Hopper block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin)

_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_FP32_POINTERS = {"Lse", "Delta", "DLse"}
_FLOATS = {"qk_scale", "scale"}


def _signature(fn, dtype: torch.dtype, constexprs: dict) -> tuple[dict, dict]:
    """Triton types of the kernel's arguments, and the 16-divisibility hints a launch on
    torch-allocated tensors gets: every pointer, and every stride but lse's (its row count)."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _FLOATS:
            signature[name] = "fp32"
        elif name[0].isupper():
            signature[name] = "*fp32" if name in _FP32_POINTERS else "*" + _TRITON_TYPES[dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("cu_") or name in ("block_starts", "order"):
            signature[name] = "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name.startswith("stride_") and name != "stride_lh":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


MASKS = {"none": (False, False), "causal": (False, True), "sliding": (True, True)}  # (WINDOW_LEFT, WINDOW_RIGHT)


def compile_tile(
    kernel: str,
    tile: Tile,
    head_dim: int,
    dtype: torch.dtype,
    mask: str,
    arch: int = HOPPER,
    config: ForwardConfig = DEFAULT_FORWARD,
    head_dim_v: int | None = None,
) -> dict:
    """Compiles one kernel with one tile and mask (a key of MASKS) for CUDA `arch`, the forward
    kernel with `config`'s switches, v of `head_dim_v` (None: `head_dim`); returns its resource use."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile

    from varlen_workbench.kernels.varlen.backward_kernels import attention_backward_dkdv_kernel, attention_backward_dq_kernel
    from varlen_workbench.kernels.varlen.forward_kernels import attention_forward_kernel

    fn = {
        "forward": attention_forward_kernel,
        "dkdv": attention_backward_dkdv_kernel,
        "dq": attention_backward_dq_kernel,
    }[kernel]
    left, right = MASKS[mask]
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    constexprs = {
        "GROUP": 1,
        "WINDOW_LEFT": left,
        "WINDOW_RIGHT": right,
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "BLOCK_D": lanes(head_dim),
        "BLOCK_DV": lanes(head_dim_v),
        "DOT_UPCAST": False,
        **({"HAS_DLSE": False} if kernel == "dq" else {}),
        **(
            {
                "DESCRIPTORS": config.descriptors,
                "WARP_SPECIALIZE": config.warp_specialize,
                "PERSISTENT": config.persistent,
                "N_HEADS": 16,
            }
            if kernel == "forward"
            else {}
        ),
    }
    signature, attrs = _signature(fn, dtype, constexprs)
    target = GPUTarget("cuda", arch, 32)
    options = make_backend(target).parse_options({"num_warps": tile.num_warps, "num_stages": tile.num_stages})
    compiled = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        log = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", ptx.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    if spills is None or regs is None:
        raise RuntimeError(f"ptxas's verbose output for the {kernel} kernel has no register or spill line:\n{log[-2000:]}")
    return {
        "kernel": kernel,
        "head_dim": head_dim,
        "head_dim_v": head_dim_v,
        "dtype": str(dtype).removeprefix("torch."),
        "mask": mask,
        "tile": str(tile),
        "regs": int(regs.group(1)),
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
        "shared": compiled.metadata.shared,
        "fits": compiled.metadata.shared <= SHARED_LIMIT,
        "wgmma": "wgmma" in compiled.asm["ptx"],
    }


def resource_table(
    head_dims=(64, 128),
    dtype: torch.dtype = torch.bfloat16,
    arch: int = HOPPER,
    kernels=("forward", "dkdv", "dq"),
    head_dim_v: int | None = None,
) -> list[dict]:
    """compile_tile for every native candidate (`launch.native_tiles`) at these head dims, v of
    `head_dim_v` (None: each one's own), under every mask."""
    if triton_library_interpreted():
        args = [
            "--arch",
            str(arch),
            "--dtype",
            str(dtype).removeprefix("torch."),
            "--head-dims",
            *map(str, head_dims),
            "--kernels",
            *kernels,
            *(["--head-dim-v", str(head_dim_v)] if head_dim_v is not None else []),
        ]
        return run_compiling_child(
            "varlen_workbench.kernels.varlen.tiles", args, timeout=1800
        )  # not __name__: "__main__" under -m
    rows = []
    for kernel in kernels:
        for head_dim in head_dims:
            for tile in native_tiles(kernel, head_dim, dtype, head_dim_v):
                for mask in MASKS:
                    rows.append(compile_tile(kernel, tile, head_dim, dtype, mask, arch, head_dim_v=head_dim_v))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m varlen_workbench.kernels.varlen.tiles", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=HOPPER)
    parser.add_argument("--dtype", default="bfloat16", choices=[str(t).removeprefix("torch.") for t in _TRITON_TYPES])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], help="q's and k's head dims")
    parser.add_argument("--head-dim-v", type=int, default=None, help="v's head dim (default: q's and k's)")
    parser.add_argument("--kernels", nargs="+", default=["forward", "dkdv", "dq"])
    args = parser.parse_args(argv)
    rows = resource_table(tuple(args.head_dims), getattr(torch, args.dtype), args.arch, tuple(args.kernels), args.head_dim_v)
    json.dump(rows, sys.stdout, indent=None)


if __name__ == "__main__":
    main()
