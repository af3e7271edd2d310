"""The cuDNN-ragged function's host side, without cuDNN: what it hands the graph.

The graph itself needs CUDA and nvidia-cudnn-frontend (scripts/cudnn_ragged_smoke.py checks it
against the fp64 reference on a GPU); here, the per-call tensors and the mask options it derives
from TransformerEngine's pair of boundaries and FlashAttention's window, with a stand-in for the
two cudnn enums they use.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from varlen_workbench.workbench.audit.adapters import cudnn_ragged


@pytest.fixture
def enums(monkeypatch):
    stand_in = types.ModuleType("cudnn")
    stand_in.diagonal_alignment = types.SimpleNamespace(BOTTOM_RIGHT="bottom-right")
    monkeypatch.setitem(sys.modules, "cudnn", stand_in)


def _shape(causal=False, window=(-1, -1)):
    return cudnn_ragged._Shape(torch.bfloat16, 3, 4, 2, 64, 40, 50, causal, window, 0.125)


def test_offsets_come_from_the_padded_layout_and_lengths_from_the_real_one():
    shape = _shape()
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    padded_q = torch.tensor([0, 8, 8, 16], dtype=torch.int32)
    padded_k = torch.tensor([0, 6, 9, 20], dtype=torch.int32)
    meta = cudnn_ragged._metadata(shape, cu, cu, padded_q, padded_k)
    assert meta["q"].flatten().tolist() == meta["o"].flatten().tolist() == [i * 4 * 64 for i in (0, 8, 8, 16)]
    assert meta["k"].flatten().tolist() == [i * 2 * 64 for i in (0, 6, 9, 20)]  # GQA: the key side's heads
    assert meta["stats"].flatten().tolist() == [i * 4 for i in (0, 8, 8, 16)]  # one float per (row, head)
    assert meta["seq_len_q"].flatten().tolist() == [5, 0, 7] and meta["seq_len_q"].shape == (3, 1, 1, 1)
    assert meta["q"].dtype == torch.int64 and meta["seq_len_kv"].dtype == torch.int32
    assert shape.strides(4, 40) == [40 * 4 * 64, 64, 4 * 64, 1]  # (B, H, S, D) over a (T, H, D) buffer


def test_windows_and_causality_become_cudnns_bottom_right_band(enums):
    plain = cudnn_ragged._mask_options(_shape())
    assert plain["use_padding_mask"] and plain["diagonal_alignment"] == "bottom-right"
    assert "diagonal_band_left_bound" not in plain and "diagonal_band_right_bound" not in plain
    band = cudnn_ragged._mask_options(_shape(window=(2, 1)))
    # FlashAttention's left = 2 sees keys i-2..i+1; cuDNN's band excludes its left bound (TE adds 1)
    assert (band["diagonal_band_left_bound"], band["diagonal_band_right_bound"]) == (3, 1)
    causal = cudnn_ragged._mask_options(_shape(causal=True, window=(2, 5)))
    assert causal["use_causal_mask_bottom_right"] and causal["diagonal_band_left_bound"] == 3
    assert "diagonal_band_right_bound" not in causal  # causal is the right bound 0; cuDNN refuses it twice


def test_boundaries_that_cannot_build_a_graph_are_named():
    q = torch.zeros(4, 1, 16, dtype=torch.float16)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-D integer tensor"):
        cudnn_ragged._boundaries("cu_seqlens_q", [0, 4], None)
    with pytest.raises(ValueError, match="cu_seqlens_k has 3 entries; cu_seqlens_q has 2"):
        cudnn_ragged._boundaries("cu_seqlens_k", torch.tensor([0, 2, 4]), 1)
    with pytest.raises(TypeError, match="q must be a 3-D"):
        cudnn_ragged.cudnn_ragged_attention(q[0], q, q, torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4)
