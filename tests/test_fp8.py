"""Blockwise FP8: the Triton quantizer against torch's e4m3 cast, and the FP8 attention forward."""

from __future__ import annotations

import pytest
import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.postmortems.te_thd_2892.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Blockwise,
    quantize_fp8_blockwise,
    quantize_reference,
    varlen_attention_fp8,
)
from varlen_workbench.workbench.layout import Case, Fill, Region, cumulative, pack
from varlen_workbench.workbench.reference import reference_attention


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as numbers (NaN equals NaN, -0 equals 0)."""
    a, b = a.float(), b.float()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_torch_has_e4m3_on_cpu():
    x = torch.tensor([0.3, -1.7, 448.0, 2.0**-9])
    assert torch.equal(x.to(FP8).float(), torch.tensor([0.3125, -1.75, 448.0, 2.0**-9]))


def test_rounding_matches_torch_over_the_whole_e4m3_range():
    # One block, one head: amax 448 gives scale 1, so the data are x rounded to e4m3.
    x = torch.cat([torch.linspace(-448, 448, 4096), torch.randn(4096) * 3, torch.randn(8192) * 0.01])
    x[0] = 448.0
    x = x.view(-1, 1, 16).to(default_device())
    cu = cumulative([x.shape[0]], x.device)
    got = quantize_fp8_blockwise(x, cu, block=128 if x.shape[0] % 128 == 0 else 16)
    ref = quantize_reference(x, cu, block=got.block)
    assert torch.equal(got.scale, ref.scale) and same_values(got.data, ref.data)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fill", [Fill.NAN, Fill.HUGE, Fill.GARBAGE])
def test_real_row_scales_match_torch_and_ignore_padding(dtype, fill):
    batch = pack(
        Case((20, 5, 13), padded_q=(24, 16, 13), tail_q=7, heads=2, head_dim=16, dtype=dtype, fill=fill), requires_grad=False
    )
    got = quantize_fp8_blockwise(batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded)
    ref = quantize_reference(batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded)
    assert got.data.dtype == FP8 and got.scale.shape == (-(-batch.q.shape[0] // 16), 2)
    assert torch.equal(got.scale, ref.scale) and same_values(got.data, ref.data)
    assert torch.isfinite(got.scale).all() and (got.scale < 4 / FP8_MAX * 2).all()  # real rows are ~N(0, 1)
    assert (got.data.float()[batch.regions_q != Region.REAL] == 0).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # numpy, inside the interpreter
def test_all_row_scales_are_poisoned_by_one_padding_row():
    batch = pack(Case((20, 13), align=16, heads=1, head_dim=16, fill=Fill.NAN), requires_grad=False)
    got = quantize_fp8_blockwise(batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded, scales_from="all")
    ref = quantize_reference(batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded, scales_from="all")
    assert same_values(got.scale, ref.scale)
    blocks_with_padding = [1, 2]  # rows 16-31 (4 real + 12 padding), 32-47 (13 + 3); block 0 is all real
    assert torch.isnan(got.scale[blocks_with_padding]).all() and torch.isfinite(got.scale[0]).all()


@pytest.mark.parametrize(
    "case",
    [
        Case((20, 13, 30), align=16, heads=2, head_dim=32, causal=True, fill=Fill.NAN),
        Case(
            (9, 17),
            seqlens_k=(12, 5),
            padded_k=(16, 8),
            tail_q=3,
            heads=4,
            kv_heads=2,
            head_dim=16,
            causal=True,
            fill=Fill.POS_INF,
        ),
        Case((14, 21), seqlens_k=(9, 25), align=8, heads=2, head_dim=16, window=(3, 2), fill=Fill.NAN),
    ],
    ids=["aligned-causal", "gqa-cross-tail", "window"],
)
def test_fp8_attention_computes_on_the_dequantized_values(case):
    batch = pack(case, requires_grad=False)
    q, k, v = (
        quantize_fp8_blockwise(x, cu, pad)
        for x, cu, pad in (
            (batch.q, batch.cu_seqlens_q, batch.cu_seqlens_q_padded),
            (batch.k, batch.cu_seqlens_k, batch.cu_seqlens_k_padded),
            (batch.v, batch.cu_seqlens_k, batch.cu_seqlens_k_padded),
        )
    )
    out = varlen_attention_fp8(q, k, v, *batch.args()[3:], **batch.kwargs(), out_dtype=torch.float32)
    expected = reference_attention(q.dequantize(), k.dequantize(), v.dequantize(), *batch.args()[3:], **batch.kwargs())
    real = batch.regions_q == Region.REAL
    # fp32 accumulation (TF32 for P @ V natively): far below FP8's own 2^-4 rounding.
    assert (out.double() - expected)[real].abs().max() <= 2e-3 * expected.abs().max()
    assert (out[~real] == 0).all()


def test_fp8_arguments_are_checked():
    batch = pack(Case((16,), heads=1, head_dim=16), requires_grad=False)
    cu = batch.cu_seqlens_q
    with pytest.raises(ValueError, match="scales_from = 'max' must be one of"):
        quantize_fp8_blockwise(batch.q, cu, scales_from="max")
    with pytest.raises(ValueError, match="block = 8 rows per scale must be one of"):
        quantize_fp8_blockwise(batch.q, cu, block=8)
    with pytest.raises(ValueError, match="head_dim 12 is not supported"):
        quantize_fp8_blockwise(torch.zeros(16, 1, 12, device=cu.device), cu)
    with pytest.raises(ValueError, match="exceeds q.shape"):
        quantize_fp8_blockwise(batch.q[:8], cu)
    x = quantize_fp8_blockwise(batch.q, cu)
    with pytest.raises(TypeError, match="k must be an Fp8Blockwise"):
        varlen_attention_fp8(x, batch.k, x, cu, cu, 16, 16)
    with pytest.raises(ValueError, match="same block size"):
        varlen_attention_fp8(x, x, Fp8Blockwise(x.data, x.scale, 32), cu, cu, 16, 16)
    wide_v = quantize_fp8_blockwise(torch.zeros(16, 1, 32, device=cu.device), cu)  # one head dim for q, k and v here
    with pytest.raises(ValueError, match="v has head_dim 32 but q and k have 16; this implementation takes one head dim"):
        varlen_attention_fp8(x, x, wide_v, cu, cu, 16, 16)
