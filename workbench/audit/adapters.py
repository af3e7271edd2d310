"""Adapters: any varlen attention behind the padding contract's signature.

The audit drives every implementation through one call shape, `kernels.varlen_attention`'s:

    impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
         cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, causal=False, scale=None)

plus `window_size=(left, right)` for a case with a window (`Case.window`), and only then: an
adapter that takes it says so by not lacking "window".

An adapter wraps a function of another shape into that one and says what the function cannot
express (no padded layout, no GQA, CUDA only...): checks that need it are "not applicable",
with the adapter's reason, instead of failing. Built in:

    ours         kernels.varlen_attention (declares its dtypes and head dims)
    contract     any callable with the contract's signature (e.g. workbench.reference_attention)
    torch-varlen torch.nn.attention.varlen.varlen_attn: 2.10 (is_causal) and 2.11+ (window_size)
    flash-attn   flash_attn.flash_attn_varlen_func
    te-thd       TransformerEngine-style THD: DotProductAttention(..., qkv_format="thd",
                 cu_seqlens_q/kv(_padded)=..., attn_mask_type="padding"|"padding_causal...")
    bshd         a callable taking padded (batch, seq, heads, dim) tensors and a bool mask

Registering your own takes a few lines: a function that wraps `fn` into the contract's shape,
and what it lacks (a dict, or a function of (fn, device) returning one):

    from workbench.audit import register_adapter

    @register_adapter("my-attn", lacks={"padded": "my_attn has no padded layout (GAP rows)"})
    def my_attn_adapter(fn):
        def call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, causal=False, scale=None):
            return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, is_causal=causal, sm_scale=scale)
        return call

    # then: workbench audit mypkg.attn:my_attn --adapter my-attn

Features an adapter can lack (`FEATURES`): padded, tail, gqa, causal, unequal, scale, metadata,
window, and `run` (the function cannot run here at all, e.g. CUDA-only code on a CPU). "window"
is opt-in: a contract-shaped callable without a `window_size` keyword lacks it automatically.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.layout import Fill, bshd_to_thd, pad_thd, thd_to_bshd

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
}
CONTRACT_PARAMS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")

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
    aliases: Mapping[str, str] = field(default_factory=dict)  # contract argument -> the function's name for it
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
    aliases: Mapping[str, str] | None = None,
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
        inputs = tuple(args[:3]) + tuple(kwargs.get(n) for n in ("q", "k", "v") if n in kwargs)
        return _checked_output(self.name, self.impl(*args, **kwargs), inputs)

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
        raise ValueError(f"target {target!r} must look like module:function, e.g. kernels:varlen_attention.")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"target {target!r}: cannot import module {module_name!r} ({exc}); is it installed and on PYTHONPATH?"
        ) from exc
    for attr in attrs.split("."):
        if not hasattr(obj, attr):
            raise ValueError(
                f"target {target!r}: {type(obj).__name__} {getattr(obj, '__name__', obj)!r} has no attribute {attr!r}."
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ValueError(f"target {target!r} is a {type(obj).__name__}, not a callable.")
    return obj


def _params(fn: Callable) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature
        return []


def detect(fn: Callable) -> Adapter:
    """The adapter whose `detect` recognises `fn` (by its parameter names); the first that does."""
    names = set(_params(fn))
    for adapter in ADAPTERS.values():
        if adapter.detect is not None and adapter.detect(fn, names):
            return adapter
    raise ValueError(
        f"no adapter recognises {getattr(fn, '__qualname__', fn)!r} (parameters: {_params(fn)}); pass adapter= "
        f"one of {sorted(ADAPTERS)} (`bshd` is never guessed), or register your own with register_adapter."
    )


def adapt(fn: Callable | str, adapter: str | Adapter | None = None, device: torch.device | str | None = None) -> Adapted:
    """`fn` (a callable or "module:function") behind the contract's signature on `device`."""
    from kernels import default_device

    target = fn if isinstance(fn, str) else _target_of(fn)
    if isinstance(fn, str):
        fn = load(fn)
    if not callable(fn):
        raise ValueError(
            f"no adapter recognises {fn!r}: it is a {type(fn).__name__}, and an attention to audit is a callable "
            "(or a 'module:function' string naming one)."
        )
    if adapter is None:
        chosen = detect(fn)
    elif isinstance(adapter, Adapter):
        chosen = adapter
    elif adapter in ADAPTERS:
        chosen = ADAPTERS[adapter]
    else:
        raise ValueError(f"adapter = {adapter!r} is not registered; known adapters: {', '.join(sorted(ADAPTERS))}.")
    device = torch.device(device) if device is not None else default_device()
    check_signature(fn, chosen)
    params = _params(fn)
    aliases = {**dict(zip(("q", "k", "v"), params[:3])), **chosen.aliases}
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    impl = chosen.wrap(fn)
    lacks = chosen.lacks_for(fn, device)
    if "window" not in lacks and not _takes_keyword(impl, "window_size"):
        # Windows are opt-in: an adapter (or a contract-shaped function) written without them is
        # never handed one, so the window check is n/a for it and the fuzzer draws none.
        lacks["window"] = f"{name} through adapter {chosen.name!r} takes no window_size keyword: no window can be passed"
    return Adapted(fn, chosen, device, impl, name, target, lacks, aliases)


