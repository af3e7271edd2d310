"""NaN provenance: the first operation, forward or backward, that turned finite values into NaN/Inf.

    with trace_nans(model) as trace:
        loss = model(batch)
        loss.backward()
    print(trace.culprit)   # op, phase, module path, shapes; for backward ops the forward op that made them

How it works. A `TorchDispatchMode` sees every operation below autograd: aten ops in forward,
the ops autograd runs in backward (they execute under the mode too), and a `torch.library`
custom op as *one* op (its body runs with the mode switched off; a custom op's registered
backward shows as the ops it calls). Before each op it notes whether the floating-point inputs
(tensors and scalars) hold NaN or Inf; after it, whether the outputs do. The culprit is the
first op whose output holds a NaN that no input held, or an Inf while every input was finite:
`exp(-inf - (-inf)) = NaN` is caught although its input held -inf on purpose (masking), and
`masked_fill(x, mask, -inf)` is not blamed. Allocations (`empty*`) are never blamed: their
output is uninitialised by contract. Those that returned NaN/Inf (under `poisoned_memory`) are
listed in `trace.uninitialised`: the place to look when a NaN propagates with no culprit, as
with a buffer allocated and partly written by aten ops (every later op sees NaN in an input,
so none of them made it). A custom op that does the same inside its body is caught. Global
module hooks keep the module path; in backward, `torch._C._current_autograd_node()` names the
autograd node, which is mapped to the forward op whose outputs it belongs to.

Compared with `torch.autograd.detect_anomaly()`: anomaly mode checks only the *outputs of
backward nodes*, raising at the first backward function that returns NaN, and records forward
stack traces to name the forward op of that node. It never looks at forward values. A kernel
that writes garbage or NaN into rows nobody reads until a later reduction (the uncovered output
rows of pytorch/pytorch#176793) makes the loss NaN in forward while every backward output may
stay finite, and anomaly mode stays silent; when the NaN does reach a gradient (`0 * NaN` in a
weight gradient downstream), anomaly mode names that downstream node, not the kernel. This
tracer names the kernel's op in forward. Its price is a finiteness check of every op's inputs
and outputs: a debugging tool, like anomaly mode.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops whose output is uninitialised memory by contract: never the culprit.
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}


@dataclass(frozen=True)
class ForwardOp:
    """The forward op that created an autograd node."""

    op: str
    module: str
    input_shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Culprit:
    """The first op that produced NaN/Inf from inputs that did not hold it."""

    op: str  # e.g. "aten.sqrt.default", "workbench.uncovered_rows_attention.default"
    phase: str  # "forward" or "backward"
    module: str  # module path of the forward call ("" outside any module)
    index: int  # position among the ops the tracer saw
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    nan: int  # NaN elements in the outputs
    inf: int  # +-Inf elements in the outputs
    node: str | None = None  # backward: the autograd node running the op, e.g. "SqrtBackward0"
    forward: ForwardOp | None = None  # backward: the forward op that created `node`
    stack: tuple[str, ...] = field(default=(), repr=False)  # forward: the user's source lines

    def __str__(self) -> str:
        lines = [
            f"first non-finite {self.phase} op: {self.op} (op #{self.index})",
            f"  module: {self.module or '<no module>'}",
            f"  inputs {list(self.input_shapes)} -> outputs {list(self.output_shapes)}: {self.nan} NaN, {self.inf} Inf",
        ]
        if self.node is not None:
            lines.append(f"  autograd node: {self.node}")
        if self.forward is not None:
            lines.append(
                f"  created in forward by {self.forward.op} in {self.forward.module or '<no module>'} from inputs {list(self.forward.input_shapes)}"
            )
        lines += [f"  at {frame}" for frame in self.stack[-3:]]
        return "\n".join(lines)


def _nonfinite(values: list[Any]) -> tuple[int, int]:
    """(NaN count, Inf count) over the floating tensors and Python floats in `values`."""
    nan = inf = 0
    for x in values:
        if isinstance(x, torch.Tensor):
            if (x.is_floating_point() or x.is_complex()) and x.numel() and x.device.type != "meta":
                nan += int(torch.isnan(x).sum())
                inf += int(torch.isinf(x).sum())
        elif isinstance(x, float):
            nan += math.isnan(x)
            inf += math.isinf(x)
    return nan, inf


def _shapes(values: list[Any]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(x.shape) for x in values if isinstance(x, torch.Tensor))


_ROOT = Path(__file__).resolve().parents[2]


def _where(filename: str) -> str:
    """A frame's file as a reader can place it: this repository's files relative to it, and a
    notebook cell (which IPython compiles into a temporary `ipykernel_*` file) as `<cell>`."""
    if "ipykernel_" in filename:
        return "<cell>"
    try:
        return str(Path(filename).resolve().relative_to(_ROOT))
    except ValueError:
        return filename


def _user_stack() -> tuple[str, ...]:
    """Source lines of the current Python stack outside torch and this module."""
    frames = traceback.extract_stack()[:-1]
    keep = [f for f in frames if "/torch/" not in f.filename and f.filename != __file__]
    return tuple(f"{_where(f.filename)}:{f.lineno} {f.line}" for f in keep)


class NaNTrace(TorchDispatchMode):
    """The context manager behind `trace_nans`; `culprit` is None until an op is caught."""

    def __init__(self, model: torch.nn.Module | None = None, *, raise_on_culprit: bool = False) -> None:
        super().__init__()
        self.raise_on_culprit = raise_on_culprit
        self.culprit: Culprit | None = None
        self.ops = 0  # ops seen (forward and backward)
        # Allocations whose fresh memory held NaN/Inf (under poisoned_memory): not culprits, but
        # the usual source when a NaN propagates with no culprit (an aten-level partial write).
        self.uninitialised: list[ForwardOp] = []
        self._names = {} if model is None else {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self._modules: list[str] = []
        self._forward_of: dict[torch.autograd.graph.Node, ForwardOp] = {}
        self._pending: list[tuple[ForwardOp, list[torch.Tensor]]] = []
        self._hooks: list[Any] = []

    # -- module path -------------------------------------------------------------------
    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        self._modules.append(self._names.get(id(module), type(module).__name__))

    def _exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._modules:
            self._modules.pop()

    @property
    def module_path(self) -> str:
        if not self._modules:
            return ""
        # With a model, the innermost qualified name is the full path; without one, join class names.
        return self._modules[-1] if self._names else "/".join(self._modules)

    # -- forward op <-> autograd node ------------------------------------------------------
    def _resolve(self) -> None:
        """Maps autograd nodes to the forward ops whose outputs they belong to.

        The autograd layer attaches `grad_fn` after the op returns from this mode, so outputs
        are resolved lazily, at the next op.
        """
        for record, outputs in self._pending:
            for out in outputs:
                node = out.grad_fn
                if node is not None:
                    self._forward_of.setdefault(node, record)
        self._pending.clear()

    # -- the mode ----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.culprit is not None:
            return func(*args, **kwargs)
        self._resolve()
        node = torch._C._current_autograd_node()
        inputs, _ = tree_flatten((args, kwargs))
        in_nan, in_inf = _nonfinite(inputs)
        result = func(*args, **kwargs)
        outputs = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
        self.ops += 1
        op = str(func)
        module = self.module_path
        if node is None:
            self._pending.append((ForwardOp(op, module, _shapes(inputs)), outputs))
        else:
            forward = self._forward_of.get(node)
            module = forward.module if forward is not None else ""
        out_nan, out_inf = _nonfinite(outputs)
        if func.overloadpacket.__name__ in _ALLOCATIONS:
            if out_nan or out_inf:
                self.uninitialised.append(ForwardOp(op, module, _shapes(outputs)))
            return result
        if (out_nan and not in_nan) or (out_inf and not in_nan and not in_inf):
            self.culprit = Culprit(
                op=op,
                phase="forward" if node is None else "backward",
                module=module,
                index=self.ops - 1,
                input_shapes=_shapes(inputs),
                output_shapes=_shapes(outputs),
                nan=out_nan,
                inf=out_inf,
                node=None if node is None else node.name(),
                forward=None if node is None else self._forward_of.get(node),
                stack=_user_stack() if node is None else (),
            )
            if self.raise_on_culprit:
                raise FloatingPointError(str(self.culprit))
        return result

    def __enter__(self) -> NaNTrace:
        self._hooks = [
            nn_module.register_module_forward_pre_hook(self._enter_module),
            nn_module.register_module_forward_hook(self._exit_module, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for hook in self._hooks:
                hook.remove()
            # Drop references to autograd nodes and activations kept for the mapping.
            self._forward_of.clear()
            self._pending.clear()
            self._modules.clear()


def trace_nans(model: torch.nn.Module | None = None, *, raise_on_culprit: bool = False) -> NaNTrace:
    """A context manager that finds the first op producing NaN/Inf from inputs without it.

    Run forward *and* backward inside it. `model` gives module paths their qualified names
    ("blocks.0.attn"); without it, class names are used. With `raise_on_culprit=True` the
    culprit op raises `FloatingPointError` (its Python stack then points at the forward line);
    otherwise read `trace.culprit` after the block (None if nothing went non-finite).
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}.")
    return NaNTrace(model, raise_on_culprit=raise_on_culprit)
