"""Head dims beyond the powers of two: every multiple of 8 up to 256 for q/k and for v, and v's
apart from q/k's (DeepSeek-style 192/128), against the float64 oracle.

The kernels compute on the next power of two of lanes (at least 16) and mask the rest: a lane
past the head dim must load 0 (so that scores, P @ V, dP and delta stay exact) and must never
be stored. Each case runs forward and backward under poisoned memory with NaN in every padding
row of q, k, v and dO (`assert_contract`), with FlashAttention's bounds on REAL rows (bf16 and
fp16 under the interpreter's bf16 upcast) and exact zeros on GAP and TAIL rows: a lane that
leaked would break the bound, an output lane past v's head dim does not exist (out has D_v).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given

from tests.test_kernel_varlen import assert_contract, fast_only, varlen_attention
from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.varlen.launch import lanes, native_tiles, tuner
from varlen_workbench.kernels.varlen.tuner import NATIVE_TILES
from varlen_workbench.workbench.bounds import error_check
from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.reference import reference_attention
from varlen_workbench.workbench.strategies import LayoutSpace

# Each names what it is here for; together: 48, 80, 96 and 192/128, every dtype, GQA and MQA,
# causal with len_q != len_k, GAP and TAIL rows, an empty sequence, and the extremes 8 and 256.
CASES = {
    "d48-gqa-causal-gap": Case(
        (13, 0, 30), seqlens_k=(20, 3, 9), padded_q=(16, 2, 30), tail_k=2, heads=4, kv_heads=2, head_dim=48, causal=True,
        dtype="bfloat16",
    ),
    "d80-tail-nan": Case((21, 7), padded_k=(24, 7), tail_q=3, heads=2, head_dim=80, dtype="float16", fill=Fill.NAN),
    "d96-fp32-causal": Case((9, 40), seqlens_k=(30, 12), align=8, heads=2, kv_heads=1, head_dim=96, causal=True),
    "d192-v128-mla": Case(
        (17, 9), seqlens_k=(25, 4), padded_q=(20, 9), tail_q=3, heads=4, kv_heads=1, head_dim=192, head_dim_v=128,
        causal=True, dtype="bfloat16",
    ),
    "d8-v24-smallest": Case((11, 5), padded_q=(12, 8), tail_k=1, heads=2, head_dim=8, head_dim_v=24, dtype="float16"),
    "d256-v40": Case((6, 19), seqlens_k=(14, 3), heads=2, head_dim=256, head_dim_v=40, causal=True, dtype="bfloat16"),
}  # fmt: skip


@pytest.mark.parametrize("name", fast_only(CASES, {"d48-gqa-causal-gap", "d192-v128-mla"}))
def test_real_rows_match_oracle_and_padding_is_exactly_zero(name):
    assert_contract(CASES[name])


def test_output_has_vs_head_dim_and_lse_matches_the_oracle():
    """out is (T_q, H, D_v); lse, whose scores run over q/k's 192 lanes, within its bound."""
    case = Case((7, 3, 12), seqlens_k=(3, 0, 12), tail_q=2, heads=2, head_dim=192, head_dim_v=128, causal=True)
    batch = pack(case, requires_grad=False)
    out, lse = (t.cpu() for t in varlen_attention(*batch.args(), **batch.kwargs(), return_lse=True))
    assert out.shape == (batch.q.shape[0], 2, 128) and lse.shape == (2, batch.q.shape[0])
    _, oracle = reference_attention(*batch.args(), **batch.kwargs(), return_lse=True)
    _, baseline = reference_attention(*batch.args(), **batch.kwargs(), return_lse=True, compute_dtype=torch.float32)
    check = error_check("lse", lse, oracle.cpu(), baseline.cpu(), torch.float32, head_dim=192, **batch.reduction_lengths())
    assert check.within, str(check)


@pytest.mark.parametrize("window", fast_only([(5, 0), (3, 7)], {(3, 7)}), ids=str)
def test_sliding_window_at_a_padded_head_dim(window):
    assert_contract(Case((25, 9), seqlens_k=(18, 14), padded_k=(20, 14), tail_q=2, heads=2, head_dim=40), window_size=window)


def test_smallest_native_tiles_keep_the_contract_on_padded_lanes():
    """The narrowest candidate tiles (16- and 32-row blocks), pinned: the lane masks with other
    row and key blockings than the interpreter's one tile."""
    smallest = {kernel: by_bytes[max(by_bytes)][0] for kernel, by_bytes in NATIVE_TILES.items()}
    assert {t.block_m for t in smallest.values()} | {t.block_n for t in smallest.values()} <= {16, 32}
    with tuner().pinned(**smallest):
        assert_contract(Case((37, 5), seqlens_k=(20, 33), tail_q=2, heads=2, kv_heads=1, head_dim=24, head_dim_v=56, causal=True))