def _takes_keyword(fn: Callable, keyword: str) -> bool:
    """`fn` names `keyword` among its parameters (a **kwargs pass-through does not count: it may
    hand the keyword to a function that has no such parameter)."""
    return keyword in _params(fn)


def check_signature(fn: Callable, adapter: Adapter) -> None:
    """Raises ValueError when `adapter` would call `fn` with arguments its signature cannot take.

    Checked before any check runs: otherwise every call would raise TypeError from the binding
    itself, and the bad-input campaign would count those as the function's errors."""
    if adapter.calls is None:
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check against
        return
    positional, keywords = adapter.calls
    try:
        signature.bind(*range(positional), **dict.fromkeys(keywords))
    except TypeError as exc:
        raise ValueError(
            f"adapter {adapter.name!r} calls {getattr(fn, '__qualname__', fn)!r} with {positional} positional arguments"
            f"{' and keywords ' + ', '.join(keywords) if keywords else ''}, which its signature {signature} cannot take "
            f"({exc}); pick the adapter that matches it (one of {sorted(ADAPTERS)}) or register your own."
        ) from exc


def _target_of(fn: Callable) -> str | None:
    """ "module:qualname" if importing it gives back `fn` (so a snippet can import it)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    try:
        return f"{module}:{qualname}" if load(f"{module}:{qualname}") is fn else None
    except ValueError:
        return None


# -- shared pieces ------------------------------------------------------------------------


def _refuse_padded(name: str, cu_q, cu_k, padded_q, padded_k) -> None:
    """Functions without a padded layout can still run the contract's unpadded calls."""
    for side, cu, padded in (("q", cu_q, padded_q), ("k", cu_k, padded_k)):
        if padded is not None and not (
            isinstance(cu, torch.Tensor) and isinstance(padded, torch.Tensor) and torch.equal(padded, cu)
        ):
            raise AdapterRefused(
                f"{name} has no padded layout: cu_seqlens_{side}_padded must be None or equal cu_seqlens_{side}."
            )


def _first(out):
    """Many varlen functions return (out, lse, ...) on request; the audit needs out."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _heads_differ(q, k) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k)) and q.shape[1] != k.shape[1]


def _cuda_only(what: str, device: torch.device) -> dict[str, str]:
    return {} if device.type == "cuda" else {"run": f"{what} runs on CUDA only; audit it with --device cuda on a GPU"}


# -- the built-in adapters ----------------------------------------------------------------


def _is_ours(fn: Callable, names: set[str]) -> bool:
    import kernels

    return fn is kernels.varlen_attention


def _contract_shaped(fn: Callable, names: set[str]) -> bool:
    return {"cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_q_padded", "causal"} <= names


def _no_window(what: str) -> dict[str, str]:
    return {"window": f"{what}: no window_size=(left, right) to pass a sliding window to"}


def _refuse_window(name: str, window_size) -> None:
    """For adapters whose function has no window: a windowed call cannot be expressed."""
    if tuple(window_size) != (-1, -1):
        raise AdapterRefused(f"{name} takes no window_size: window_size={tuple(window_size)} cannot be expressed.")


@register_adapter(
    "ours",
    detect=_is_ours,
    calls=(7, ("cu_seqlens_q_padded", "cu_seqlens_k_padded", "causal", "scale")),
    dtypes=("float32", "float16", "bfloat16"),
    head_dims=(16, 32, 64, 128, 256),
)
def _ours(fn: Callable) -> Callable:
    """kernels.varlen_attention: the contract itself, with its declared dtypes and head dims."""
    return fn


@register_adapter(
    "contract",
    detect=_contract_shaped,
    calls=(7, ("cu_seqlens_q_padded", "cu_seqlens_k_padded", "causal", "scale")),
)
def _contract(fn: Callable) -> Callable:
    """Any callable with the contract's signature (padded layout, causal, scale keywords; window_size if it has one)."""
    return fn


