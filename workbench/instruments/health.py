"""Gradient health: per-step, per-parameter gradient norms, states, transitions and a causal chain.

    monitor = GradientHealth(model, optimizer, thresholds=Thresholds(vanishing=1e-7, exploding=1e3))
    for batch in data:
        loss = model(batch)
        loss.backward()
        optimizer.step()
        monitor.step(loss)          # after optimizer.step(), before zero_grad()
        optimizer.zero_grad()
    print(monitor.causal_chain())   # first parameter to go non-finite in backward order, then what followed

How it measures, and why:

* A `register_post_accumulate_grad_hook` on every parameter records the order in which
  gradients arrive during backward and their L2 norm *at arrival*. Backward order is what makes
  "the first parameter to go non-finite" meaningful (the one nearest to where the NaN entered),
  and measuring at arrival keeps the evidence intact when a later `clip_grad_norm_` multiplies
  every gradient by a NaN coefficient.
* The norms stay on the device until `step()`, which reads them with one synchronisation.
  Non-finite elements are counted only for parameters whose norm is not finite (a finite norm
  proves every element finite), so a healthy step costs one norm per parameter.
* NaN is never healthy: a NaN or Inf element makes the state NON_FINITE before any threshold is
  looked at (every comparison with NaN is false, which is how a threshold-only detector calls a
  NaN gradient healthy). A norm that overflows to Inf while every element is finite is EXPLODING.
* With an optimizer, `step()` also checks the optimizer's state tensors (Adam's moments...) and
  the parameters themselves, so the chain can say what the bad gradient did next. By default
  (`optimizer_checks="on-nonfinite"`) only in steps whose loss or some gradient is non-finite:
  a parameter that an update alone turns NaN (all gradients finite) then shows one step later,
  through the loss. `"every-step"` catches it in its own step, for about one more norm per
  state tensor.

`token_norms(x)` gives per-row gradient norms of a packed (THD) tensor; `watch_tokens` records
them for an activation during training, labelled REAL / GAP / TAIL.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from varlen_workbench.workbench.layout import Region

OPTIMIZER_CHECKS = ("on-nonfinite", "every-step")


class State(str, enum.Enum):
    HEALTHY = "healthy"
    VANISHING = "vanishing"
    EXPLODING = "exploding"
    NONFINITE = "non-finite"


@dataclass(frozen=True)
class Thresholds:
    """A gradient norm below `vanishing` vanishes, above `exploding` explodes."""

    vanishing: float = 1e-7
    exploding: float = 1e3

    def __post_init__(self) -> None:
        if not (math.isfinite(self.vanishing) and math.isfinite(self.exploding)):
            raise ValueError(f"Thresholds must be finite numbers, got vanishing={self.vanishing}, exploding={self.exploding}.")
        if not 0 <= self.vanishing < self.exploding:
            raise ValueError(
                f"Thresholds need 0 <= vanishing < exploding, got vanishing={self.vanishing}, exploding={self.exploding}."
            )


def classify(norm: float, nonfinite: int, thresholds: Thresholds = Thresholds()) -> State:
    """The state of one gradient from its L2 norm and its count of NaN/Inf elements.

    Non-finite is decided first and explicitly, so no comparison ever sees a NaN.
    """
    if nonfinite > 0 or math.isnan(norm):
        return State.NONFINITE
    if norm > thresholds.exploding:  # includes a norm that overflowed to +inf from finite elements
        return State.EXPLODING
    if norm < thresholds.vanishing:
        return State.VANISHING
    return State.HEALTHY


@dataclass(frozen=True)
class ParamStats:
    """One parameter's gradient in one step; `order` is its arrival index in backward."""

    name: str
    norm: float
    nonfinite: int
    state: State
    order: int


@dataclass(frozen=True)
class Transition:
    """A parameter's gradient changed state (every parameter starts HEALTHY)."""

    param: str
    step: int
    before: State
    after: State

    def __str__(self) -> str:
        return f"step {self.step}: {self.param} {self.before.value} -> {self.after.value}"


@dataclass
class StepRecord:
    step: int
    params: dict[str, ParamStats]  # in backward arrival order; parameters without a gradient are absent
    loss: float | None
    nonfinite_state: list[str]  # optimizer state tensors holding NaN/Inf after the step, e.g. "fc.weight exp_avg"
    nonfinite_params: list[str]  # parameters holding NaN/Inf after the optimizer step

    @property
    def nonfinite_grads(self) -> list[str]:
        return [name for name, s in self.params.items() if s.state is State.NONFINITE]


@dataclass(frozen=True)
class ChainEvent:
    step: int
    kind: str  # "loss", "gradient", "optimizer state", "parameter"
    names: tuple[str, ...]
    note: str

    def __str__(self) -> str:
        shown = ", ".join(self.names[:6]) + (f" (+{len(self.names) - 6} more)" if len(self.names) > 6 else "")
        return f"step {self.step}: {self.kind} non-finite: {shown}" + (f" — {self.note}" if self.note else "")


