"""Blockwise FP8 (e4m3) for packed THD attention: quantization with scales from REAL rows, and
a varlen attention forward that consumes the quantized q, k, v.

Blockwise scaling gives every (block of `block` consecutive rows, head) one scale,
`amax / 448` (448 = largest e4m3 value). In a padded THD layout a block can hold padding rows,
and padding holds anything: zeros, stale activations, NaN. Taking the amax over every row lets
one such row poison the block: NaN makes every real token of the block NaN, a huge value makes
the scale so large that real tokens round to zero. `quantize_fp8_blockwise` takes the amax over
REAL rows only (the layout is read from the boundaries in the kernel, no host sync) and writes
padding rows as 0; `scales_from="all"` keeps the naive amax to show the failure.

`varlen_attention_fp8` dequantizes in the kernel: QK^T is one fp16 `tl.dot` of the e4m3 values
(exact in fp16) rescaled by the row scales afterwards; V is dequantized to fp32 before P @ V,
because its scale varies along the contracted dimension. Forward only, no lse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from varlen_workbench.kernels.contract import check_causal, check_cu_seqlens, check_scale, check_varlen_tensors, check_window_size
from varlen_workbench.kernels.runtime import jit
from varlen_workbench.kernels.varlen.launch import Window

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALES_FROM = ("real", "all")
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)
BLOCKS = (16, 32, 64, 128)  # rows per scale: tl.dot needs >= 16


@dataclass(frozen=True)
class Fp8Blockwise:
    """A THD tensor in e4m3 with one float32 scale per (block of rows, head): x ~ data * scale."""

    data: torch.Tensor  # (T, H, D) float8_e4m3fn; padding rows 0 when scales come from real rows
    scale: torch.Tensor  # (cdiv(T, block), H) float32
    block: int

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The values the FP8 path computes with, in `dtype` (PyTorch, for references)."""
        rows = self.scale.to(dtype).repeat_interleave(self.block, dim=0)[: self.data.shape[0]]
        return self.data.to(dtype) * rows[:, :, None]


@jit
def _sequence_of_rows(rows, cu, cu_padded, BATCH: tl.constexpr, BATCH_POW2: tl.constexpr):
    """For each row: its sequence (BATCH for TAIL rows) and whether it is a REAL row."""
    seqs = tl.arange(0, BATCH_POW2)
    ends = tl.load(cu_padded + 1 + seqs, mask=seqs < BATCH, other=2147483647)
    owner = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)  # sequences ending at or before the row
    inside = owner < BATCH
    start = tl.load(cu_padded + owner, mask=inside, other=0)
    length = tl.load(cu + owner + 1, mask=inside, other=0) - tl.load(cu + owner, mask=inside, other=0)
    return inside & (rows - start < length)


