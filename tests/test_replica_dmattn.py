"""The flash-dmattn Triton replica: correct where upstream is, NaN exactly where upstream is, and the two fixes."""

import math

import numpy as np
import pytest
import torch
import triton.language as tl

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.replicas.dmattn import (
    dmattn_backward,
    isfinite_exists,
    launch_patch_as_written,
    triton_dmattn_func,
)
from varlen_workbench.kernels.replicas.dmattn_kernels import _finite_or_zero
from varlen_workbench.kernels.runtime import jit
from varlen_workbench.postmortems.flash_dmattn_121 import dense_reference
from varlen_workbench.workbench.bounds import error_check
from varlen_workbench.workbench.instruments.poison import poisoned_memory

DEVICE = default_device()  # CUDA where there is one (compiled), else the CPU (interpreted)


def _inputs(batch=1, seqlen_q=48, seqlen_k=None, heads=1, kv_heads=None, head_dim=16, dtype=torch.float16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    kv_heads = heads if kv_heads is None else kv_heads
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    d_out = torch.randn(q.shape, generator=generator).to(dtype)
    return tuple(t.to(DEVICE) for t in (q, k, v, d_out))


def _grads(fn, q, k, v, d_out, mask=None, bias=None, causal=False, **kwargs):
    """Forward and backward on DEVICE; every result back on the CPU for the assertions."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    mask = None if mask is None else mask.to(DEVICE)
    bias = None if bias is None else bias.detach().to(DEVICE).requires_grad_()
    with np.errstate(invalid="ignore", divide="ignore"):
        out, lse = fn(*leaves, mask, bias, causal, **kwargs)
        out.backward(d_out.to(out.dtype))
    grads = {"out": out.detach(), "lse": lse.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if bias is not None:
        grads["dbias"] = bias.grad
    return {name: t.cpu() for name, t in grads.items()}


def _kernel(*args, **kwargs):
    return triton_dmattn_func(*args, return_lse=True, **kwargs)


def _oracle(dtype):
    return lambda *args: dense_reference(*args, compute_dtype=dtype)


def _assert_within(got, q, k, v, d_out, mask=None, bias=None, causal=False):
    oracle = _grads(_oracle(torch.float64), q, k, v, d_out, mask, bias, causal)
    baseline = _grads(_oracle(q.dtype), q, k, v, d_out, mask, bias, causal)
    for name in oracle:
        if name == "lse":
            assert torch.equal(torch.isneginf(got[name]), torch.isneginf(oracle[name]))
            finite = torch.isfinite(oracle[name])
            assert torch.allclose(got[name][finite].double(), oracle[name][finite], atol=1e-2)
            continue
        lengths = dict(keys=k.shape[1], queries=q.shape[1] * q.shape[2] // k.shape[2])  # (B, S, H, D) inputs
        check = error_check(name, got[name], oracle[name], baseline[name], q.dtype, **lengths)
        assert check.within, str(check)


@pytest.mark.parametrize(
    "shape, causal, dtype, blocks",
    [
        (dict(seqlen_q=48), True, torch.float16, (16, 16)),
        (dict(seqlen_q=40, seqlen_k=72), False, torch.bfloat16, (32, 16)),  # ragged, K > Q
        (dict(heads=2, kv_heads=1, seqlen_q=32), True, torch.bfloat16, (16, 32)),  # GQA
    ],
)
def test_replica_matches_oracle_without_mask(shape, causal, dtype, blocks):
    q, k, v, d_out = _inputs(dtype=dtype, **shape)
    got = _grads(_kernel, q, k, v, d_out, causal=causal, block_m=blocks[0], block_n=blocks[1])
    _assert_within(got, q, k, v, d_out, causal=causal)


def test_bias_gradient_matches_oracle():
    q, k, v, d_out = _inputs(batch=2, seqlen_q=32, heads=2, kv_heads=1)
    generator = torch.Generator().manual_seed(5)
    bias = torch.randn(2, 1, 32, 32, generator=generator)
    mask = torch.rand(2, 1, 32, 32, generator=generator) < 0.7
    mask[..., 0] = True  # every row sees a key: no NaN source, only the arithmetic is tested
    got = _grads(_kernel, q, k, v, d_out, mask, bias, block_m=16, block_n=16)
    _assert_within(got, q, k, v, d_out, mask, bias)


def _leading_block_mask(seqlen=64, rows=4, block_n=32):
    mask = torch.ones(1, 1, seqlen, seqlen, dtype=torch.bool)
    mask[:, :, :rows, :block_n] = False  # rows whose first key block is fully masked, in an active tile
    return mask


def test_fully_masked_first_block_gives_nan_lse_and_dv():
    q, k, v, d_out = _inputs(seqlen_q=64)
    got = _grads(_kernel, q, k, v, d_out, _leading_block_mask(), block_m=32, block_n=32)
    assert torch.isnan(got["lse"][0, 0, :4]).all() and torch.isfinite(got["lse"][0, 0, 4:]).all()
    assert torch.isnan(got["dv"]).all()  # the NaN rows reach every key the tile visits


def test_whole_tile_masked_block_is_skipped_not_nan():
    q, k, v, d_out = _inputs(seqlen_q=64)
    mask = _leading_block_mask(rows=32)  # the whole first tile: any_active is False, the block is skipped
    got = _grads(_kernel, q, k, v, d_out, mask, block_m=32, block_n=32)
    assert all(torch.isfinite(t).all() for t in got.values())


def test_all_true_mask_with_ragged_tail_poisons_dv_only():
    q, k, v, d_out = _inputs(seqlen_q=40)  # rows 40..63 of the last tile load the mask as False
    got = _grads(_kernel, q, k, v, d_out, torch.ones(1, 1, 40, 40, dtype=torch.bool), block_m=32, block_n=32)
    assert torch.isfinite(got["out"]).all() and torch.isfinite(got["dq"]).all()
    assert torch.isnan(got["dv"]).any() and torch.isnan(got["dk"]).any()


@pytest.mark.parametrize("mask", [_leading_block_mask(), torch.zeros(1, 1, 64, 64, dtype=torch.bool)])
def test_guard_matches_oracle_including_rows_without_keys(mask):
    q, k, v, d_out = _inputs(seqlen_q=64)
    got = _grads(_kernel, q, k, v, d_out, mask, block_m=32, block_n=32, guard=True)
    _assert_within(got, q, k, v, d_out, mask)
    empty = ~mask.any(-1)[0, 0]
    assert torch.equal(got["out"][0, empty], torch.zeros_like(got["out"][0, empty]))
    assert torch.isneginf(got["lse"][0, 0, empty]).all()


def test_patch_makes_dv_dk_finite_and_leaves_forward_and_dq_alone():
    q, k, v, d_out = _inputs(seqlen_q=64)
    buggy = _grads(_kernel, q, k, v, d_out, _leading_block_mask(), block_m=32, block_n=32)
    patched = _grads(_kernel, q, k, v, d_out, _leading_block_mask(), block_m=32, block_n=32, patch=True)
    assert torch.isfinite(patched["dv"]).all() and torch.isfinite(patched["dk"]).all()
    for name in ("out", "lse", "dq"):
        assert torch.equal(torch.isnan(patched[name]), torch.isnan(buggy[name])) and torch.isnan(patched[name]).any()


def test_patch_swallows_nan_from_d_out():
    q, k, v, d_out = _inputs(seqlen_q=32)
    d_out[:, 5] = float("nan")
    buggy = _grads(_kernel, q, k, v, d_out, block_m=16, block_n=16)
    patched = _grads(_kernel, q, k, v, d_out, block_m=16, block_n=16, patch=True)
    assert torch.isnan(buggy["dv"]).any()
    assert torch.isfinite(patched["dv"]).all()


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", [(48, 48, False), (32, 80, True)])
def test_every_dk_dv_row_is_written(seqlen_q, seqlen_k, causal):
    q, k, v, d_out = _inputs(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    options = dict(is_causal=causal, block_m=16, block_n=32)
    with poisoned_memory():
        empty = dmattn_backward(q, k, v, d_out, zero_init=False, **options)
    zeros = dmattn_backward(q, k, v, d_out, zero_init=True, record_writes=False, **options)
    assert zeros.rows_written is None
    assert empty.rows_written.all() and empty.rows_written.shape == (1, 1, seqlen_k)
    assert torch.equal(empty.dk, zeros.dk) and torch.equal(empty.dv, zeros.dv)


@jit
def _finite_or_zero_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _finite_or_zero(tl.load(X + offs)))


def test_finite_or_zero_is_where_isfinite():
    x = torch.tensor([1.5, math.nan, math.inf, -math.inf, -2.0, 0.0, 1e30, -1e-30] * 2, device=DEVICE)
    y = torch.empty_like(x)
    _finite_or_zero_kernel[(1,)](x, y, N=x.numel())
    assert torch.equal(y, torch.where(torch.isfinite(x), x, torch.zeros_like(x)))


def test_the_patch_as_written_does_not_compile():
    assert not isfinite_exists()
    with pytest.raises(Exception, match="isfinite"):
        launch_patch_as_written()


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(query=torch.zeros(4, 16, 16)), ValueError, "query must be a 4-D"),
        (dict(query=torch.zeros(1, 8, 1, 16)), TypeError, "query has dtype torch.float32"),
        (dict(attn_mask=torch.ones(1, 1, 8, 8, device=DEVICE)), TypeError, "attn_mask has dtype"),
        (dict(attn_mask=torch.ones(1, 1, 7, 8, dtype=torch.bool, device=DEVICE)), ValueError, "attn_mask has shape"),
        (dict(block_m=48), ValueError, "block_m = 48"),
        (
            dict(
                query=torch.zeros(1, 8, 3, 16, dtype=torch.float16),
                key=torch.zeros(1, 8, 2, 16, dtype=torch.float16),
                value=torch.zeros(1, 8, 2, 16, dtype=torch.float16),
            ),
            ValueError,
            "multiple of the kv heads",
        ),
        (dict(scale=-1.0), ValueError, "scale"),
    ],
)
def test_bad_input_names_the_argument(change, error, match):
    q, k, v, _ = _inputs(seqlen_q=8)
    kwargs = dict(query=q, key=k, value=v) | change
    with pytest.raises(error, match=match):
        triton_dmattn_func(**kwargs)