@dataclass(frozen=True)
class CausalChain:
    """What went non-finite first and what followed, in causal order."""

    events: tuple[ChainEvent, ...]

    @property
    def first_parameter(self) -> str | None:
        """The first parameter whose gradient went non-finite, in backward order."""
        for event in self.events:
            if event.kind == "gradient":
                return event.names[0]
        return None

    @property
    def origin(self) -> ChainEvent | None:
        return self.events[0] if self.events else None

    def __bool__(self) -> bool:
        return bool(self.events)

    def __str__(self) -> str:
        if not self.events:
            return "no non-finite value observed"
        return "\n".join(f"{i}. {event}" for i, event in enumerate(self.events, 1))


def token_norms(x: torch.Tensor) -> torch.Tensor:
    """Per-row (per-token) L2 norm of a packed (T, ...) tensor, in float64 on the CPU.

    Float64 keeps huge finite rows finite; NaN and Inf rows stay NaN and Inf.
    """
    return x.detach().reshape(x.shape[0], -1).double().norm(dim=1).cpu()


@dataclass(frozen=True)
class TokenNorms:
    """Per-token gradient norms of watched packed tensors in one step (plots take it like a ProbeRecord)."""

    step: int
    token_norms: dict[str, torch.Tensor]
    region_labels: dict[str, torch.Tensor] = field(repr=False)

    def regions(self, name: str) -> torch.Tensor:
        return self.region_labels[name]

    def nonfinite_in(self, region: Region | str, name: str) -> int:
        region = Region[region] if isinstance(region, str) else region
        return int((~torch.isfinite(self.token_norms[name][self.region_labels[name] == region])).sum())


def _floats(tensors: list[torch.Tensor]) -> list[float]:
    """Python floats of 0-d tensors with one transfer per device (one sync on CUDA)."""
    values: list[float] = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        stacked = torch.stack([tensors[i] for i in indices]).tolist()  # stack promotes mixed dtypes
        for i, v in zip(indices, stacked):
            values[i] = v
    return values


def _grad_norm(grad: torch.Tensor) -> torch.Tensor:
    # Half-precision gradients are reduced in float32 so that the norm of finite elements does
    # not overflow at 65504 and masquerade as exploding.
    dtype = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else None
    return torch.linalg.vector_norm(grad, dtype=dtype)


