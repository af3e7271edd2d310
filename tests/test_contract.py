"""Point 4 of the padding contract: every malformed input gets a clear error.

Each case of the catalogue (varlen_workbench.workbench.malformed, shared with `varlen-workbench audit`) is one malformed
call: the exception type and a regex its message must match (naming the argument, the offending
index/value, and the fix).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

from varlen_workbench.kernels.contract import check_cu_seqlens, check_scale, check_varlen_inputs, check_window_size
from varlen_workbench.kernels.varlen.op import DTYPES, HEAD_DIMS
from varlen_workbench.workbench.layout import Case, Region, pack, region_labels
from varlen_workbench.workbench.malformed import CATALOGUE, I32, base_args, split_call


def call(**changes):
    positional, keywords = split_call({**base_args(), **changes})
    if "window_size" in keywords:  # the window's own check (varlen_attention runs it before the others)
        check_window_size(keywords.pop("window_size"))
    return check_varlen_inputs(*positional, **keywords, dtypes=DTYPES, head_dims=HEAD_DIMS)


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_malformed_input_gets_a_clear_error(case):
    with pytest.raises(case.exception, match=case.message):
        call(**case.changes(base_args()))


def test_catalogue_is_large_and_distinct():
    assert len(CATALOGUE) >= 15
    assert len({c.id for c in CATALOGUE}) == len(CATALOGUE)
    assert len({c.message for c in CATALOGUE}) == len(CATALOGUE)


def test_valid_te_layout_passes_and_reports_shape():
    shape = call()
    assert (shape.total_q, shape.heads, shape.kv_heads, shape.head_dim) == (15, 4, 2, 16)


def test_tail_rows_are_legal_and_labelled_not_rejected():
    """The torch bug's layout: more rows than cu_seqlens[-1] is legal TAIL padding."""
    cu = torch.tensor([0, 144, 432, 944], dtype=I32)
    lengths, _ = check_cu_seqlens(cu, cu, 512, 512, total_q=946, total_k=946)
    assert lengths == [144, 288, 512]
    labels = region_labels(cu, None, 946)
    assert (labels[:944] == Region.REAL).all() and (labels[944:] == Region.TAIL).all()


def test_empty_sequences_are_legal():
    cu = torch.tensor([0, 0, 5, 5], dtype=I32)
    assert check_cu_seqlens(cu, cu, 5, 5, total_q=5, total_k=5)[0] == [0, 5, 0]


def test_int64_boundaries_are_accepted():
    cu = torch.tensor([0, 3], dtype=torch.int64)
    check_cu_seqlens(cu, cu, 3, 3, total_q=3, total_k=3)


def test_numpy_integers_are_accepted_as_max_seqlen():
    """A max_seqlen computed with numpy (np.int64) is an int, not torch.int64's kind of mistake."""
    import numpy as np

    args = base_args()
    assert call(max_seqlen_q=np.int64(args["max_seqlen_q"]), max_seqlen_k=np.int32(args["max_seqlen_k"])).total_q == 15
    with pytest.raises(TypeError, match=r"max_seqlen_q must be a Python int, got numpy.float64"):
        call(max_seqlen_q=np.float64(4))


def test_default_scale_is_inverse_sqrt_head_dim():
    assert check_scale(None, 64) == 0.125
    assert check_scale(2, 64) == 2.0


def test_case_validation_names_the_field():
    with pytest.raises(ValueError, match=r"Case\.padded_q\[1\] = 2 is shorter than the real length 3"):
        Case((4, 3), padded_q=(4, 2))
    with pytest.raises(ValueError, match=r"Case\.seqlens_k has 1 entries but seqlens_q has 2"):
        Case((4, 3), seqlens_k=(4,))
    with pytest.raises(ValueError, match=r"Case\.heads = 3 must be a positive multiple of kv_heads = 2"):
        Case((4,), heads=3, kv_heads=2)
    with pytest.raises(ValueError, match=r"Case\.dtype = 'int8'"):
        Case((4,), dtype="int8")


def test_packed_batches_always_pass_validation():
    batch = pack(Case((5, 0, 7), seqlens_k=(2, 3, 9), align=4, tail_q=3, tail_k=1, heads=4, kv_heads=2, head_dim=16))
    check_varlen_inputs(
        *batch.args(), cu_seqlens_q_padded=batch.cu_seqlens_q_padded, cu_seqlens_k_padded=batch.cu_seqlens_k_padded
    )


# -- validate=True reads the metadata on the host once ----------------------------------------


class OnDevice(torch.Tensor):
    """Metadata standing for tensors in device memory: every read of their values on the host
    (item, tolist, numpy, bool/int/float of an element, a copy to the CPU) would be a device->host
    copy and a sync there, and is recorded; `.cpu()` hands back a plain host tensor, whose reads
    cost nothing more. Every other op keeps the result "on the device"."""

    reads: list[str] = []
    HOST_READS = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
        torch.Tensor.__float__,
        torch.Tensor.cpu,
    }

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_cpu = func is torch.Tensor.to and any(
            (isinstance(a, str) and a.startswith("cpu")) or (isinstance(a, torch.device) and a.type == "cpu")
            for a in (*args[1:], kwargs.get("device"))
        )
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if func in cls.HOST_READS or to_cpu:
                cls.reads.append(getattr(func, "__name__", str(func)))
                return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out  # now on the host
        return torch._tensor._convert(out, cls)


def on_device(args: dict) -> dict:
    return {n: t.as_subclass(OnDevice) if n.startswith("cu_seqlens") and t is not None else t for n, t in args.items()}


def test_validation_reads_the_metadata_in_one_host_copy():
    """check_varlen_inputs (what validate=True runs) reads all four boundary vectors in one copy,
    and varlen_attention up to its launch does too: once per new metadata, never with
    validate=False. (On CUDA each read is a sync: issue 17 measured validate=True at +15-47%.)"""
    import varlen_workbench.kernels.varlen.op as op

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs"))
    from contract_errors import checks_only

    OnDevice.reads.clear()
    call(**on_device(base_args()))
    assert OnDevice.reads == ["cpu"]
    for changes in ({"cu_seqlens_q_padded": None, "cu_seqlens_k_padded": None}, {"cu_seqlens_k": _i32([0, 3, 5, 10])}):
        OnDevice.reads.clear()
        with pytest.raises(ValueError) if changes.get("cu_seqlens_k") is not None else contextlib.nullcontext():
            call(**on_device({**base_args(), **changes}))
        assert OnDevice.reads == ["cpu"]  # unpadded, and a malformed layout found: still one read
    metadata = on_device(base_args())
    positional, keywords = split_call(metadata)
    for validate, reads in ((True, ["cpu"]), (True, []), (False, [])):  # the second: remembered, not read again
        OnDevice.reads.clear()
        with checks_only(), pytest.raises(Exception, match="^$"):  # contract_errors.Launched: the checks passed
            op.varlen_attention(*positional, **keywords, validate=validate)
        assert OnDevice.reads == reads, (validate, OnDevice.reads)


def _i32(values):
    return torch.tensor(values, dtype=I32)