def _torch_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    params = set(_params(fn))
    lacks = {
        **_cuda_only("torch varlen_attn (FlashAttention-2 kernels)", device),
        "padded": "varlen_attn has no padded layout (no cu_seqlens_*_padded), so GAP rows cannot be expressed",
    }
    if "enable_gqa" not in params:
        lacks["gqa"] = "this varlen_attn has no enable_gqa (added in torch 2.12): q and k need the same number of heads"
    if "scale" not in params:
        lacks["scale"] = "this varlen_attn (torch 2.10) takes no scale"
    if "is_causal" not in params and "window_size" not in params:
        lacks["causal"] = "this varlen_attn takes neither is_causal nor window_size"
    if "window_size" not in params:
        lacks.update(_no_window("this varlen_attn (torch 2.10) has is_causal only"))
    return lacks


@register_adapter(
    "torch-varlen",
    lacks=_torch_lacks,
    calls=(7, ()),
    detect=lambda fn, names: {"cu_seq_q", "cu_seq_k", "max_q", "max_k"} <= names,
    aliases={"cu_seqlens_q": "cu_seq_q", "cu_seqlens_k": "cu_seq_k", "max_seqlen_q": "max_q", "max_seqlen_k": "max_k"},
    dtypes=("float16", "bfloat16"),
)
def _torch_varlen(fn: Callable) -> Callable:
    """torch.nn.attention.varlen.varlen_attn: 2.10's is_causal, 2.11+'s window_size ((-1, 0) for causal; with a
    window and causal, (left, 0): causal bounds the right side, as FlashAttention does)."""
    params = set(_params(fn))

    def call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        cu_seqlens_q_padded=None,
        cu_seqlens_k_padded=None,
        causal=False,
        scale=None,
        window_size=(-1, -1),
    ):
        _refuse_padded("varlen_attn", cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
        kwargs: dict[str, Any] = {}
        left, right = window_size
        if "is_causal" in params:  # torch 2.10
            _refuse_window("this varlen_attn (torch 2.10)", window_size)
            kwargs["is_causal"] = causal
        elif causal or (left, right) != (-1, -1):  # 2.11+: causal is a (-1, 0) window, bottom-right aligned like FA2
            kwargs["window_size"] = (left, 0 if causal else right)
        if scale is not None:
            kwargs["scale"] = scale
        if _heads_differ(q, k) and "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        return _first(fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs))

    return call


def _flash_attn_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    lacks = {"padded": "flash_attn_varlen_func has no padded layout (no cu_seqlens_*_padded), so GAP rows cannot be expressed"}
    if "window_size" not in _params(fn):
        lacks.update(_no_window("this flash_attn_varlen_func (before 2.3)"))
    return lacks


@register_adapter(
    "flash-attn",
    calls=(7, ("dropout_p", "softmax_scale", "causal")),
    lacks=_flash_attn_lacks,
    detect=lambda fn, names: {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "softmax_scale", "dropout_p"} <= names,
    aliases={"scale": "softmax_scale"},
    dtypes=("float16", "bfloat16"),
)
def _flash_attn(fn: Callable) -> Callable:
    """FlashAttention's flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...);
    a window goes as its own window_size (causal=True bounds the right side at 0 there too)."""

    def call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        cu_seqlens_q_padded=None,
        cu_seqlens_k_padded=None,
        causal=False,
        scale=None,
        window_size=(-1, -1),
    ):
        _refuse_padded("flash_attn_varlen_func", cu_seqlens_q, cu_seqlens_k, cu_seqlens_q_padded, cu_seqlens_k_padded)
        window = {"window_size": tuple(window_size)} if tuple(window_size) != (-1, -1) else {}
        return _first(
            fn(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                dropout_p=0.0,
                softmax_scale=scale,
                causal=causal,
                **window,
            )
        )

    return call


def _te_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    lacks = _no_window("the te-thd adapter does not map windows onto TransformerEngine's window_size and mask types")
    if "softmax_scale" in _params(fn):
        return lacks
    return {**lacks, "scale": "TransformerEngine's DotProductAttention takes softmax_scale in its constructor, not per call"}