def test_lanes_are_the_next_power_of_two_from_16():
    assert [lanes(d) for d in (8, 16, 24, 48, 80, 96, 136, 192, 256)] == [16, 16, 32, 64, 128, 128, 256, 256, 256]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_padded_head_dims_take_the_tiles_of_their_lanes(dtype):
    """A padded head dim costs its lanes' registers and shared memory: 48 takes 64's tiles, 96
    128's, 192/128 (the wider one) 256's; compiled, which the interpreter's one tile hides."""
    for kernel in NATIVE_TILES:
        assert native_tiles(kernel, 48, dtype) == native_tiles(kernel, 64, dtype)
        assert native_tiles(kernel, 96, dtype) == native_tiles(kernel, 80, dtype) == native_tiles(kernel, 128, dtype)
        assert native_tiles(kernel, 192, dtype, 128) == native_tiles(kernel, 256, dtype)
        assert native_tiles(kernel, 64, dtype, 192) == native_tiles(kernel, 256, dtype)


def test_every_head_dim_of_the_contract_is_accepted_and_others_refused():
    device = default_device()
    cu = torch.tensor([0, 3], dtype=torch.int32, device=device)
    for head_dim in (8, 40, 136, 248):
        q = torch.randn(3, 1, head_dim, device=device)
        v = torch.randn(3, 1, 16, device=device)
        assert varlen_attention(q, q, v, cu, cu, 3, 3).shape == (3, 1, 16)
    for bad in (4, 20, 264):
        q = torch.randn(3, 1, bad, device=device)
        with pytest.raises(ValueError, match=rf"head_dim {bad} \(q.shape\[-1\]\) is not supported"):
            varlen_attention(q, q, q, cu, cu, 3, 3)
        with pytest.raises(ValueError, match=rf"v's head_dim {bad} \(v.shape\[-1\]\) is not supported"):
            varlen_attention(torch.randn(3, 1, 16, device=device), torch.randn(3, 1, 16, device=device), q, cu, cu, 3, 3)


def test_custom_op_and_torch_compile_give_vs_head_dim(monkeypatch):
    """The custom op's road (dispatch modes, torch.compile) computes bitwise what the eager road
    does at D_v != D, and its fake implementations give torch.compile out's and dv's shapes."""
    from varlen_workbench.kernels.varlen import op

    case = Case((5, 9), padded_q=(8, 9), heads=2, head_dim=48, head_dim_v=24, causal=True, fill=Fill.ZEROS)

    def run(fn):
        batch = pack(case)
        out = fn(batch.q, batch.k, batch.v, *batch.args()[3:], cu_seqlens_q_padded=batch.cu_seqlens_q_padded, causal=True)
        out.square().sum().backward()
        return out.detach(), batch.q.grad, batch.k.grad, batch.v.grad

    eager = run(varlen_attention)
    assert eager[0].shape == (17, 2, 24) and eager[3].shape == (14, 2, 24)
    monkeypatch.setattr(op, "_eager", lambda: False)
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, run(varlen_attention)):
        assert torch.equal(a, b), name
    monkeypatch.undo()
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(varlen_attention, validate=False), fullgraph=True, backend="aot_eager")
    for a, b in zip(eager, run(compiled)):
        torch.testing.assert_close(a, b)


# Lengths across a 64-row block, every dtype, v's head dim drawn apart (each layout has at least
# one row of q and of k: varlen_workbench.workbench.probes.probe needs them).
BOUNDS = dict(longest=40, heads=(1, 2, 4), dtypes=("float32", "float16", "bfloat16"), fills=(Fill.NAN, Fill.HUGE))
layouts = LayoutSpace(head_dims=(8, 24, 48, 80), head_dims_v=(16, 40, 96), **BOUNDS).strategy


@pytest.mark.slow
@given(layouts())
def test_drawn_layouts_at_drawn_head_dims(case):
    assert_contract(case)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(48, None), (80, None), (96, None), (192, 128)], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_native_kernels_at_new_head_dims(dims, dtype):
    """On a GPU: every kernel compiled at the padded lanes, long sequences across many blocks."""
    head_dim, head_dim_v = dims
    case = Case(
        (300, 77, 512), seqlens_k=(257, 90, 500), align=16, tail_q=5, heads=4, kv_heads=2, head_dim=head_dim,
        head_dim_v=head_dim_v, causal=True, dtype=dtype, fill=Fill.NAN,
    )  # fmt: skip
    assert_contract(case)