@jit
def _round_to_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32.

    The cast to float8 is then exact. Triton 3.6's interpreter rounds fp32 -> fp8 wrongly
    (the round-up bit is added after masking, so 124.3 becomes 64, not 128; ties go up):
    see `plain_cast_e4m3`. Rounding here is right on every backend.
    """
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # below 2^-6 e4m3 is subnormal: a fixed step of 2^-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    t = y / step  # exact: step is a power of two
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r % 2 != 0), r - 1.0, r)  # a tie goes to the even neighbour
    return r * step


@jit
def _quantize_kernel(
    X,
    Out,
    Scale,
    cu,
    cu_padded,
    total,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    BATCH: tl.constexpr,
    BATCH_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    REAL_ONLY: tl.constexpr,
):
    block, head = tl.program_id(0), tl.program_id(1)
    rows = block * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    in_bounds = rows < total
    x = tl.load(X + rows[:, None] * stride_xt + head * stride_xh + dims[None, :], mask=in_bounds[:, None], other=0.0).to(
        tl.float32
    )
    if REAL_ONLY:
        keep = _sequence_of_rows(rows, cu, cu_padded, BATCH, BATCH_POW2) & in_bounds
        x = tl.where(keep[:, None], x, 0.0)  # padding never reaches the amax nor the output
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)  # an all-zero block keeps scale 1, not 0/0
    # amax propagates NaN (torch.amax does); tl.max may not, natively: count NaNs explicitly.
    scale = tl.where(tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0) > 0, float("nan"), scale)
    q = _round_to_e4m3(tl.clamp(x / scale, -448.0, 448.0))  # x / scale may round a hair past 448
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + dims[None, :], q.to(tl.float8e4nv), mask=in_bounds[:, None])
    tl.store(Scale + block * tl.num_programs(1) + head, scale)


@jit
def _plain_cast_kernel(X, Out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + offs, tl.load(X + offs, mask=offs < n).to(tl.float8e4nv), mask=offs < n)


def plain_cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 by Triton's own cast (`x.to(tl.float8e4nv)`), no rounding of ours.

    Natively this rounds to nearest even, like torch's cast. Under Triton 3.6's interpreter it
    does not: a mantissa carry is lost (124.3 -> 64, torch: 128) and ties round up (17 -> 18,
    torch: 16). `quantize_fp8_blockwise` rounds explicitly (`_round_to_e4m3`) because of it.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32 (the cast under study is fp32 -> e4m3), got {x.dtype}.")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    if x.numel():
        _plain_cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def quantize_reference(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    block: int = 16,
    scales_from: str = "real",
) -> Fp8Blockwise:
    """`quantize_fp8_blockwise` in PyTorch (torch's own e4m3 cast): the kernel's test reference."""
    real = torch.ones(x.shape[0], dtype=torch.bool)
    if scales_from == "real":
        bounds = cu_seqlens.tolist()
        starts = bounds if cu_seqlens_padded is None else cu_seqlens_padded.tolist()
        real = torch.zeros(x.shape[0], dtype=torch.bool)
        for start, begin, end in zip(starts, bounds, bounds[1:]):
            real[start : start + end - begin] = True
    x = x.float().masked_fill(~real.to(x.device)[:, None, None], 0.0)
    blocks = -(-x.shape[0] // block)
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, blocks * block - x.shape[0]))
    amax = padded.abs().view(blocks, block, *x.shape[1:]).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).where(~amax.isnan(), amax)
    per_row = scale.repeat_interleave(block, dim=0)[: x.shape[0]]
    data = (x / per_row[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Blockwise(data, scale, block)


def _check_layout(x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None, block: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype not in INPUT_DTYPES:
        raise ValueError(
            f"x must be a (tokens, heads, head_dim) tensor of {', '.join(map(str, INPUT_DTYPES))}; got "
            f"{type(x).__name__ if not isinstance(x, torch.Tensor) else f'{x.dtype} {tuple(x.shape)}'}."
        )
    if x.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head_dim {x.shape[-1]} is not supported; supported head dims are {HEAD_DIMS}.")
    if block not in BLOCKS:
        raise ValueError(f"block = {block} rows per scale must be one of {BLOCKS}.")
    longest = int(cu_seqlens.diff().max()) if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.numel() > 1 else 0
    check_cu_seqlens(
        cu_seqlens,
        cu_seqlens,
        longest,
        longest,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_k_padded=cu_seqlens_padded,
        total_q=x.shape[0],
        total_k=x.shape[0],
        device=x.device,
    )


def quantize_fp8_blockwise(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    block: int = 16,
    scales_from: str = "real",
) -> Fp8Blockwise:
    """Quantizes a padded THD tensor to e4m3 with one scale per (block of `block` rows, head).

    `scales_from="real"` (the fix): amax over REAL rows only, padding rows written as 0.
    `scales_from="all"` (the naive recipe): amax over every row of the block, padding included.
    Blocks are `block` consecutive rows of the tensor; aligning sequences to `block` rows (FP8
    alignment padding) keeps sequences from sharing a block, but padding rows then share it.
    """
    if scales_from not in SCALES_FROM:
        raise ValueError(f"scales_from = {scales_from!r} must be one of {SCALES_FROM} ('real' is the fix).")
    _check_layout(x, cu_seqlens, cu_seqlens_padded, block)
    total, heads, head_dim = x.shape
    data = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty((triton.cdiv(total, block), heads), dtype=torch.float32, device=x.device)
    batch = cu_seqlens.numel() - 1
    if total:
        _quantize_kernel[(scale.shape[0], heads)](
            x,
            data,
            scale,
            cu_seqlens,
            cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded,
            total,
            x.stride(0),
            x.stride(1),
            data.stride(0),
            data.stride(1),
            BATCH=batch,
            BATCH_POW2=triton.next_power_of_2(batch),
            BLOCK=block,
            HEAD_DIM=head_dim,
            REAL_ONLY=scales_from == "real",
        )
    return Fp8Blockwise(data, scale, block)


@jit
def _attention_fp8_kernel(
    Q,
    K,
    V,
    SQ,
    SK,
    SV,
    Out,
    cu_q,
    cu_k,
    cu_q_padded,
    cu_k_padded,
    softmax_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_sq,
    stride_sk,
    window_left,
    window_right,
    GROUP: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    tile, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP
    len_q = tl.load(cu_q + seq + 1) - tl.load(cu_q + seq)
    len_k = tl.load(cu_k + seq + 1) - tl.load(cu_k + seq)
    if tile * BLOCK_M >= len_q:
        return
    q_start = tl.load(cu_q_padded + seq)
    k_start = tl.load(cu_k_padded + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < len_q
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    # Scales of the rows' blocks, with the softmax scale and log2(e) folded in (exp2 below).
    sq = tl.load(SQ + ((q_start + rows) // Q_BLOCK) * stride_sq + head, mask=row_ok, other=0.0) * (
        softmax_scale * 1.4426950408889634
    )
    q = q.to(tl.float16)  # every e4m3 value is exact in fp16: the dot is exact up to fp32 accumulation
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    end = len_k
    if WINDOW_RIGHT:  # bottom-right aligned: query row r sees keys <= r + len_k - len_q + right
        end = tl.minimum(len_k, tl.maximum((tile + 1) * BLOCK_M + len_k - len_q + window_right, 0))
    for start in range(0, end, BLOCK_N):
        keys = start + cols
        key_ok = keys < len_k
        k_rows = k_start + keys
        k = tl.load(K + k_rows[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(V + k_rows[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=key_ok[:, None], other=0.0)
        sk = tl.load(SK + (k_rows // K_BLOCK) * stride_sk + kv_head, mask=key_ok, other=0.0)
        sv = tl.load(SV + (k_rows // K_BLOCK) * stride_sk + kv_head, mask=key_ok, other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float16))) * sq[:, None] * sk[None, :]
        visible = row_ok[:, None] & key_ok[None, :]
        if WINDOW_RIGHT:
            visible = visible & (keys[None, :] <= rows[:, None] + (len_k - len_q) + window_right)
        if WINDOW_LEFT:
            visible = visible & (keys[None, :] >= rows[:, None] + (len_k - len_q) - window_left)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = v.to(tl.float32) * sv[:, None]  # V's scale varies along the contracted rows: dequantize first
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]  # no visible key: 0, never NaN
    tl.store(
        Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )


def varlen_attention_fp8(
    q: Fp8Blockwise,
    k: Fp8Blockwise,
    v: Fp8Blockwise,
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
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Varlen attention forward on blockwise-FP8 q, k, v (the padding contract's semantics,
    `causal` and `window_size` as in `varlen_workbench.kernels.varlen.varlen_attention`).

    Output: (T_q, H, D) in `out_dtype`, padding rows exactly 0, REAL rows computed from the
    dequantized values. k and v must share the block size and their scales' shape.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Fp8Blockwise):
            raise TypeError(
                f"{name} must be an Fp8Blockwise (from varlen_workbench.postmortems.te_thd_2892.fp8.quantize_fp8_blockwise), got {type(t).__name__}."
            )
    if k.block != v.block or k.scale.shape != v.scale.shape:
        raise ValueError(f"k and v must be quantized with the same block size, got {k.block} and {v.block}.")
    if out_dtype not in INPUT_DTYPES:
        raise ValueError(f"out_dtype = {out_dtype} must be one of {INPUT_DTYPES}.")
    window = Window.of(check_causal(causal), *check_window_size(window_size))
    # One head dim for q, k and v, a power of two (its own list: the kernel has no masked lanes).
    shape = check_varlen_tensors(q.data, k.data, v.data, dtypes=(FP8,), head_dims=HEAD_DIMS, separate_v_head_dim=False)
    check_cu_seqlens(
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_k_padded=cu_seqlens_k_padded,
        total_q=shape.total_q,
        total_k=shape.total_k,
        device=q.data.device,
    )
    out = torch.zeros(q.data.shape, dtype=out_dtype, device=q.data.device)  # padding rows stay 0
    block_m = block_n = 16 if max(max_seqlen_q, max_seqlen_k) <= 16 else 32
    grid = (triton.cdiv(max(max_seqlen_q, 1), block_m), cu_seqlens_q.numel() - 1, shape.heads)
    _attention_fp8_kernel[grid](
        q.data,
        k.data,
        v.data,
        q.scale,
        k.scale,
        v.scale,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded,
        cu_seqlens_k if cu_seqlens_k_padded is None else cu_seqlens_k_padded,
        check_scale(scale, shape.head_dim),
        q.data.stride(0),
        q.data.stride(1),
        k.data.stride(0),
        k.data.stride(1),
        v.data.stride(0),
        v.data.stride(1),
        out.stride(0),
        out.stride(1),
        q.scale.stride(0),
        k.scale.stride(0),
        *window.kernel_args(),
        GROUP=shape.heads // shape.kv_heads,
        **window.constexprs(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=shape.head_dim,
        Q_BLOCK=q.block,
        K_BLOCK=k.block,
    )
    return out