@register_adapter(
    "te-thd",
    lacks=_te_lacks,
    calls=(
        3,
        (
            "qkv_format",
            "cu_seqlens_q",
            "cu_seqlens_kv",
            "cu_seqlens_q_padded",
            "cu_seqlens_kv_padded",
            "max_seqlen_q",
            "max_seqlen_kv",
            "attn_mask_type",
        ),
    ),
    detect=lambda fn, names: {"cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"} <= names,
    aliases={
        "cu_seqlens_k": "cu_seqlens_kv",
        "cu_seqlens_k_padded": "cu_seqlens_kv_padded",
        "max_seqlen_k": "max_seqlen_kv",
        "scale": "softmax_scale",
    },
)
def _te_thd(fn: Callable) -> Callable:
    """TransformerEngine-style THD call: qkv_format="thd", cu_seqlens_q/kv(_padded), attn_mask_type."""
    takes_scale = "softmax_scale" in _params(fn)

    def call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        cu_seqlens_q_padded=None,
        cu_seqlens_k_padded=None,
        causal=False,
        scale=None,
    ):
        kwargs: dict[str, Any] = {}
        if scale is not None:
            if not takes_scale:
                raise AdapterRefused("this TE-style function takes no softmax_scale per call.")
            kwargs["softmax_scale"] = scale
        out = fn(
            q,
            k,
            v,
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_k,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_k_padded,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_k,
            # TE's "padding_causal" is top-left aligned; the contract's causal is bottom-right.
            attn_mask_type="padding_causal_bottom_right" if causal else "padding",
            **kwargs,
        )
        out = _first(out)
        # TE returns THD output flattened to (tokens, heads * head_dim).
        return out.view(q.shape) if isinstance(out, torch.Tensor) and out.dim() == 2 else out

    return call


def bshd_mask(
    lengths_q: list[int],
    lengths_k: list[int],
    seq_q: int,
    seq_k: int,
    causal: bool,
    device,
    window: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """(B, S_q, S_k) bool, True where query i of sequence b may attend key j.

    Padded positions are masked on both sides, so a padded query row is fully masked, like a
    real row with no visible key: the function can tell both from the mask alone. Causal and
    the window (FlashAttention's (left, right), -1 unbounded; causal bounds the right at 0)
    are bottom-right aligned.
    """
    lq = torch.tensor(lengths_q, device=device)[:, None, None]
    lk = torch.tensor(lengths_k, device=device)[:, None, None]
    rows = torch.arange(seq_q, device=device)[None, :, None]
    cols = torch.arange(seq_k, device=device)[None, None, :]
    mask = (rows < lq) & (cols < lk)
    left, right = window[0], 0 if causal else window[1]
    if right >= 0:
        mask = mask & (cols <= rows + lk - lq + right)
    if left >= 0:
        mask = mask & (cols >= rows + lk - lq - left)
    return mask


def _bshd_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    why = "the function sees padded (batch, seq) tensors; the adapter gathers real rows back, so THD padding rows never reach it"
    return {
        "padded": why,
        "tail": why,
        "metadata": "the function never receives cu_seqlens/max_seqlen: the adapter turns them into a mask",
        **({} if "scale" in _params(fn) else {"scale": "the function takes no scale keyword"}),
    }


@register_adapter("bshd", lacks=_bshd_lacks, case_kwargs=lambda case: {"padding_fill": case.fill}, calls=(4, ()))
def _bshd(fn: Callable) -> Callable:
    """fn(q, k, v, mask) on padded (B, S, H, D) tensors; mask (B, S_q, S_k) bool, True = may attend
    (a window is part of the mask).

    The padded positions of the (B, S) tensors hold the case's fill (`padding_fill`), so a
    function that lets masked positions reach real outputs (0 * NaN) is caught.
    """
    takes_scale = "scale" in _params(fn)

    def call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        cu_seqlens_q_padded=None,
        cu_seqlens_k_padded=None,
        causal=False,
        scale=None,
        padding_fill: Fill | str = Fill.ZEROS,
        window_size=(-1, -1),
    ):
        generator = torch.Generator().manual_seed(0)

        def padded(x, cu, cu_padded, seq):
            x4, real = thd_to_bshd(x, cu, cu_padded, max(seq, 1))
            filler = Fill(padding_fill).values(x4.shape, x4.dtype, generator).to(x4.device)
            return torch.where(real[:, :, None, None], x4, filler), real

        q4, real_q = padded(q, cu_seqlens_q, cu_seqlens_q_padded, max_seqlen_q)
        k4, _ = padded(k, cu_seqlens_k, cu_seqlens_k_padded, max_seqlen_k)
        v4, _ = padded(v, cu_seqlens_k, cu_seqlens_k_padded, max_seqlen_k)
        mask = bshd_mask(
            cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist(), q4.shape[1], k4.shape[1], causal, q.device, window_size
        )
        kwargs = {}
        if scale is not None:
            if not takes_scale:
                raise AdapterRefused("this BSHD function takes no scale keyword.")
            kwargs["scale"] = scale
        out4 = _first(fn(q4, k4, v4, mask, **kwargs))
        flat, _, _ = bshd_to_thd(out4, real_q)
        layout = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
        return pad_thd(flat, cu_seqlens_q, layout, total_rows=q.shape[0])

    return call
