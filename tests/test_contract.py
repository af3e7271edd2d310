"""Point 4 of the padding contract: every malformed input gets a clear error.

Each row of the catalogue is one malformed call: the exception type and a regex its message
must match (naming the argument, the offending index/value, and the fix).
"""
from __future__ import annotations

import pytest
import torch

from kernels.contract import check_scale, check_varlen_inputs
from workbench import Case, check_cu_seqlens, pack, region_labels, Region

I32 = torch.int32


def base_args():
    """A valid TE-style call: real [0,3,5,9], padded [0,4,8,13], 2 TAIL rows."""
    q = torch.randn(15, 4, 16)
    k = torch.randn(15, 2, 16)
    v = torch.randn(15, 2, 16)
    cu = torch.tensor([0, 3, 5, 9], dtype=I32)
    cu_pad = torch.tensor([0, 4, 8, 13], dtype=I32)
    return dict(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=4, max_seqlen_k=4,
        cu_seqlens_q_padded=cu_pad, cu_seqlens_k_padded=cu_pad.clone(), scale=None,
    )


def call(**changes):
    args = {**base_args(), **changes}
    positional = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    return check_varlen_inputs(*positional, **args, dtypes=(torch.float32, torch.float16, torch.bfloat16), head_dims=(16, 32, 64, 128))


