"""`varlen_attention` as a torch.library custom op: dispatch modes, torch.compile, argument
checks with and without validation, and (on CUDA) no host sync and agreement with torch's
own `varlen_attn`."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_kernel_varlen import varlen_attention
from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.workbench.bounds import error_check
from varlen_workbench.workbench.layout import Case, Fill, Region, pack
from varlen_workbench.workbench.reference import reference_attention

CASE = Case((5, 9), seqlens_k=(7, 9), padded_q=(8, 9), tail_q=2, heads=2, kv_heads=1, head_dim=16, causal=True, fill=Fill.NAN)


class OpLog(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher below autograd."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_sees_one_op_per_pass():
    batch = pack(CASE)
    d_out = torch.ones_like(batch.q)
    # validate=False: validation's host reads of cu_seqlens are ops too (copies to the CPU on CUDA).
    with OpLog() as forward:
        out = batch.call(varlen_attention, validate=False)
    with OpLog() as backward:
        out.backward(d_out)
    # Autograd adds detach (saving tensors) and zeros (the unused lse's gradient) around it.
    assert [op for op in forward.ops if op != "aten.detach.default"] == ["varlen_workbench.varlen_attention_fwd.default"]
    assert [op for op in backward.ops if op.startswith("varlen_workbench.")] == ["varlen_workbench.varlen_attention_bwd.default"]


def _loss(q, k, v, cu_q, cu_k, cu_q_padded, cu_k_padded):
    out, lse = varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        9,
        9,
        cu_seqlens_q_padded=cu_q_padded,
        cu_seqlens_k_padded=cu_k_padded,
        causal=True,
        return_lse=True,
        validate=False,
    )
    return out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",  # dynamo + AOTAutograd + the fake impls: everything the op itself owns
        pytest.param(
            "inductor",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(interpreted(default_device()), reason="inductor's CPU C++ build takes ~100 s; runs natively"),
            ],
        ),
    ],
)
def test_torch_compile_fullgraph(backend):
    """fullgraph=True also proves validate=False reads nothing on the host (.tolist() would break the graph)."""
    batch = pack(CASE)
    args = (batch.cu_seqlens_q, batch.cu_seqlens_k, batch.cu_seqlens_q_padded, batch.cu_seqlens_k_padded)
    eager = torch.autograd.grad(_loss(batch.q, batch.k, batch.v, *args), (batch.q, batch.k, batch.v))
    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True, backend=backend)
    grads = torch.autograd.grad(compiled(batch.q, batch.k, batch.v, *args), (batch.q, batch.k, batch.v))
    for got, expected, regions in zip(grads, eager, (batch.regions_q, batch.regions_k, batch.regions_k)):
        torch.testing.assert_close(got, expected)
        assert (got[(regions != Region.REAL).to(got.device)] == 0).all()


def test_validation_names_the_problem():
    batch = pack(CASE, requires_grad=False)
    with pytest.raises(TypeError, match="float64"):
        varlen_attention(*(t.double() for t in (batch.q, batch.k, batch.v)), *batch.args()[3:])
    with pytest.raises(ValueError, match="max_seqlen_q = 4 is smaller"):
        varlen_attention(*batch.args()[:5], 4, 9, **batch.kwargs())
    with pytest.raises(ValueError, match="head_dim 20"):
        q = torch.zeros(9, 2, 20)
        varlen_attention(q, q[:, :1], q[:, :1], batch.cu_seqlens_q.cpu(), batch.cu_seqlens_q.cpu(), 5, 5)


def test_validate_false_keeps_the_sync_free_checks():
    batch = pack(CASE, requires_grad=False)
    q, k, v, cu_q, cu_k = batch.args()[:5]
    with pytest.raises(ValueError, match="cu_seqlens_q describes 1 sequences but cu_seqlens_k describes 2"):
        varlen_attention(q, k, v, cu_q[:2], cu_k, 9, 9, validate=False)
    with pytest.raises(TypeError, match="cu_seqlens_k must be an integer tensor"):
        varlen_attention(q, k, v, cu_q, cu_k.float(), 9, 9, validate=False)
    with pytest.raises(ValueError, match="not a multiple"):
        varlen_attention(q, k.expand(-1, 3, -1), v.expand(-1, 3, -1), cu_q, cu_k, 9, 9, validate=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode")
def test_validate_false_never_syncs_on_cuda():
    batch = pack(CASE, device="cuda")
    d_out = torch.randn_like(batch.q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = batch.call(varlen_attention, validate=False)
        out.backward(d_out)
        with pytest.raises(RuntimeError, match="synchroniz"):  # the detector works: a host read syncs
            batch.cu_seqlens_q[-1].item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen_attn runs on CUDA only")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (300, 0), (8, 2), (0, -1)], ids=str)
def test_real_rows_agree_with_torch_varlen_attn(dtype, window):
    """Ours within 2x (out) / 3x (grads) of varlen_attn's error against the oracle, windows
    included. No padding (varlen_attn has no padded layout) and no GQA (its flag is newer than
    torch 2.11)."""
    from torch.nn.attention.varlen import varlen_attn

    if "window_size" not in inspect.signature(varlen_attn).parameters:
        pytest.skip("torch 2.10's varlen_attn has no window_size")
    case = Case((300, 17, 1, 513), heads=4, head_dim=128, dtype=dtype)
    batch = pack(case, device="cuda")
    d_out = torch.randn_like(batch.q)
    leaves = [t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    theirs = varlen_attn(*leaves, *batch.args()[3:], window_size=window)
    theirs.backward(d_out)
    ours = batch.call(varlen_attention, window_size=window)
    ours.backward(d_out)
    exact = [t.detach().double().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    oracle = reference_attention(*exact, *batch.args()[3:], **batch.kwargs(), window_size=window)
    oracle.backward(d_out.double())
    named = zip(
        ("out", "dq", "dk", "dv"),
        (ours, batch.q.grad, batch.k.grad, batch.v.grad),
        (theirs, *(t.grad for t in leaves)),
        (oracle, *(t.grad for t in exact)),
    )
    for name, mine, torchs, exact_value in named:
        check = error_check(
            name, mine.detach(), exact_value.detach(), torchs.detach(), batch.q.dtype, **batch.reduction_lengths()
        )
        assert check.within, f"vs torch varlen_attn, window {window}: {check}"


def test_tensors_on_another_device_get_a_clear_error():
    """CUDA tensors are compiled for, CPU tensors interpreted; any other device is refused by name."""
    q = torch.zeros(8, 2, 16, device="meta")
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"q is on meta, but the Triton kernels run on CUDA tensors \(compiled\) or on CPU"):
        varlen_attention(q, q, q, cu, cu, 5, 5, validate=False)


@pytest.mark.parametrize("use_lse", [False, True], ids=["out", "out-and-lse"])
def test_eager_road_and_custom_op_compute_bitwise_the_same(monkeypatch, use_lse):
    """Plain eager calls skip the custom op's dispatch (host time); under a dispatch mode or
    torch.compile the custom op runs. Same launchers: same bits, forward and backward."""
    from varlen_workbench.kernels.varlen import op

    results = []
    for eager in (True, False):
        monkeypatch.setattr(op, "_eager", lambda eager=eager: eager)
        batch = pack(CASE.with_(fill=Fill.ZEROS))
        out, lse = batch.call(varlen_attention, window_size=(3, -1), return_lse=True)
        loss = out.float().sum() + (lse[torch.isfinite(lse)].sum() if use_lse else 0)
        loss.backward()
        results.append((out, lse, batch.q.grad, batch.k.grad, batch.v.grad))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


def test_plain_calls_take_the_eager_road_and_dispatch_modes_the_custom_op():
    from varlen_workbench.kernels.varlen import op

    assert op._eager()
    with OpLog():
        assert not op._eager()


def test_the_host_cost_benchmark_runs_the_native_path_of_every_variant(capsys):
    """`python -m benchmarks.host_cost --quick`: each variant's calls reach the stubs they should
    (the attention kernels or FA4, the metadata check as often as the variant needs it) through
    the native path of the wrapper, on the CPU; the module's state is as it was afterwards."""
    from benchmarks import host_cost
    from varlen_workbench.kernels import interpreter
    from varlen_workbench.kernels.varlen import fa4, launch, metadata

    chosen, load = launch.tuner().chosen, fa4.load
    assert host_cost.main(["--quick", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.count("ran (not timed)") == len(host_cost.VARIANTS)
    assert all(module.interpreted is interpreted for module in (metadata, launch, fa4, interpreter))
    assert launch.tuner().chosen is chosen and fa4.load is load
