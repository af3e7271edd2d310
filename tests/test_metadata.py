"""`VarlenMetadata` (kernels/varlen/metadata.py): built once, shared by every call of a step, and
computing bitwise what the positional call computes; the one memo positional calls share;
FlashAttention's `softmax_scale` keyword."""

from __future__ import annotations

import pytest
import torch

from varlen_workbench.kernels import caches
from varlen_workbench.kernels.runtime import interpreted, use_interpreter
from varlen_workbench.kernels.varlen import VarlenMetadata, metadata, varlen_attention
from varlen_workbench.kernels.varlen.fa4 import fa4_layout
from varlen_workbench.workbench.layout import Case, pack

CASE = Case((5, 0, 9), seqlens_k=(7, 3, 9), padded_q=(6, 2, 9), padded_k=(8, 3, 10), tail_q=2, heads=2, head_dim=16, causal=True)


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    monkeypatch.setattr(caches, "LAST", caches.Memo())


def _metadata(batch, **extra) -> VarlenMetadata:
    padded = {"cu_seqlens_q_padded": batch.cu_seqlens_q_padded, "cu_seqlens_k_padded": batch.cu_seqlens_k_padded}
    return VarlenMetadata.for_tensors(
        batch.q, batch.k, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k, **padded, **extra
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_call_on_metadata_computes_bitwise_what_the_positional_call_computes(backend):
    batch = pack(CASE)
    positional = batch.fresh()
    out = positional.call(varlen_attention, return_lse=True, backend=backend)
    torch.autograd.backward(out[0], torch.ones_like(out[0]))
    explicit = batch.fresh()
    step = _metadata(explicit)
    again = varlen_attention(explicit.q, explicit.k, explicit.v, metadata=step, causal=True, return_lse=True, backend=backend)
    torch.autograd.backward(again[0], torch.ones_like(again[0]))
    for a, b in zip(
        (*out, positional.q.grad, positional.k.grad, positional.v.grad), (*again, *(t.grad for t in explicit.inputs().values()))
    ):
        assert torch.equal(a, b)


def test_the_object_is_whole_when_built_and_calls_write_nothing_onto_it():
    """Built with its work lists (natively; under the interpreter each call makes its own), then
    every layer of the step reads it: no attribute is set or replaced by a call."""
    batch = pack(CASE)
    step = _metadata(batch)
    assert (step.work is None) == interpreted(step.device)
    made = dict(vars(step))
    for _ in range(2):
        out = varlen_attention(batch.q, batch.k, batch.v, metadata=step, causal=True, backend="triton")
        out.sum().backward()
    assert vars(step).keys() == made.keys() and all(vars(step)[name] is value for name, value in made.items())


def test_a_decreasing_boundary_in_host_memory_raises_in_the_constructor():
    """[0, 5, 3, 8]: every size is known at construction, so the host check runs there."""
    cu = torch.tensor([0, 5, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        VarlenMetadata(cu, cu, 5, 5, total_q=8, total_k=8)
    q = torch.zeros(8, 1, 16)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        VarlenMetadata.for_tensors(q, q, cu, cu, 5, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device check runs natively only")
def test_a_decreasing_boundary_on_the_device_raises_at_check():
    cu = torch.tensor([0, 5, 3, 8], dtype=torch.int32, device="cuda")
    step = VarlenMetadata(cu, cu, 5, 5, total_q=8, total_k=8)
    assert step.device_check is not None
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        step.check()


def test_for_tensors_reads_the_row_counts_and_the_device_off_q_and_k():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    step = VarlenMetadata.for_tensors(torch.zeros(6, 1, 16), torch.zeros(7, 1, 16), cu, cu, 3, 3)
    assert (step.total_q, step.total_k, step.device) == (6, 7, torch.device("cpu"))
    with pytest.raises(TypeError, match="reads the row counts off q and k, got list and Tensor; pass the tensors"):
        VarlenMetadata.for_tensors([0] * 6, torch.zeros(7, 1, 16), cu, cu, 3, 3)


def test_positional_calls_share_the_last_metadata_while_the_tensors_are_unchanged():
    batch = pack(CASE)
    batch.call(varlen_attention)
    first = caches.LAST.value
    batch.call(varlen_attention, window_size=(2, 0))  # another mask, the same batch: the same metadata
    assert caches.LAST.value is first
    batch.cu_seqlens_k.add_(0)  # an in-place write bumps the version counter: built again
    batch.call(varlen_attention)
    assert caches.LAST.value is not first
    second = caches.LAST.value
    batch.call(varlen_attention, validate=False)  # another validation: another metadata
    assert caches.LAST.value is not second


def test_a_freed_tensor_never_matches_a_new_one():
    memo = caches.Memo()
    cu = torch.tensor([0, 3])
    memo.get((cu,), "x", lambda: "first")
    del cu
    assert memo.get((torch.tensor([0, 3]),), "x", lambda: "second") == "second"


def test_boundaries_in_host_memory_are_checked_there_and_copied_once():
    """As a collator makes them: the host check, with the layout (nothing read back later), then
    one copy to the device the kernels run on ('meta' stands for a GPU here; interpreted, so that
    no work lists are launched on it)."""
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    with use_interpreter():
        step = VarlenMetadata(cu_q, cu_k, 3, 5, total_q=6, total_k=9, device="meta")
    assert all(t.device.type == "meta" for t in step.boundaries) and step.device_check is None
    assert step.padding_to_fill() and step.has_gaps() == (False, False) and fa4_layout(step).real_q == 5
    assert "host check passed" in repr(step)
    with pytest.raises(ValueError, match="lives on meta but q is on cpu; build it with device=q.device"):
        step.check_call(torch.zeros(6, 1, 16), torch.zeros(9, 1, 16))
    with pytest.raises(ValueError, match="describes q of 6 rows and k of 9, but the call passes q of 5 and k of 9"):
        step.check_call(torch.zeros(5, 1, 16), torch.zeros(9, 1, 16))


def test_an_unpadded_batch_launches_no_fill():
    """The host check knows every row is real: no padding fill is launched."""
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert not VarlenMetadata(cu, cu, 3, 3, total_q=5, total_k=5).padding_to_fill()
    assert VarlenMetadata(cu, cu, 3, 3, total_q=6, total_k=5).padding_to_fill()  # one TAIL row of q
    assert VarlenMetadata(cu, cu, 3, 3, total_q=5, total_k=5, validate=False).padding_to_fill()  # unknown: fill


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(total_q=5), TypeError, "missing 1 required keyword-only argument: 'total_k'"),
        (dict(total_q=-1, total_k=5), TypeError, "total_q must be a non-negative Python int"),
        (dict(total_q=None, total_k=5), TypeError, r"total_q must be .*, got None; pass q.shape\[0\]"),
        (dict(total_q=5, total_k=5, validate="yes"), TypeError, "validate must be a bool"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, error, match):
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(error, match=match):
        VarlenMetadata(cu, cu, 3, 3, **kwargs)


def test_softmax_scale_is_scale():
    batch = pack(CASE)
    assert torch.equal(batch.call(varlen_attention, softmax_scale=0.3), batch.call(varlen_attention, scale=0.3))
    with pytest.raises(ValueError, match="softmax_scale is FlashAttention's name for scale"):
        batch.call(varlen_attention, scale=0.3, softmax_scale=0.3)


def test_device_cuda_means_the_current_cuda_device(monkeypatch):
    """`device="cuda"` is where `.to("cuda")` puts the boundaries: q on "cuda:1" then matches it."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert metadata._kernel_device("cuda") == torch.device("cuda", 1)
    assert metadata._kernel_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert metadata._kernel_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA says")
def test_device_cuda_without_cuda_names_the_argument_and_what_to_pass():
    """Not torch's `AssertionError: Torch not compiled with CUDA enabled` from deep inside."""
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"device='cuda', but torch .* sees no CUDA device here; pass device='cpu'"):
        VarlenMetadata(cu, cu, 3, 3, total_q=5, total_k=5, device="cuda")


def test_a_device_torch_does_not_know_is_refused_by_name():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"device='gpu' is not a torch device .*; pass 'cuda' or 'cpu'"):
        VarlenMetadata(cu, cu, 3, 3, total_q=5, total_k=5, device="gpu")


def test_a_device_the_kernels_do_not_run_on_is_refused_at_construction():
    """Boundaries on the meta device: refused by name before any kernel (the work lists) is launched."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"would live on meta, but the kernels run on CUDA \(compiled\) or the CPU"):
        VarlenMetadata(cu, cu, 5, 5, total_q=8, total_k=8, validate=False)