CATALOGUE = [
    # (id, changes, exception, message regex)
    ("cu-not-tensor", dict(cu_seqlens_q=[0, 3, 5, 9]), TypeError, r"cu_seqlens_q must be a torch\.Tensor of int32, got list"),
    ("cu-float", dict(cu_seqlens_q=torch.tensor([0.0, 3, 5, 9])), TypeError, r"cu_seqlens_q must be an integer tensor .*got torch\.float32.*\.to\(torch\.int32\)"),
    ("cu-2d", dict(cu_seqlens_k=torch.tensor([[0, 3, 5, 9]], dtype=I32)), ValueError, r"cu_seqlens_k must be 1-D .*got shape \(1, 4\)"),
    ("cu-too-short", dict(cu_seqlens_q=torch.tensor([0], dtype=I32)), ValueError, r"cu_seqlens_q must hold at least 2 boundaries.*\[0, n\]"),
    ("cu-not-from-zero", dict(cu_seqlens_q=torch.tensor([1, 3, 5, 9], dtype=I32)), ValueError, r"cu_seqlens_q\[0\] = 1: .*must start at 0"),
    ("cu-decreasing", dict(cu_seqlens_k=torch.tensor([0, 3, 2, 9], dtype=I32)), ValueError, r"cu_seqlens_k decreases at index 2: cu_seqlens_k\[1\] = 3 > cu_seqlens_k\[2\] = 2"),
    ("padded-decreasing", dict(cu_seqlens_q_padded=torch.tensor([0, 4, 3, 13], dtype=I32)), ValueError, r"cu_seqlens_q_padded decreases at index 2"),
    ("padded-not-from-zero", dict(cu_seqlens_k_padded=torch.tensor([2, 4, 8, 13], dtype=I32)), ValueError, r"cu_seqlens_k_padded\[0\] = 2"),
    ("batch-mismatch-q-k", dict(cu_seqlens_k=torch.tensor([0, 3, 9], dtype=I32), cu_seqlens_k_padded=None, max_seqlen_k=6), ValueError, r"cu_seqlens_q describes 3 sequences but cu_seqlens_k describes 2"),
    ("batch-mismatch-padded", dict(cu_seqlens_q_padded=torch.tensor([0, 4, 13], dtype=I32)), ValueError, r"cu_seqlens_q_padded has 2 sequences but cu_seqlens_q has 3"),
    ("real-longer-than-padded", dict(cu_seqlens_q=torch.tensor([0, 3, 8, 9], dtype=I32), max_seqlen_q=5), ValueError, r"sequence 1 has 5 real tokens .*only 4 rows in the padded layout.*swap"),
    ("padded-end-past-q", dict(q=torch.randn(12, 4, 16)), ValueError, r"cu_seqlens_q_padded\[-1\] = 13 exceeds q\.shape\[0\] = 12"),
    ("real-end-past-k-no-padded", dict(cu_seqlens_k_padded=None, cu_seqlens_k=torch.tensor([0, 3, 5, 16], dtype=I32), max_seqlen_k=11), ValueError, r"cu_seqlens_k\[-1\] = 16 exceeds k and v\.shape\[0\] = 15"),
    ("max-seqlen-too-small", dict(max_seqlen_q=3), ValueError, r"max_seqlen_q = 3 is smaller than sequence 2's real length 4.*silently dropped"),
    ("max-seqlen-not-int", dict(max_seqlen_k=torch.tensor(4)), TypeError, r"max_seqlen_k must be a Python int, got Tensor"),
    ("max-seqlen-bool", dict(max_seqlen_k=True), TypeError, r"max_seqlen_k must be a Python int, got bool"),
    ("heads-not-multiple", dict(k=torch.randn(15, 3, 16), v=torch.randn(15, 3, 16)), ValueError, r"q has 4 heads, not a multiple of k's 3 heads"),
    ("head-dim-unsupported", dict(q=torch.randn(15, 4, 24), k=torch.randn(15, 2, 24), v=torch.randn(15, 2, 24)), ValueError, r"head_dim 24 .*not supported.*16, 32, 64, 128"),
    ("head-dim-q-k-differ", dict(k=torch.randn(15, 2, 32), v=torch.randn(15, 2, 32)), ValueError, r"q and k must have the same head_dim .*q 16 and k 32"),
    ("q-not-3d", dict(q=torch.randn(15, 64)), ValueError, r"q must be 3-D \(tokens, heads, head_dim\).*got shape \(15, 64\)"),
    ("k-v-shape-differ", dict(v=torch.randn(14, 2, 16)), ValueError, r"k and v must have the same shape"),
    ("dtype-mixed", dict(k=torch.randn(15, 2, 16).half(), v=torch.randn(15, 2, 16).half()), TypeError, r"q, k, v must share one dtype"),
    ("dtype-unsupported", dict(q=torch.randn(15, 4, 16).double(), k=torch.randn(15, 2, 16).double(), v=torch.randn(15, 2, 16).double()), TypeError, r"q has dtype torch\.float64; this implementation supports"),
    ("q-integer", dict(q=torch.ones(15, 4, 16, dtype=torch.int64)), TypeError, r"q must be a floating-point tensor"),
    ("q-not-tensor", dict(q=[[1.0]]), TypeError, r"q must be a torch\.Tensor, got list"),
    ("device-differs", dict(cu_seqlens_q=torch.tensor([0, 3, 5, 9], dtype=I32, device="meta")), ValueError, r"cu_seqlens_q is on meta but q is on cpu; move it"),
    ("scale-negative", dict(scale=-1.0), ValueError, r"scale = -1\.0 must be a finite positive number"),
    ("scale-nan", dict(scale=float("nan")), ValueError, r"scale = nan must be a finite positive number"),
    ("scale-tensor", dict(scale=torch.tensor(0.5)), TypeError, r"scale must be a Python float or None"),
]


@pytest.mark.parametrize("changes, exc, message", [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_malformed_input_gets_a_clear_error(changes, exc, message):
    with pytest.raises(exc, match=message):
        call(**changes)


def test_catalogue_is_large_and_distinct():
    assert len(CATALOGUE) >= 15
    assert len({c[0] for c in CATALOGUE}) == len(CATALOGUE)
    assert len({c[3] for c in CATALOGUE}) == len(CATALOGUE)


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
    check_varlen_inputs(*batch.args(), cu_seqlens_q_padded=batch.cu_seqlens_q_padded, cu_seqlens_k_padded=batch.cu_seqlens_k_padded)
