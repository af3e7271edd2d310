"""Plots: each one draws what its record says (checked on the artists), in the house style."""

import matplotlib
import numpy as np
import pytest
import torch
from torch import nn

from varlen_workbench.workbench.instruments.health import GradientHealth
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.plots import (
    FACE,
    attention_mask,
    plot_errors,
    plot_health,
    plot_layout,
    plot_nan_map,
    plot_token_norms,
)
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.reference import reference_attention
from varlen_workbench.workbench.sweeps import sweep


def _leaky(q, k, v, *args, **kwargs):
    """The oracle plus a planted leak: every padding row of the output holds NaN."""
    out = reference_attention(q, k, v, *args, **kwargs).to(q.dtype)
    real = torch.zeros(q.shape[0], dtype=torch.bool)
    real[: int(args[0][-1])] = True
    return torch.where(real[:, None, None], out, q * float("nan"))


CASE = Case(seqlens_q=(3, 4), heads=1, head_dim=16, tail_q=3)


def test_token_norms_mark_the_nan_rows_and_shade_padding():
    record = probe(_leaky, pack(CASE, device="cpu"), name="leaky")
    fig = plot_token_norms(record, ["out"])
    assert tuple(fig.get_facecolor()) == matplotlib.colors.to_rgba(FACE)
    ax = fig.axes[0]
    nan_markers = [line for line in ax.lines if line.get_label().startswith("NaN/Inf")]
    assert nan_markers and list(nan_markers[0].get_xdata()) == [7, 8, 9]
    shaded = [p for p in ax.patches if p.get_alpha() == 0.18]
    assert len(shaded) == 1  # the TAIL run
    assert "leaky" in ax.get_title(loc="left")
    with pytest.raises(ValueError, match="not in the record"):
        plot_token_norms(record, ["lse"])


def test_nan_map_cells_show_counts_and_failures():
    def point(case):
        if case.tail_q == 5:
            raise RuntimeError("planted")
        return probe(_leaky, pack(case, device="cpu"), reference=False, backward=False)

    result = sweep(point, base=CASE, seqlens_q=[(3, 4), (2,)], tail_q=[0, 2, 5], progress=False)
    fig = plot_nan_map(result, rows="seqlens_q", cols="tail_q")
    texts = [t.get_text() for t in fig.axes[0].texts]
    # (3, 4) with tail 0/2, then (2,) with tail 0/2: 16 features per row of out.
    assert texts == ["0", "32", "RuntimeError", "0", "32", "RuntimeError"]
    with pytest.raises(ValueError, match="not an axis"):
        plot_nan_map(result, rows="seqlens_q", cols="impl")


def test_errors_plot_has_a_bar_per_tensor_and_a_nan_bar():
    good = probe(reference_attention, pack(CASE, device="cpu"), name="oracle")
    bad = probe(lambda *a, **k: reference_attention(*a, **k) * float("nan"), pack(CASE, device="cpu"), name="nan")
    fig = plot_errors([good, bad])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["out", "dq", "dk", "dv"]
    assert [t.get_text() for t in ax.texts] == ["NaN"] * 4
    with pytest.raises(ValueError, match="reference=True"):
        plot_errors([probe(reference_attention, pack(CASE, device="cpu"), reference=False)])


def test_health_plot_marks_transitions_and_the_first_nonfinite_parameter():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    monitor = GradientHealth(model)
    for step in range(3):
        y = model(torch.ones(2, 3))
        if step == 2:
            y = y * torch.tensor(float("nan"))
        y.sum().backward()
        monitor.step()
        model.zero_grad()
    fig = plot_health(monitor)
    ax = fig.axes[0]
    assert any(t.get_text() == f"first non-finite: {monitor.causal_chain().first_parameter}" for t in ax.texts)
    transitions = [line for line in ax.lines if line.get_marker() == "o" and len(line.get_xdata()) == 1]
    assert len(transitions) == len(monitor.transitions) == 4
    with pytest.raises(ValueError, match="not watched"):
        plot_health(monitor, ["nope"])


@pytest.mark.parametrize("causal", [False, True])
def test_attention_mask_follows_the_contract(causal):
    case = Case(
        seqlens_q=(2, 3),
        seqlens_k=(3, 1),
        padded_q=(3, 3),
        padded_k=(4, 2),
        tail_q=1,
        tail_k=1,
        heads=1,
        head_dim=16,
        causal=causal,
    )
    mask = attention_mask(pack(case, device="cpu"))
    expected = torch.zeros(7, 7, dtype=torch.bool)
    if causal:  # bottom-right aligned: query i of a len_q sequence sees keys j <= i + len_k - len_q
        expected[0, :2] = expected[1, :3] = True
        expected[5, 4] = True  # seq 1: len_q 3 > len_k 1, only its last query sees the key
    else:
        expected[0:2, 0:3] = True
        expected[3:6, 4] = True
    assert torch.equal(mask, expected)
    fig = plot_layout(case)
    assert np.array_equal(fig.axes[1].images[0].get_array(), mask.numpy())


def test_layout_ticks_are_whole_rows_even_for_a_tiny_layout():
    fig = plot_layout(Case(seqlens_q=(1,), tail_k=1, heads=1, head_dim=16))
    ticks = [t for ax in fig.axes[:2] for t in (*ax.get_xticks(), *ax.get_yticks())]  # strip, then mask
    assert ticks and all(float(t).is_integer() for t in ticks)
