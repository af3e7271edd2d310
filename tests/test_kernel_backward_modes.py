"""`deterministic=False`: the fused backward (dQ added inside the dK/dV pass with fp32 atomics).

It keeps the whole contract of the two-pass backward: real rows within FlashAttention's bound
of the float64 oracle, padding rows exactly 0 and never read (NaN-poisoned memory and NaN in
the padding of dO), GQA, windows, causal with len_q != len_k, and the gradient through lse.
Its errors are also within that bound of the deterministic backward's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_kernel_varlen import CASES, assert_contract, fast_only, nan_on_padding, varlen_attention
from tests.test_kernel_window import WINDOW_CASE
from workbench import Case, Fill, pack, probe
from workbench.bounds import ErrorCheck

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", fast_only(CASES, {"gqa", "len_q>len_k-causal", "empty-sequences"}))
def test_fused_backward_keeps_the_contract(name):
    assert_contract(CASES[name], deterministic=False)


@pytest.mark.parametrize("window", fast_only([(8, 2), (3, 0), (16, -1)], {(8, 2)}), ids=str)
def test_fused_backward_keeps_the_contract_with_windows(window):
    assert_contract(WINDOW_CASE.with_(causal=window[1] == 0), window_size=window, deterministic=False)


@pytest.mark.parametrize("name", fast_only(["gqa", "len_q<len_k-causal", "head-dim-64"], {"gqa"}))
def test_fused_gradients_are_within_the_bound_of_the_deterministic_ones(name):
    """Each gradient's error against the oracle is at most FlashAttention's factor times the
    two-pass backward's error (or the rounding floor): fusing costs no accuracy."""
    batch = pack(CASES[name])
    d_out = nan_on_padding(batch)
    records = {mode: probe(varlen_attention, batch, grad_out=d_out, poisoned=True, deterministic=mode) for mode in (True, False)}
    for grad in ("dq", "dk", "dv"):
        fused, two_pass = records[False].errors[grad], records[True].errors[grad]
        check = ErrorCheck(grad, fused.error, two_pass.error, fused.factor, fused.floor)
        assert check.within, str(check)
    assert records[False].real_finite and records[False].padding_exactly_zero


OP_CASE = Case((5, 9), seqlens_k=(7, 9), padded_q=(8, 9), tail_q=2, heads=2, kv_heads=1, head_dim=16, causal=True, fill=Fill.NAN)


class _Recorder(TorchDispatchMode):
    """Any dispatch mode sends the call down the custom ops' road."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture
def backward_modes(monkeypatch) -> list[bool]:
    """The `deterministic` of every backward launched (both roads call op.attention_backward)."""
    from kernels.varlen import op

    seen: list[bool] = []
    real = op.attention_backward

    def spy(*args):
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(op, "attention_backward", spy)
    return seen


def test_custom_op_road_takes_the_fused_backward(backward_modes):
    """The custom ops carry `deterministic` to the backward: both roads compute the same
    gradients (bitwise under the interpreter, which runs atomics in program order; natively up to
    float32 rounding)."""
    batch = pack(OP_CASE)
    d_out = nan_on_padding(batch)
    eager = probe(varlen_attention, batch, grad_out=d_out, reference=False, deterministic=False).tensors
    with _Recorder():
        op = probe(varlen_attention, batch, grad_out=d_out, reference=False, deterministic=False).tensors
    assert backward_modes == [False, False]
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(op[name], eager[name])


def test_torch_compile_fullgraph_takes_the_fused_backward(backward_modes):
    """The custom ops' schema and fake implementations carry `deterministic` through dynamo and
    AOTAutograd (aot_eager: everything the op itself owns)."""
    batch = pack(OP_CASE)
    metadata = (batch.cu_seqlens_q, batch.cu_seqlens_k)
    padded = {"cu_seqlens_q_padded": batch.cu_seqlens_q_padded, "cu_seqlens_k_padded": batch.cu_seqlens_k_padded}

    def loss(q, k, v):
        out = varlen_attention(q, k, v, *metadata, 9, 9, **padded, causal=True, validate=False, deterministic=False)
        return out.square().sum()

    leaves = (batch.q, batch.k, batch.v)
    eager = torch.autograd.grad(loss(*leaves), leaves)
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves), leaves)
    assert backward_modes == [False, False]
    for got, expected in zip(compiled, eager):
        torch.testing.assert_close(got, expected)


def test_deterministic_must_be_a_bool():
    batch = pack(CASES["te-layout"], requires_grad=False)
    with pytest.raises(TypeError, match="deterministic must be a bool, got str 'no'; pass deterministic=True"):
        batch.call(varlen_attention, deterministic="no")


@pytest.mark.slow
def test_benchmark_quick_run_checks_the_fused_backward(tmp_path):
    """`python -m benchmarks.backward_modes --quick`: the gradient check on the CPU, nothing timed."""
    from workbench.records import read_record

    record = tmp_path / "quick.json"
    command = [sys.executable, "-m", "benchmarks.backward_modes", "--quick", "--record", str(record)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=os.environ | {"WORKBENCH_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    written = read_record(record)
    assert list(written["checks"].values()) == ["ok"] and written["rows"] == []
