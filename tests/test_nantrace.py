"""NaN provenance: the tracer names the op that made the first NaN, where anomaly mode does not."""

import pytest
import torch
from torch import nn

from varlen_workbench.workbench.instruments.nantrace import trace_nans
from varlen_workbench.workbench.instruments.poison import poisoned_memory


@torch.library.custom_op("wbtest::stale_rows", mutates_args=())
def stale_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Doubles the first `rows` rows; the rest is a planted garbage write (NaN), as an unguarded kernel leaves it."""
    out = torch.empty_like(x)
    out[:rows] = 2 * x[:rows]
    out[rows:] = float("nan")
    return out


@stale_rows.register_fake
def _(x, rows):
    return torch.empty_like(x)


def _stale_rows_backward(ctx, grad):
    dx = torch.zeros_like(grad)
    dx[: ctx.rows] = 2 * grad[: ctx.rows]
    return dx, None


def _stale_rows_setup(ctx, inputs, output):
    ctx.rows = inputs[1]


stale_rows.register_autograd(_stale_rows_backward, setup_context=_stale_rows_setup)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 1)

    def forward(self, x, rows):
        h = stale_rows(self.encoder(x), rows)
        # Only the real rows feed the head ...
        y = self.head(h[:rows]).sum()
        # ... until a later reduction over every row (a padded-batch statistic) reads the stale ones.
        return y + 1e-3 * h.detach().pow(2).mean()


def test_tracer_names_the_custom_op_that_anomaly_mode_misses():
    model, x = Model(), torch.randn(6, 4)
    with torch.autograd.detect_anomaly(check_nan=True):
        loss = model(x, rows=4)
        loss.backward()  # no error: every backward output is finite
    assert torch.isnan(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())

    model.zero_grad()
    with trace_nans(model) as trace:
        loss = model(x, rows=4)
        loss.backward()
    culprit = trace.culprit
    assert culprit is not None
    assert culprit.op == "wbtest.stale_rows.default"  # one op: its body is invisible to the mode
    assert culprit.phase == "forward"
    assert culprit.module == "Model"
    assert culprit.input_shapes[0] == (6, 4) and culprit.output_shapes == ((6, 4),)
    assert culprit.nan == 8 and culprit.inf == 0
    assert any("stale_rows(self.encoder(x), rows)" in line for line in culprit.stack)


def test_backward_culprit_is_mapped_to_its_forward_op_and_module():
    """sqrt(0) is finite in forward; its backward divides by 0."""

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(3, 3)
            nn.init.constant_(self.proj.weight, -1.0)
            nn.init.zeros_(self.proj.bias)

        def forward(self, x):
            return torch.relu(self.proj(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Root()

        def forward(self, x):
            return torch.sqrt(self.block(x)).sum()

    net = Net()
    with trace_nans(net) as trace:
        loss = net(torch.ones(2, 3))
        assert torch.isfinite(loss)
        loss.backward()
    culprit = trace.culprit
    assert culprit.phase == "backward"
    assert culprit.node == "SqrtBackward0"
    assert culprit.forward.op == "aten.sqrt.default"
    assert culprit.forward.module == "Net"
    assert culprit.inf > 0
    assert "created in forward by aten.sqrt.default" in str(culprit)


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_module_path_is_the_innermost_module():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Identity(), Log()))
    with torch.no_grad():
        model[0].weight.fill_(-1.0)
        model[0].bias.zero_()
    with trace_nans(model) as trace:
        model(torch.ones(1, 2))
    assert trace.culprit.module == "1.1"


def test_masking_with_inf_is_not_blamed_but_nan_from_it_is():
    scores = torch.randn(2, 3)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    with trace_nans() as trace:
        masked = scores.masked_fill(~mask, float("-inf"))  # -inf on purpose: not a culprit
        assert trace.culprit is None
        masked.softmax(-1)  # the fully masked row: exp(-inf - (-inf)) = NaN is born here
    assert trace.culprit.op == "aten._softmax.default"
    assert trace.culprit.nan == 3


def test_clean_run_and_uninitialised_allocations():
    with trace_nans() as trace:
        (torch.randn(3) * 2).sum()
    assert trace.culprit is None and trace.ops >= 3
    with poisoned_memory(), trace_nans() as trace:
        buffer = torch.empty(4)
        buffer[:2] = 1.0
        buffer.sum()
    # NaN came from memory, not from an op: no culprit, the allocation is listed.
    assert trace.culprit is None
    assert [a.op for a in trace.uninitialised] == ["aten.empty.memory_format"]


def test_raise_on_culprit_and_hooks_removed():
    from torch.nn.modules import module as nn_module

    before = len(nn_module._global_forward_hooks)
    with pytest.raises(FloatingPointError, match="aten.log.default"):
        with trace_nans(raise_on_culprit=True):
            torch.log(torch.tensor([-1.0]))
    assert len(nn_module._global_forward_hooks) == before
    with pytest.raises(TypeError, match="model must be"):
        trace_nans("model")
