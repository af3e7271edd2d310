"""Gradient health: states never call NaN healthy, the first non-finite parameter is the first in backward order."""

import math

import pytest
import torch
from torch import nn

from varlen_workbench.workbench.instruments.health import GradientHealth, State, Thresholds, classify, token_norms
from varlen_workbench.workbench.layout import Region, region_labels


class NaNGradient(torch.autograd.Function):
    """Identity in forward; its backward plants NaN in the gradient flowing to earlier layers."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Planted(nn.Module):
    """0 -> relu -> 1 -> [NaN in backward] -> 2. Backward order: 2, then 1, then 0."""

    def __init__(self, plant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 8, bias=False) for _ in range(3)])
        self.plant = plant

    def forward(self, x):
        x = self.layers[1](torch.relu(self.layers[0](x)))
        if self.plant:
            x = NaNGradient.apply(x)
        return self.layers[2](x).square().mean()


def _train(model, optimizer, monitor, steps, plant_at):
    for step in range(steps):
        model.plant = step == plant_at
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
        loss.backward()
        optimizer.step()
        monitor.step(loss)
        optimizer.zero_grad()


@pytest.mark.parametrize(
    "norm, nonfinite, expected",
    [
        (float("nan"), 0, State.NONFINITE),
        (1.0, 3, State.NONFINITE),
        (float("inf"), 0, State.EXPLODING),  # finite elements whose norm overflowed
        (1e4, 0, State.EXPLODING),
        (1e-9, 0, State.VANISHING),
        (0.0, 0, State.VANISHING),
        (1.0, 0, State.HEALTHY),
    ],
)
def test_classify_never_calls_nan_healthy(norm, nonfinite, expected):
    assert classify(norm, nonfinite, Thresholds(vanishing=1e-7, exploding=1e3)) is expected


def test_thresholds_are_validated():
    with pytest.raises(ValueError, match="vanishing < exploding"):
        Thresholds(vanishing=1.0, exploding=0.5)
    with pytest.raises(ValueError, match="finite"):
        Thresholds(exploding=float("nan"))


def test_planted_nan_names_the_first_parameter_in_backward_order():
    model = Planted(plant=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with GradientHealth(model, optimizer) as monitor:
        _train(model, optimizer, monitor, steps=4, plant_at=2)
    before = monitor.history[1]
    assert all(s.state is State.HEALTHY for s in before.params.values())
    bad = monitor.history[2]
    # Registration order is 0, 1, 2; backward order is 2, 1, 0. Layer 2 stays finite.
    assert list(bad.params) == ["layers.2.weight", "layers.1.weight", "layers.0.weight"]
    assert bad.params["layers.2.weight"].state is State.HEALTHY
    assert bad.nonfinite_grads == ["layers.1.weight", "layers.0.weight"]
    assert bad.params["layers.1.weight"].nonfinite == 64
    chain = monitor.causal_chain()
    assert chain.first_parameter == "layers.1.weight"
    kinds = [e.kind for e in chain.events]
    assert kinds == ["gradient", "gradient", "optimizer state", "parameter", "loss"]
    assert chain.events[0].step == 2 and chain.events[-1].step == 3
    assert "layers.1.weight exp_avg" in chain.events[2].names
    assert math.isnan(monitor.history[3].loss)
    assert ("layers.1.weight", 2, State.HEALTHY, State.NONFINITE) in [
        (t.param, t.step, t.before, t.after) for t in monitor.transitions
    ]
    assert "first in backward order" in str(chain)


def test_arrival_norms_survive_clipping():
    """clip_grad_norm_ multiplies every gradient by NaN after a NaN step; the monitor measured before."""
    model = Planted(plant=True)
    monitor = GradientHealth(model)
    model(torch.randn(4, 8)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert all(torch.isnan(p.grad).all() for p in model.parameters())
    record = monitor.step()
    assert record.nonfinite_grads[0] == "layers.1.weight"
    assert record.params["layers.2.weight"].state is State.HEALTHY
    assert monitor.causal_chain().first_parameter == "layers.1.weight"


def test_every_step_catches_an_update_that_alone_makes_a_parameter_nan():
    model = Planted(plant=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    with GradientHealth(model, optimizer, optimizer_checks="every-step") as monitor:
        model.layers[0].weight.data.zero_()  # relu(0) = 0 -> layer 1's gradient is exactly 0 -> Adam 0/0
        loss = model(torch.randn(4, 8))
        loss.backward()
        optimizer.step()
        record = monitor.step(loss)
    assert record.nonfinite_grads == []
    assert "layers.1.weight" in record.nonfinite_params
    assert monitor.causal_chain().origin.kind == "parameter"


def test_states_and_transitions_follow_thresholds():
    model = Planted(plant=False)
    monitor = GradientHealth(model, thresholds=Thresholds(vanishing=1e-7, exploding=1e-3))
    model(torch.randn(4, 8)).backward()
    monitor.step()
    assert set(monitor.states().values()) == {State.EXPLODING}
    assert len(monitor.transitions) == 3 and not monitor.causal_chain()
    monitor.close()


def test_token_norms_by_region():
    cu, cu_padded = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 7], dtype=torch.int32)
    regions = region_labels(cu, cu_padded, 9)
    embed = nn.Embedding(10, 4)
    monitor = GradientHealth(embed)
    monitor.watch_tokens("embeddings", embed, regions)
    x = embed(torch.arange(9))
    mask = (regions == Region.REAL).float()[:, None]
    (x * mask).sum().backward()
    monitor.step()
    tokens = monitor.tokens[-1]
    norms = tokens.token_norms["embeddings"]
    assert torch.equal(norms[regions != Region.REAL], torch.zeros(4, dtype=torch.float64))
    assert torch.allclose(norms[regions == Region.REAL], torch.full((5,), 2.0, dtype=torch.float64))
    assert tokens.nonfinite_in("TAIL", "embeddings") == 0
    with torch.no_grad():
        embed(torch.arange(3))  # evaluation: nothing to watch, no error
    with pytest.raises(ValueError, match="regions has shape"):
        embed(torch.arange(4))


def test_token_norms_keep_nan_and_huge_rows():
    x = torch.tensor([[3e38, 3e38], [float("nan"), 0.0], [3.0, 4.0]])
    norms = token_norms(x)
    assert math.isfinite(norms[0]) and math.isnan(norms[1]) and norms[2] == 5.0


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="model must be"):
        GradientHealth(object())
    with pytest.raises(ValueError, match="optimizer_checks"):
        GradientHealth(nn.Linear(2, 2), optimizer_checks="sometimes")
    with pytest.raises(ValueError, match="requires_grad"):
        GradientHealth(nn.Linear(2, 2).requires_grad_(False))
