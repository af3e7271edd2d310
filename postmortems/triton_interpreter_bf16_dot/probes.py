"""The post-mortem's probes of Triton's interpreter, beside the detector our kernels consult
(`varlen_workbench.kernels.interpreter`): `tl.sum` with a NaN, the attention forward a user's
reproduction would write (one block per sequence, two `tl.dot`s), what the 16x16 dot becomes
compiled for a GPU (no GPU needed), the bit-pattern mechanism, and the whole answer as JSON:

    WORKBENCH_DEVICE=cpu python -m varlen_workbench.postmortems.triton_interpreter_bf16_dot.probes
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import asdict, dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.contract import check_scale, check_varlen_inputs, check_window_size
from varlen_workbench.kernels.interpreter import (
    BLOCK,
    DOT_DTYPES,
    DotCheck,
    bf16_dot_is_broken,
    check_dot,
    dot_kernel,
    dot_operands,
    dtype_name,
    run_compiling_child,
    triton_dot,
)
from varlen_workbench.kernels.runtime import interpreted, jit, triton_library_interpreted

HOPPER = 90  # compute capability of the GPU machine (H200)


@jit
def _sum_kernel(x_ptr, out_ptr, N: tl.constexpr):
    tl.store(out_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, N)), axis=0))


def triton_sum_with_nan(dtype: torch.dtype, device: torch.device | str | None = None) -> float:
    """`tl.sum` of [NaN, 2, 3, ..., 16] in `dtype` on `device` (default: `default_device()`),
    interpreted or compiled as kernels run there: NaN when the sum propagates NaN, as it must.
    triton#11604: the interpreter sums bf16's raw uint16 bit patterns, and the NaN is lost."""
    device = default_device() if device is None else torch.device(device)
    x = torch.arange(1, BLOCK + 1, dtype=torch.float32)
    x[0] = float("nan")
    out = torch.zeros(1, dtype=dtype, device=device)
    _sum_kernel[(1,)](x.to(dtype).to(device), out, N=BLOCK)
    return float(out.float().cpu()[0])


# A whole sequence fits in one block: enough for the reproduction, small enough for the interpreter.
SINGLE_BLOCK_MAX_SEQLEN = 128