class GradientHealth:
    """Watches the gradients of `model` (and optionally `optimizer`'s state) step by step.

    Call `step(loss)` once per training step, after `optimizer.step()` and before
    `zero_grad()`. Use as a context manager, or call `close()`, to remove the hooks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        thresholds: Thresholds = Thresholds(),
        optimizer_checks: str = "on-nonfinite",
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}.")
        if not isinstance(thresholds, Thresholds):
            raise TypeError(
                "thresholds must be a varlen_workbench.workbench.instruments.health.Thresholds(vanishing=..., exploding=...)."
            )
        if optimizer_checks not in OPTIMIZER_CHECKS:
            raise ValueError(f"optimizer_checks = {optimizer_checks!r} must be one of {OPTIMIZER_CHECKS}.")
        self.model, self.optimizer, self.thresholds = model, optimizer, thresholds
        self.optimizer_checks = optimizer_checks
        self.names = {p: name for name, p in model.named_parameters() if p.requires_grad}
        self._params = {name: p for p, name in self.names.items()}
        if not self.names:
            raise ValueError("model has no parameter with requires_grad=True; there is nothing to watch.")
        self.history: list[StepRecord] = []
        self.transitions: list[Transition] = []
        self.tokens: list[TokenNorms] = []
        self._arrived: dict[str, torch.Tensor] = {}  # insertion order = backward arrival order
        self._tokens: dict[str, torch.Tensor] = {}
        self._token_regions: dict[str, torch.Tensor] = {}
        self._state = {name: State.HEALTHY for name in self.names.values()}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.names]
        self._module_hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}

    # -- recording ---------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            # Re-assigning keeps the first arrival's position (gradient accumulation).
            self._arrived[self.names[param]] = _grad_norm(param.grad)

    def watch_tokens(
        self, name: str, target: torch.Tensor | torch.nn.Module, regions: torch.Tensor
    ) -> torch.Tensor | torch.nn.Module:
        """Records per-token gradient norms of a packed activation in backward, by region.

        `target` is an activation tensor (watched in this step only; returned, so it can wrap
        an expression in a forward) or a module whose (T, ...) output is watched every step
        (e.g. the embedding). `regions` labels the T rows (`PackedBatch.regions_q`,
        `region_labels(...)`); watching the same name again replaces them.
        """
        self._token_regions[name] = regions.cpu()
        if isinstance(target, torch.nn.Module):
            if name in self._module_hooks:
                self._module_hooks.pop(name).remove()
            # Under no_grad (evaluation) there is no backward to watch.
            self._module_hooks[name] = target.register_forward_hook(
                lambda module, args, output: self._watch_tensor(name, output) if output.requires_grad else None
            )
        else:
            self._watch_tensor(name, target)
        return target

    def _watch_tensor(self, name: str, x: torch.Tensor) -> None:
        regions = self._token_regions[name]
        if not isinstance(x, torch.Tensor) or not x.requires_grad:
            raise ValueError(
                f"watch_tokens({name!r}): the watched value must be a tensor that requires grad (an activation in the graph)."
            )
        if regions.shape != (x.shape[0],):
            raise ValueError(
                f"watch_tokens({name!r}): regions has shape {tuple(regions.shape)} but the activation has {x.shape[0]} rows; "
                "pass one Region label per row (e.g. batch.regions_q), again whenever the layout changes."
            )
        x.register_hook(lambda grad: self._tokens.__setitem__(name, token_norms(grad)))

    def step(self, loss: torch.Tensor | float | None = None) -> StepRecord:
        """Closes one training step: classifies every gradient that arrived and records transitions."""
        index = len(self.history)
        names = list(self._arrived)
        norms = _floats(list(self._arrived.values()))
        params = {}
        for order, (name, norm) in enumerate(zip(names, norms)):
            nonfinite = 0
            if not math.isfinite(norm):
                grad = self._params[name].grad
                nonfinite = int((~torch.isfinite(grad)).sum()) if grad is not None else 0
            params[name] = ParamStats(name, norm, nonfinite, classify(norm, nonfinite, self.thresholds), order)
        for name, stats in params.items():
            if stats.state is not self._state[name]:
                self.transitions.append(Transition(name, index, self._state[name], stats.state))
                self._state[name] = stats.state
        loss_value = None if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        suspicious = any(s.state is State.NONFINITE for s in params.values()) or (
            loss_value is not None and not math.isfinite(loss_value)
        )
        state_bad, params_bad = self._check_optimizer() if suspicious or self.optimizer_checks == "every-step" else ([], [])
        record = StepRecord(index, params, loss_value, state_bad, params_bad)
        self.history.append(record)
        if self._tokens:
            self.tokens.append(TokenNorms(index, dict(self._tokens), dict(self._token_regions)))
        self._arrived.clear()
        self._tokens.clear()
        return record

    def _check_optimizer(self) -> tuple[list[str], list[str]]:
        """Names of non-finite optimizer state tensors and parameters (one norm each, one sync)."""
        if self.optimizer is None:
            return [], []
        labels, tensors = [], []
        for param, name in self.names.items():
            labels.append(("param", name))
            tensors.append(param.detach())
            for key, value in self.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                    labels.append(("state", f"{name} {key}"))
                    tensors.append(value)
        norms = _floats(list(torch._foreach_norm(tensors)))
        # A finite norm proves every element finite; an infinite one may be an overflow of finite elements.
        bad = [
            label
            for label, t, norm in zip(labels, tensors, norms)
            if not math.isfinite(norm) and not bool(torch.isfinite(t).all())
        ]
        return [n for kind, n in bad if kind == "state"], [n for kind, n in bad if kind == "param"]

    # -- reading -------------------------------------------------------------------------
    def norms(self, name: str) -> list[float]:
        """Gradient norm of `name` at every step (NaN where it had no gradient)."""
        return [r.params[name].norm if name in r.params else math.nan for r in self.history]

    def states(self, step: int = -1) -> dict[str, State]:
        return {name: s.state for name, s in self.history[step].params.items()}

    def causal_chain(self) -> CausalChain:
        """The first step where anything went non-finite, in causal order, then the loss that followed.

        Within that step: the loss (computed in forward, before backward), the gradients in
        backward arrival order (the first one is the origin in backward), the optimizer state,
        the parameters after the update; then the first later step whose loss is non-finite.
        """
        events: list[ChainEvent] = []
        first = next((r for r in self.history if _any_nonfinite(r)), None)
        if first is None:
            return CausalChain(())
        loss_bad = first.loss is not None and not math.isfinite(first.loss)
        if loss_bad:
            events.append(ChainEvent(first.step, "loss", ("loss",), f"loss = {first.loss}"))
        grads = first.nonfinite_grads
        if grads:
            s = first.params[grads[0]]
            events.append(
                ChainEvent(first.step, "gradient", (grads[0],), f"first in backward order ({s.nonfinite} non-finite elements)")
            )
        if len(grads) > 1:
            events.append(ChainEvent(first.step, "gradient", tuple(grads[1:]), "then, in backward order"))
        if first.nonfinite_state:
            events.append(ChainEvent(first.step, "optimizer state", tuple(first.nonfinite_state), "after optimizer.step()"))
        if first.nonfinite_params:
            events.append(ChainEvent(first.step, "parameter", tuple(first.nonfinite_params), "after optimizer.step()"))
        if not loss_bad:
            later = next((r for r in self.history[first.step + 1 :] if r.loss is not None and not math.isfinite(r.loss)), None)
            if later is not None:
                events.append(ChainEvent(later.step, "loss", ("loss",), f"loss = {later.loss}"))
        return CausalChain(tuple(events))

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        for handle in [*self._handles, *self._module_hooks.values()]:
            handle.remove()
        self._handles.clear()
        self._module_hooks.clear()

    def __enter__(self) -> GradientHealth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _any_nonfinite(record: StepRecord) -> bool:
    loss_bad = record.loss is not None and not math.isfinite(record.loss)
    return loss_bad or bool(record.nonfinite_grads or record.nonfinite_state or record.nonfinite_params)
