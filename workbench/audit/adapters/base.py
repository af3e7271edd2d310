"""The adapter registry: `register_adapter`, `Adapted` (a function behind the contract's signature on a
device: what `varlen_workbench.workbench.audit.adapters.resolve.adapt` makes), `load` ("module:function").

The features an adapter can lack are `FEATURES`; a check that needs one the function lacks is
"not applicable", with the adapter's reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from varlen_workbench.workbench.audit.spelling import option
from varlen_workbench.workbench.layout import Fill
from varlen_workbench.workbench.usercode import UserModuleError, import_user_module, not_found

FEATURES = {
    "run": "the function runs on this device",
    "backward": "a backward pass on this device (without one the checks compare the forward's out only)",
    "padded": "a padded layout (cu_seqlens_*_padded): GAP rows between sequences",
    "tail": "TAIL rows after the last sequence (more rows than cu_seqlens[-1])",
    "gqa": "fewer key/value heads than query heads (GQA/MQA)",
    "causal": "causal masking",
    "unequal": "query and key sequences of different lengths",
    "scale": "a custom softmax scale",
    "metadata": "the function receives cu_seqlens/max_seqlen itself (the bad-input campaign feeds it malformed ones)",
    "window": "a sliding or local window: window_size=(left, right), FlashAttention's semantics, bottom-right aligned",
    "lse": "the function returns each row's log-sum-exp beside out ((out, lse), or on return_lse=True)",
    "one-process": "the function computes in one process (a context-parallel attention needs the ranks of a process group)",
    "context-parallel": "a context-parallel attention (context_parallel_attention's call on each rank of a process group)",
}

Lacks = Mapping[str, str]  # feature -> why the function cannot express it


class AdapterRefused(ValueError):
    """The adapter cannot express this call for the wrapped function (not the function's fault)."""


class NoOutput(RuntimeError):
    """The function returned something that is not an output tensor (None, a dict...).

    The checks report it as "no output", never as a wrong result, and the harness does not
    go on to call tensor methods on it."""


class _Attached(torch.autograd.Function):
    """Identity on `out` that joins the autograd graph of q, k, v with zero gradients.

    A correct implementation may return an output that does not depend on its inputs at all
    (a layout with no real query row: every output row is padding, so zeros). Backward through
    it must then give dq = dk = dv = 0, not "element 0 of tensors does not require grad"."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return tuple(None for _ in ctx.needs_input_grad)


def _checked_output(name: str, out: Any, inputs: tuple) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise NoOutput(f"{name} returned {type(out).__name__}, not an output tensor")
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if torch.is_grad_enabled() and leaves and not out.requires_grad:
        return _Attached.apply(out, *leaves)
    return out


@dataclass(frozen=True)
class Adapter:
    """How to call one family of functions through the contract's signature."""

    name: str
    wrap: Callable[[Callable], Callable]
    lacks: Lacks | Callable[[Callable, torch.device], Lacks] = field(default_factory=dict)
    detect: Callable[[Callable, set[str]], bool] | None = None  # (fn, its parameter names) -> is it ours?
    # contract argument -> the function's name for it (or a function of fn giving that mapping)
    aliases: Mapping[str, str] | Callable[[Callable], Mapping[str, str]] = field(default_factory=dict)
    dtypes: tuple[str, ...] | None = None  # declared supported dtypes (None: not declared)
    head_dims: tuple[int, ...] | None = None
    case_kwargs: Callable[[Any], dict[str, Any]] | None = None  # Case -> extra keywords of the wrapped call
    doc: str = ""
    # How the wrapper calls fn: (positional arguments, keywords always passed). adapt() binds it
    # against fn's signature first, so a wrong adapter is a usage error, never a "clear error".
    calls: tuple[int, tuple[str, ...]] | None = None

    def lacks_for(self, fn: Callable, device: torch.device) -> dict[str, str]:
        lacks = self.lacks(fn, device) if callable(self.lacks) else self.lacks
        unknown = set(lacks) - set(FEATURES)
        if unknown:
            raise ValueError(f"adapter {self.name!r} lacks unknown features {sorted(unknown)}; use some of {sorted(FEATURES)}.")
        return dict(lacks)


ADAPTERS: dict[str, Adapter] = {}


def register_adapter(
    name: str,
    *,
    lacks: Lacks | Callable[[Callable, torch.device], Lacks] | None = None,
    detect: Callable[[Callable, set[str]], bool] | None = None,
    aliases: Mapping[str, str] | Callable[[Callable], Mapping[str, str]] | None = None,
    dtypes: tuple[str, ...] | None = None,
    head_dims: tuple[int, ...] | None = None,
    case_kwargs: Callable[[Any], dict[str, Any]] | None = None,
    calls: tuple[int, tuple[str, ...]] | None = None,
) -> Callable[[Callable[[Callable], Callable]], Callable[[Callable], Callable]]:
    """Decorator registering `wrap(fn) -> contract-shaped callable` as adapter `name`."""

    def register(wrap: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
        if name in ADAPTERS:
            raise ValueError(f"adapter {name!r} is already registered; pick another name.")
        ADAPTERS[name] = Adapter(
            name,
            wrap,
            lacks or {},
            detect,
            aliases or {},
            dtypes,
            head_dims,
            case_kwargs,
            doc=(inspect.getdoc(wrap) or "").partition("\n")[0],
            calls=calls,
        )
        return wrap

    return register


@dataclass(frozen=True)
class Adapted:
    """A function wrapped by an adapter, bound to a device: what the checks call."""

    fn: Callable
    adapter: Adapter
    device: torch.device
    impl: Callable  # the contract-shaped callable
    name: str
    target: str | None  # "module:function" when known: reproduction snippets import it from there
    lacks: dict[str, str]
    aliases: dict[str, str]

    def __call__(self, *args, **kwargs):
        """out; (out, lse) when called with return_lse=True (only where the adapter takes it: "lse" not lacking)."""
        inputs = tuple(args[:3]) + tuple(kwargs.get(n) for n in ("q", "k", "v") if n in kwargs)
        result = self.impl(*args, **kwargs)
        if kwargs.get("return_lse"):
            out, lse = result
            return _checked_output(self.name, out, inputs), lse
        return _checked_output(self.name, result, inputs)

    @property
    def __name__(self) -> str:  # probe() names its records after impl.__name__
        return self.name

    def case_kwargs(self, case) -> dict[str, Any]:
        return self.adapter.case_kwargs(case) if self.adapter.case_kwargs else {}

    @property
    def backward(self) -> bool:
        """Whether the checks run the backward pass (the function has one on this device)."""
        return "backward" not in self.lacks

    def why_not(self, *features: str) -> str | None:
        """The reason the first lacking feature cannot be expressed, or None if all can."""
        for feature in ("run", *features):
            if feature in self.lacks:
                return self.lacks[feature]
        return None


def load(target: str) -> Callable:
    """Imports "module:attr[.attr...]" (e.g. "torch.nn.attention.varlen:varlen_attn")."""
    module_name, colon, attrs = target.partition(":")
    if not colon or not module_name or not attrs:
        raise ValueError(
            f"target {target!r} must look like module:function, e.g. varlen_workbench.kernels.varlen:varlen_attention."
        )
    try:
        obj: Any = import_user_module(module_name)
    except UserModuleError as exc:  # not found, or its own code raised: the message says which, and where
        cannot = "cannot import module" if not_found(module_name, exc.__cause__) else "cannot load"
        raise ValueError(f"target {target!r}: {cannot} {module_name!r}: {exc}") from exc
    for attr in attrs.split("."):
        if not hasattr(obj, attr):
            raise ValueError(
                f"target {target!r}: {type(obj).__name__} {getattr(obj, '__name__', obj)!r} has no attribute {attr!r}."
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ValueError(f"target {target!r} is a {type(obj).__name__}, not a callable.")
    return obj


def params(fn: Callable) -> list[str]:
    """`fn`'s parameter names ([] for a builtin without a signature)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature
        return []


def _target_of(fn: Callable) -> str | None:
    """ "module:qualname" if importing it gives back `fn` (so a snippet can import it)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    try:
        return f"{module}:{qualname}" if load(f"{module}:{qualname}") is fn else None
    except ValueError:
        return None


# -- the contract's call -------------------------------------------------------------------


@dataclass(frozen=True)
class ContractCall:
    """One call in the contract's shape (`varlen_workbench.kernels.varlen.varlen_attention`'s), its arguments by name: what
    the body of a `contract_shaped` wrapper receives. The first seven are positional."""

    q: Any
    k: Any
    v: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    max_seqlen_q: Any
    max_seqlen_k: Any
    cu_seqlens_q_padded: Any = None
    cu_seqlens_k_padded: Any = None
    causal: Any = False
    scale: Any = None
    window_size: Any = (-1, -1)
    padding_fill: Fill | str = Fill.ZEROS  # the case's fill for the padded batch an adapter builds (`fill_kwargs`)
    return_lse: bool = False  # return (out, lse): the lse check asks, of a wrapper that names it


_POSITIONAL = 7
# Keywords a wrapper takes only when it says so: one that does not name window_size is never
# handed a window (`adapt`), one that does not name padding_fill builds no padded batch, one that
# does not name return_lse is never asked for the lse.
OPTIONAL_KEYWORDS = ("window_size", "padding_fill", "return_lse")


def contract_signature(takes: tuple[str, ...] = ()) -> inspect.Signature:
    """The contract's signature: (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
    cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, causal=False, scale=None), plus the
    `OPTIONAL_KEYWORDS` named in `takes`."""
    unknown = set(takes) - set(OPTIONAL_KEYWORDS)
    if unknown:
        raise ValueError(
            f"takes = {sorted(unknown)}: a contract-shaped call takes only {list(OPTIONAL_KEYWORDS)} besides the contract's."
        )
    fields = [f for f in dataclasses.fields(ContractCall) if f.name not in OPTIONAL_KEYWORDS or f.name in takes]
    return inspect.Signature(
        [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for f in fields[:_POSITIONAL]]
        + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default) for f in fields[_POSITIONAL:]]
    )


def contract_shaped(body: Callable[[ContractCall], Any], takes: tuple[str, ...] = ()) -> Callable:
    """`body(ContractCall)` behind the contract's signature (`contract_signature(takes)`): arguments
    are bound as a function of that signature binds them, a wrong call a TypeError."""
    signature = contract_signature(takes)

    def call(*args, **kwargs):
        return body(ContractCall(**signature.bind(*args, **kwargs).arguments))

    call.__signature__ = signature  # type: ignore[attr-defined]  # what adapt() and inspect read
    return call


# -- shared pieces ------------------------------------------------------------------------


def first(out):
    """Many varlen functions return (out, lse, ...) on request; the audit needs out."""
    return out[0] if isinstance(out, (tuple, list)) else out


def heads_differ(q, k) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k)) and q.shape[1] != k.shape[1]


def cuda_only(what: str, device: torch.device) -> dict[str, str]:
    return (
        {} if device.type == "cuda" else {"run": f"{what} runs on CUDA only; audit it with {option('device', 'cuda')} on a GPU"}
    )