@jit
def _single_block_attention_kernel(
    Q,
    K,
    V,
    Out,
    cu_q,
    cu_k,
    cu_q_padded,
    cu_k_padded,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_q_padded + seq)
    k_start = tl.load(cu_k_padded + seq)
    len_q = tl.load(cu_q + seq + 1) - tl.load(cu_q + seq)
    len_k = tl.load(cu_k + seq + 1) - tl.load(cu_k + seq)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=(rows < len_q)[:, None], other=0.0
    )
    kv_offsets = (k_start + cols)[:, None] * stride_kt + (head // GROUP) * stride_kh + dims[None, :]
    k = tl.load(K + kv_offsets, mask=(cols < len_k)[:, None], other=0.0)
    v = tl.load(
        V + (k_start + cols)[:, None] * stride_vt + (head // GROUP) * stride_vh + dims[None, :],
        mask=(cols < len_k)[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    visible = (rows[:, None] < len_q) & (cols[None, :] < len_k)
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + (len_k - len_q))
    s = tl.where(visible, tl.dot(q, tl.trans(k), input_precision="ieee") * scale, float("-inf"))
    row_max = tl.max(s, axis=1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row with no visible key
    p = tl.exp(s - row_max[:, None])
    total = tl.sum(p, axis=1)
    out = tl.dot(p.to(v.dtype), v, input_precision="ieee") / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=(rows < len_q)[:, None],
    )


def single_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_k_padded: torch.Tensor | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """Forward-only varlen attention as a user's reproduction would write it: one program per
    (sequence, head), the whole sequence in one block, plain softmax, two `tl.dot`s.

    With `upcast=False` (the default, like most Triton attention kernels) it meets the
    interpreter's bf16 bug head on; `upcast=True` applies our workaround. Same contract and
    signature as `varlen_workbench.kernels.varlen.varlen_attention` (padding rows of the output are 0), forward only,
    sequences up to `SINGLE_BLOCK_MAX_SEQLEN` tokens, no sliding window (any other
    `window_size` than (-1, -1) is refused).
    """
    if check_window_size(window_size) != (-1, -1):
        raise ValueError(
            f"window_size = {tuple(window_size)}: single_block_attention reproduces a kernel without sliding "
            "windows; pass (-1, -1), or use varlen_workbench.kernels.varlen.varlen_attention(..., window_size=...) for a window."
        )
    shape = check_varlen_inputs(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_k_padded=cu_seqlens_k_padded,
        scale=scale,
        dtypes=DOT_DTYPES,
        head_dims=(16, 32, 64),
        separate_v_head_dim=False,
    )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if n > SINGLE_BLOCK_MAX_SEQLEN:
            raise ValueError(
                f"{name} = {n} exceeds SINGLE_BLOCK_MAX_SEQLEN = {SINGLE_BLOCK_MAX_SEQLEN}: this "
                "reproduction holds a whole sequence in one block; use varlen_workbench.kernels.varlen.varlen_attention."
            )
    q, k, v = (t.contiguous() for t in (q, k, v))  # the kernel assumes unit stride in head_dim
    out = torch.zeros_like(q)
    block_m = max(BLOCK, triton.next_power_of_2(max_seqlen_q))
    block_n = max(BLOCK, triton.next_power_of_2(max_seqlen_k))
    _single_block_attention_kernel[(cu_seqlens_q.numel() - 1, shape.heads)](
        q,
        k,
        v,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded,
        cu_seqlens_k if cu_seqlens_k_padded is None else cu_seqlens_k_padded,
        check_scale(scale, shape.head_dim),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=shape.heads // shape.kv_heads,
        CAUSAL=causal,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=shape.head_dim,
        UPCAST=upcast,
    )
    return out


@dataclass(frozen=True)
class NativeDot:
    """What the 16x16 dot kernel becomes when compiled for a GPU (compiling needs no GPU)."""

    arch: int
    upcast: bool
    dot: str  # the tt.dot of the Triton IR, with its operand types
    conversions: int  # arith.extf (widening) ops in the Triton IR
    mma: tuple[str, ...]  # distinct tensor-core instructions in the PTX
    fma: int  # scalar fp32 fused multiply-adds in the PTX (what a dot without tensor cores costs)

    @property
    def operand_type(self) -> str:
        """Element type of tl.dot's operands, e.g. 'bf16' or 'f32'."""
        return self.dot.split(": tensor<")[1].split(">")[0].split("x")[-1]


def _compile_dot(upcast: bool, arch: int) -> NativeDot:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    signature = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "N": "constexpr", "UPCAST": "constexpr"}
    source = ASTSource(JITFunction(dot_kernel.fn), signature=signature, constexprs={"N": BLOCK, "UPCAST": upcast})
    asm = triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm
    ttir = [line.strip() for line in asm["ttir"].splitlines()]
    dots = [line.split(" loc(")[0] for line in ttir if "tt.dot" in line]
    opcodes = [line.split()[0] for line in asm["ptx"].splitlines() if line.strip()]
    mma = tuple(dict.fromkeys(op for op in opcodes if "mma" in op))
    fma = sum(op.startswith("fma.") and op.endswith(".f32") for op in opcodes)
    return NativeDot(arch, upcast, dots[0], sum("arith.extf" in line for line in ttir), mma, fma)


@functools.cache
def native_dots(arch: int = HOPPER) -> dict[bool, NativeDot]:
    """The bf16 16x16 dot kernel compiled for CUDA `arch` with the upcast flag off and on.

    It shows what the flag costs natively: off, the branch is gone from the IR and bf16 goes to
    the tensor cores as it is. Compiling needs no GPU, and runs in this process, even after
    interpreted launches (kernels/runtime.py restores what they patch), unless Triton's own
    library was decorated for the interpreter (TRITON_INTERPRET=1): then in a child process.
    Uses the `ASTSource` API of Triton 3.6.
    """
    if triton_library_interpreted():
        rows = run_compiling_child(__name__, ["--native-dots", str(arch)])
        return {row["upcast"]: NativeDot(**row | {"mma": tuple(row["mma"])}) for row in rows}
    return {flag: _compile_dot(flag, arch) for flag in (False, True)}


def bit_pattern_product(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """What the interpreter computes for a bf16 `tl.dot`: numpy's float32 matmul of the raw uint16
    bit patterns (bf16 1.0 is 0x3F80 = 16256, so products land near 16256**2 * 16 ~ 4e9)."""
    bits = [x.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16) for x in (a, b)]
    return np.matmul(*bits, dtype=np.float32)


def bit_pattern_gap() -> float:
    """max |interpreted bf16 tl.dot - bit_pattern_product|: 0.0 exactly when that is the mechanism.
    The dot runs on CPU tensors, so through the interpreter, on any machine."""
    a, b = dot_operands(torch.bfloat16, "cpu")
    return float(np.abs(triton_dot(a, b).numpy() - bit_pattern_product(a, b)).max())


def _row(check: DotCheck) -> dict:
    return asdict(check) | {"relative": check.relative, "correct": check.correct}


def report(device: torch.device | str | None = None) -> dict:
    """The answer on `device` (default: `default_device()`), JSON-ready: Triton version, mode,
    each dtype's dot, the workaround, the mechanism check (interpreter only) and the detector's
    verdict. `report("cpu")` is the interpreter's, on any machine."""
    device = default_device() if device is None else torch.device(device)
    return {
        "triton": triton.__version__,
        "interpreted": interpreted(device),
        "device": str(device),
        "checks": {dtype_name(d): _row(check_dot(d, device)) for d in DOT_DTYPES},
        "workaround": _row(check_dot("bfloat16", device, upcast=True)),
        "bit_pattern_gap": bit_pattern_gap() if interpreted(device) else None,
        "bf16_dot_is_broken": bf16_dot_is_broken(device),
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--native-dots"]:  # the child process of `native_dots`
        print(json.dumps([asdict(d) for d in native_dots(int(sys.argv[2])).values()]))
    else:
        print(json.dumps(report(), indent=1))
