"""Varlen functions, called by their parameter names: the adapter is read off the signature.

`infer(fn)` matches each argument of the contract to the function's parameter of that role, by
name, never by position (FlashAttention-4 has `qv` fourth):

    cu_seqlens_q/k       cu_seqlens_q, cu_q, cu_seq_q (torch's varlen_attn)      required
                         or one cu_seqlens for both (self-attention, below)
    max_seqlen_q/k       max_seqlen_q, max_q; or one max_seqlen for both
    padded layout        cu_seqlens_q_padded, cu_q_padded; or seqused_q/k (below)
    scale                scale, softmax_scale (the first a function has: exactly one is passed)
    causal               causal, is_causal; without one, window_size=(left, 0) (torch >= 2.11)
    window               window_size: (-1, -1) unbounded, or (None, None) where that is its default (FA4)
    GQA                  enable_gqa=True when H_kv < H, if the function has it
    lse                  return_lse=True (return_attn_probs=True: FlashAttention 2/3) when the lse check asks

q, k, v go positionally (the first three parameters); everything else by keyword (a function
with **kwargs also gets the padded layout, causal and scale under the contract's names when it
names no parameter for them; a window only if it names window_size). Out is the
first element of a tuple return ((out, lse) and the like), the lse its second (the lse check). A
role the function has no parameter for is a feature it lacks, and the checks that need it are n/a
with that reason.

Self-attention code often takes one set of boundaries for queries and keys:
`self_attn(q, k, v, cu_seqlens, max_seqlen, causal=False, softmax_scale=None)`. Both sides' roles
then go to the one parameter, so such a function expresses layouts with len_q == len_k only: it
lacks "unequal" (the checks of len_q != len_k, such as causal alignment, are n/a), and a call
whose q and k boundaries differ is refused, never sent with one side's.

seqused_q/k (FlashAttention-3/4) say how many rows of each sequence are real: with cu_seqlens set
to the padded layout, sequence i's real rows are [cu_seqlens_padded[i], cu_seqlens_padded[i] +
seqused[i]), so the rows between are GAP rows. A function with seqused and no *_padded gets the
padded layout that way: cu_seqlens = cu_seqlens_*_padded, seqused = the real lengths; max_seqlen
stays the longest real length (it bounds seqused, which is what such kernels iterate over).

The library adapters below differ from the plain `contract` one only in what no signature says:
the device a library runs on, its dtypes, what its version lacks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.kernels.varlen.op import HEAD_DIMS, auto_backend
from varlen_workbench.workbench.adapter_example import REGISTER_EXAMPLE
from varlen_workbench.workbench.audit.adapters.base import (
    ADAPTERS,
    AdapterRefused,
    ContractCall,
    NoOutput,
    contract_shaped,
    cuda_only,
    first,
    heads_differ,
    register_adapter,
)
from varlen_workbench.workbench.audit.adapters.cudnn_ragged import cudnn_ragged_attention
from varlen_workbench.workbench.audit.adapters.fsa import fsa_dense_varlen, fsa_sparse_varlen
from varlen_workbench.workbench.audit.spelling import option
from varlen_workbench.workbench.audit_catalog import BACKEND_ADAPTER_PREFIX

ROLES: dict[str, tuple[str, ...]] = {
    "cu_seqlens_q": ("cu_seqlens_q", "cu_q", "cu_seq_q"),
    "cu_seqlens_k": ("cu_seqlens_k", "cu_k", "cu_seq_k"),
    "max_seqlen_q": ("max_seqlen_q", "max_q"),
    "max_seqlen_k": ("max_seqlen_k", "max_k"),
    "cu_seqlens_q_padded": ("cu_seqlens_q_padded", "cu_q_padded"),
    "cu_seqlens_k_padded": ("cu_seqlens_k_padded", "cu_k_padded"),
    "seqused_q": ("seqused_q",),
    "seqused_k": ("seqused_k",),
    "scale": ("scale", "softmax_scale"),  # scale first: a function that takes both gets it alone
    "causal": ("causal", "is_causal"),
    "window_size": ("window_size",),
    "enable_gqa": ("enable_gqa",),
    "return_lse": ("return_lse", "return_attn_probs"),
}
# One parameter for both sides' role (self-attention), where the function names neither side's.
SHARED: dict[str, tuple[str, str]] = {
    "cu_seqlens": ("cu_seqlens_q", "cu_seqlens_k"),
    "max_seqlen": ("max_seqlen_q", "max_seqlen_k"),
}
REQUIRED = ("cu_seqlens_q", "cu_seqlens_k")
# A function with **kwargs gets these under the contract's own names when it names no parameter
# for them (a wrapper forwarding them, e.g. to varlen_workbench.workbench.reference.reference_attention). Windows stay
# opt-in: a **kwargs pass-through may hand window_size to a function that has none.
_FORWARDED = ("cu_seqlens_q_padded", "cu_seqlens_k_padded", "causal", "scale")
_POSITIONAL = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
# The contract's arguments whose malformed values the campaign names (its aliases).
_CONTRACT_ARGUMENTS = (
    "cu_seqlens_q",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
    "cu_seqlens_q_padded",
    "cu_seqlens_k_padded",
    "scale",
)


@dataclass(frozen=True)
class VarlenSignature:
    """How one function names the contract's arguments (`names`: role -> its parameter)."""

    function: str  # its qualified name, for messages
    names: Mapping[str, str]
    window_unbounded: int | None = -1  # how its window_size says "unbounded": -1, or None (FA4)
    # fn(q, k, v, *args, **kwargs): it names nothing, so it gets the contract's own call (cu_seqlens
    # and max_seqlen positionally, in the contract's order)
    variadic: bool = False

    @property
    def shared(self) -> str | None:
        """The one boundaries parameter of a self-attention signature (None: one per side)."""
        name = self.names["cu_seqlens_q"]
        return name if name == self.names["cu_seqlens_k"] else None

    def layout(self, side: str) -> str | None:
        """How side "q" or "k" takes a padded layout: "padded", "seqused", or None."""
        if f"cu_seqlens_{side}_padded" in self.names:
            return "padded"
        return "seqused" if f"seqused_{side}" in self.names else None

    def lacks(self) -> dict[str, str]:
        names, lacks = self.names, {}
        if self.shared:
            lacks["unequal"] = (
                f"{self.function} takes one {self.shared} for q and k (self-attention): only layouts with len_q == len_k "
                "can be expressed"
            )
        if None in (self.layout("q"), self.layout("k")):
            lacks["padded"] = (
                f"{self.function} has no padded layout (cu_seqlens_*_padded, or seqused_q and seqused_k), so GAP rows cannot be expressed"
            )
        if "scale" not in names:
            lacks["scale"] = f"{self.function} takes no softmax_scale or scale"
        if "causal" not in names and "window_size" not in names:
            lacks["causal"] = f"{self.function} takes neither causal/is_causal nor window_size"
        if "window_size" not in names:
            lacks["window"] = f"{self.function} takes no window_size: no window can be passed"
        return lacks

    def aliases(self) -> dict[str, str]:
        return {role: self.names[role] for role in _CONTRACT_ARGUMENTS if role in self.names}

    def _window(self, window: tuple) -> tuple:
        if self.window_unbounded is None:
            return tuple(None if w == -1 else w for w in window)
        return window

    def arguments(
        self, q, k, cu_q, cu_k, max_q, max_k, padded_q, padded_k, causal, scale, window, return_lse=False
    ) -> tuple[tuple, dict[str, Any]]:
        """The call's arguments after q, k, v: (positional, keywords)."""
        names, out = self.names, {}

        def put(role: str, value: Any) -> None:
            """One role's value; a parameter both sides share takes it only where their values agree."""
            name = names[role]
            if name not in out:
                out[name] = value
            elif not _same_value(out[name], value):
                raise AdapterRefused(
                    f"{self.function} takes one {name} for q and k (self-attention): a call whose q and k {name} differ "
                    "(len_q != len_k) cannot be expressed."
                )

        for side, cu, padded, longest in (("q", cu_q, padded_q, max_q), ("k", cu_k, padded_k, max_k)):
            put(f"cu_seqlens_{side}", cu)
            if f"max_seqlen_{side}" in names:
                put(f"max_seqlen_{side}", longest)
            how = self.layout(side)
            if how == "padded":
                out[names[f"cu_seqlens_{side}_padded"]] = padded
            elif padded is not None and not (
                isinstance(cu, torch.Tensor) and isinstance(padded, torch.Tensor) and torch.equal(cu, padded)
            ):
                if how is None:
                    raise AdapterRefused(
                        f"{self.function} has no padded layout: cu_seqlens_{side}_padded must be None or equal cu_seqlens_{side}."
                    )
                if not (isinstance(cu, torch.Tensor) and isinstance(padded, torch.Tensor) and cu.dim() == 1):
                    raise AdapterRefused(
                        f"a padded layout goes to {self.function} as seqused_{side}, from 1-D cu_seqlens tensors only."
                    )
                out[names[f"cu_seqlens_{side}"]] = padded
                out[names[f"seqused_{side}"]] = cu.diff().to(torch.int32)
        # A malformed window (the bad-input campaign's) goes to the function as it is.
        pair = isinstance(window, (tuple, list)) and len(window) == 2
        if "causal" in names:
            out[names["causal"]] = causal
        elif causal:  # no causal flag: causality is the window's right bound 0 (torch's varlen_attn >= 2.11)
            if "window_size" not in names:
                raise AdapterRefused(f"{self.function} takes neither causal nor window_size: causal cannot be expressed.")
            window = (window[0], 0) if pair else window
        if "window_size" in names:
            out[names["window_size"]] = self._window(tuple(window)) if pair else window
        elif not (pair and tuple(window) == (-1, -1)):
            raise AdapterRefused(f"{self.function} takes no window_size: window_size={window} cannot be expressed.")
        if "scale" in names:
            out[names["scale"]] = scale
        elif scale is not None:
            raise AdapterRefused(f"{self.function} takes no softmax_scale or scale: scale={scale} cannot be expressed.")
        if "enable_gqa" in names and heads_differ(q, k):
            out[names["enable_gqa"]] = True
        if return_lse and "return_lse" in names:
            out[names["return_lse"]] = True
        if self.variadic:
            return tuple(out.pop(names[role]) for role in _POSITIONAL), out
        return (), out

    def with_lse(self, result: Any) -> tuple[Any, torch.Tensor]:
        """(out, lse) from what a call that asked for the lse returned: the second element of its tuple."""
        if isinstance(result, (tuple, list)) and len(result) >= 2 and isinstance(result[1], torch.Tensor):
            return result[0], result[1]
        got = f"{type(result).__name__}{f' of {len(result)}' if isinstance(result, (tuple, list)) else ''}"
        if "return_lse" in self.names:
            raise NoOutput(f"{self.function} returned {got} with {self.names['return_lse']}=True, not (out, lse)")
        raise AdapterRefused(
            f"{self.function} returns {got}, not (out, lse), and has no return_lse parameter: it gives no lse to check"
        )

    def source(self, fn: str) -> list[str]:
        """The same call in a plain-torch snippet (its variables: cu_q, cu_k, cu_q_pad, cu_k_pad, max_q,
        max_k, causal, scale, window, H, H_kv)."""
        names, lines, args = self.names, [], ["q", "k", "v"]

        def keyword(name: str, expression: str) -> None:
            """`name=expression` once: a parameter both sides share (self-attention) takes q's, equal to k's."""
            if not any(a.startswith(f"{name}=") for a in args):
                args.append(f"{name}={expression}")

        for side in ("q", "k"):
            cu, pad = f"cu_{side}", f"cu_{side}_pad"
            if self.layout(side) == "seqused":
                lines.append(
                    f"layout_{side}, used_{side} = ({cu}, None) if {pad} is None else ({pad}, {cu}.diff().int())"
                    f"  # real rows of sequence i: [{pad}[i], {pad}[i] + used_{side}[i])"
                )
                keyword(names[f"cu_seqlens_{side}"], f"layout_{side}")
                keyword(names[f"seqused_{side}"], f"used_{side}")
            else:
                keyword(names[f"cu_seqlens_{side}"], cu)
                if self.layout(side) == "padded":
                    keyword(names[f"cu_seqlens_{side}_padded"], pad)
            if f"max_seqlen_{side}" in names:
                keyword(names[f"max_seqlen_{side}"], f"max_{side}")
        if "causal" in names:
            args.append(f"{names['causal']}=causal")
            window = "window"
        else:
            window = "(window[0], 0 if causal else window[1])  # causal: right bound 0"
        if "window_size" in names:
            if self.window_unbounded is None:
                lines.append(f"window_arg = tuple(None if w == -1 else w for w in {window})  # None: unbounded")
            else:
                lines.append(f"window_arg = {window}")
            args.append(f"{names['window_size']}=window_arg")
        if "scale" in names:
            args.append(f"{names['scale']}=scale")
        if "enable_gqa" in names:
            args.append(f"**({{'{names['enable_gqa']}': True}} if H != H_kv else {{}})")
        if self.variadic:  # the contract's own order, positionally
            skip = {names[role] for role in _POSITIONAL}
            args = ["q", "k", "v", "cu_q", "cu_k", "max_q", "max_k"] + [a for a in args[3:] if a.split("=")[0] not in skip]
        return [*lines, f"out = {fn}({', '.join(args)})", "out = out[0] if isinstance(out, (tuple, list)) else out"]


def infer(fn: Callable) -> VarlenSignature:
    """`fn`'s parameters matched to the contract's arguments by name; ValueError saying what is missing."""
    function = getattr(fn, "__qualname__", None) or type(fn).__name__
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{function} has no Python signature to read parameter names from ({exc}).") from exc
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind is p.VAR_POSITIONAL for p in parameters.values())
    if len(positional) < 3 and not variadic:
        raise ValueError(f"{function} takes fewer than three positional parameters (q, k, v).")
    names = {
        role: next(n for n in candidates if n in parameters)
        for role, candidates in ROLES.items()
        if any(n in parameters for n in candidates)
    }
    for shared, roles in SHARED.items():  # self_attn(q, k, v, cu_seqlens, max_seqlen): one parameter, both sides
        if shared in parameters and not any(role in names for role in roles):
            names.update(dict.fromkeys(roles, shared))
    # fn(q, k, v, *args): what it does not name goes positionally, so all four go in the contract's order
    variadic = variadic and any(role not in names for role in _POSITIONAL)
    if variadic:
        names.update({role: role for role in _POSITIONAL if role not in names})
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        names.update({role: role for role in _FORWARDED if role not in names})
    missing = [role for role in REQUIRED if role not in names]
    if missing:
        wanted = "; ".join(f"{role}: one of {', '.join(ROLES[role])}" for role in missing)
        raise ValueError(f"inference by parameter name found no parameter for {wanted}.")
    keywords = [names[role] for role in names if not (variadic and role in _POSITIONAL)]
    try:  # the widest call inference can make must bind: a misfit is a usage error now, not a TypeError per check
        inspect.signature(fn).bind(*range(7 if variadic else 3), **dict.fromkeys(keywords))
    except TypeError as exc:
        shape = f"q, k, v{', cu_q, cu_k, max_q, max_k' if variadic else ''}, {'=..., '.join(keywords)}=..."
        raise ValueError(f"inference would call {function}({shape}), which its signature cannot take ({exc}).") from exc
    window_default = parameters["window_size"].default if "window_size" in names else None
    unbounded = None if isinstance(window_default, tuple) and window_default and window_default[0] is None else -1
    return VarlenSignature(function, names, unbounded, variadic)


def _signature(fn: Callable, adapter: str) -> VarlenSignature:
    """infer(fn), its failure a usage error that says what to do."""
    try:
        return infer(fn)
    except ValueError as exc:
        raise ValueError(
            f"adapter {adapter!r} cannot call {getattr(fn, '__qualname__', fn)!r}: {exc} Pick the adapter that matches it "
            f"({option('adapter', metavar='NAME')}, NAME one of {sorted(ADAPTERS)}) or register your own:\n\n{REGISTER_EXAMPLE}"
        ) from exc


def _wrap(fn: Callable, adapter: str) -> Callable:
    signature = _signature(fn, adapter)

    def body(c: ContractCall):
        args, keywords = signature.arguments(
            c.q,
            c.k,
            c.cu_seqlens_q,
            c.cu_seqlens_k,
            c.max_seqlen_q,
            c.max_seqlen_k,
            c.cu_seqlens_q_padded,
            c.cu_seqlens_k_padded,
            c.causal,
            c.scale,
            c.window_size,
            c.return_lse,
        )
        result = fn(c.q, c.k, c.v, *args, **keywords)
        return signature.with_lse(result) if c.return_lse else first(result)

    call = contract_shaped(body, takes=("window_size", "return_lse"))
    call.signature = signature  # type: ignore[attr-defined]  # the snippet spells the same call
    return call


def _same_value(a: Any, b: Any) -> bool:
    """Whether two values of one argument are the same (tensors: equal shape, dtype and values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
            and torch.equal(a, b)
        )
    return type(a) is type(b) and a == b


def _inferable(fn: Callable) -> bool:
    try:
        infer(fn)
    except ValueError:
        return False
    return True


def _module(fn: Callable) -> str:
    return getattr(fn, "__module__", None) or ""


def register_varlen(
    name: str,
    *,
    detect: Callable[[Callable], bool],
    lacks: Callable[[Callable, torch.device], Mapping[str, str]] | None = None,
    dtypes: tuple[str, ...] | None = None,
    head_dims: tuple[int, ...] | None = None,
    doc: str,
) -> None:
    """A varlen adapter: the call inferred from `fn`'s signature, plus what the library's signature does not say."""

    def lacks_for(fn: Callable, device: torch.device) -> dict[str, str]:
        return {**_signature(fn, name).lacks(), **(lacks(fn, device) if lacks else {})}

    def wrap(fn: Callable) -> Callable:
        return _wrap(fn, name)

    wrap.__doc__ = doc
    register_adapter(
        name,
        lacks=lacks_for,
        detect=lambda fn, names: detect(fn) and _inferable(fn),
        aliases=lambda fn: _signature(fn, name).aliases(),
        dtypes=dtypes,
        head_dims=head_dims,
    )(wrap)


def _is_ours(fn: Callable) -> bool:
    return fn is varlen_attention


register_varlen(
    "ours",
    detect=_is_ours,
    dtypes=("float32", "float16", "bfloat16"),
    head_dims=tuple(HEAD_DIMS),
    doc="varlen_workbench.kernels.varlen.varlen_attention: the contract itself, with its declared dtypes and head dims "
    '(backend="auto": on the CPU the torch backend unless the Triton interpreter is asked for).',
)


def register_backend_adapters() -> list[str]:
    """`ours-<backend>` for every registered backend that has none yet: `varlen_attention_<backend>`
    (varlen_attention pinned to it), in the dtypes it declares; where it runs nothing on the
    device, the adapter lacks "run" with its reason. Returns the adapters' names."""
    from varlen_workbench.kernels.varlen.backends import registered
    from varlen_workbench.kernels.varlen.op import DTYPES, pinned

    made = []
    for backend in registered():
        name = BACKEND_ADAPTER_PREFIX + backend.name
        made.append(name)
        if name in ADAPTERS:
            continue

        def lacks(fn: Callable, device: torch.device, backend=backend) -> dict[str, str]:
            reason = backend.unavailable(device)
            return {"run": reason} if reason else {}

        def detect(fn: Callable, backend=backend) -> bool:
            return fn is pinned(backend.name)

        register_varlen(
            name,
            detect=detect,
            lacks=lacks,
            dtypes=tuple(str(d).removeprefix("torch.") for d in backend.dtypes or DTYPES),
            head_dims=tuple(HEAD_DIMS),
            doc=f"varlen_workbench.kernels.varlen.varlen_attention_{backend.name}: varlen_attention(backend="
            f'"{backend.name}"), {backend.summary}; it runs {backend.takes}.',
        )
    return made


register_backend_adapters()


def audited_backend(adapter: str, device: torch.device, dtype: str, head_dim: int) -> str:
    """Which of our backends an audit through `adapter` runs: the pinned one ("triton" for
    `ours-triton`), "auto: <pick>" for `ours` (what backend="auto" picks on `device` in this
    process: on the CPU "torch" unless the Triton interpreter is asked for), "" for other code."""
    if adapter.startswith(BACKEND_ADAPTER_PREFIX):
        return adapter.removeprefix(BACKEND_ADAPTER_PREFIX)
    if adapter != "ours":
        return ""
    try:
        return f"auto: {auto_backend(device, getattr(torch, dtype), head_dim)}"
    except ValueError as exc:  # no backend takes the call here: the audit's checks will say so
        return f"auto: none ({str(exc).splitlines()[0]})"


def _torch_lacks(fn: Callable, device: torch.device) -> dict[str, str]:
    names = infer(fn).names
    lacks = {**cuda_only("torch varlen_attn (FlashAttention-2 kernels)", device)}
    if "enable_gqa" not in names:
        lacks["gqa"] = "this varlen_attn has no enable_gqa (added in torch 2.12): q and k need the same number of heads"
    if "scale" not in names:
        lacks["scale"] = "this varlen_attn (torch 2.10) takes no scale"
    if "window_size" not in names:
        lacks["window"] = "this varlen_attn (torch 2.10) has is_causal only: no window_size=(left, right)"
    return lacks


register_varlen(
    "torch-varlen",
    detect=lambda fn: _module(fn) == "torch.nn.attention.varlen",
    lacks=_torch_lacks,
    dtypes=("float16", "bfloat16"),
    doc="torch.nn.attention.varlen.varlen_attn, called by name: 2.10's is_causal; 2.11+'s window_size ((-1, 0) for "
    "causal; with a window and causal, (left, 0): causal bounds the right side, as FlashAttention does); "
    "enable_gqa where it has it (2.12+); no padded layout.",
)


def _cuda_library(what: str) -> Callable[[Callable, torch.device], dict[str, str]]:
    return lambda fn, device: cuda_only(what, device)


register_varlen(
    "flash-attn",
    detect=lambda fn: _module(fn).startswith("flash_attn") and not _module(fn).startswith("flash_attn.cute"),
    lacks=_cuda_library("FlashAttention 2/3"),
    dtypes=("float16", "bfloat16"),
    doc="FlashAttention 2/3's flash_attn_varlen_func, called by name (dropout_p left at its default 0); "
    "a window goes as its window_size (causal=True bounds the right side at 0 there).",
)
register_varlen(
    "fa4",
    detect=lambda fn: _module(fn).startswith("flash_attn.cute"),
    lacks=_cuda_library("FlashAttention-4 (CuTe DSL, Hopper and Blackwell)"),
    dtypes=("float16", "bfloat16"),
    doc="FlashAttention-4's flash_attn.cute.flash_attn_varlen_func, called by name (its fourth positional "
    "parameter is qv, so nothing after v goes by position); the padded layout as cu_seqlens = cu_seqlens_padded "
    "with seqused = the real lengths (sequence i's real rows [cu_seqlens_padded[i], +seqused[i])); windows with "
    "None for unbounded; out from its (out, lse) return.",
)


def _is_fsa(fn: Callable) -> bool:
    return fn in (fsa_dense_varlen, fsa_sparse_varlen) or _module(fn).startswith("flash_sparse_attn")


register_varlen(
    "fsa-varlen",
    detect=_is_fsa,
    lacks=_cuda_library("flash-sparse-attn's Triton kernels"),
    dtypes=("float16", "bfloat16"),
    doc="flash-sparse-attn's *_varlen_func(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
    "max_seqlen_k, is_causal, softmax_scale), called by name: THD tensors passed as they are (TAIL rows "
    "included); causal is is_causal=True; GQA by passing fewer key/value heads (it takes H_kv from k).",
)


def _is_cudnn_ragged(fn: Callable) -> bool:
    return fn is cudnn_ragged_attention


register_varlen(
    "cudnn-ragged",
    detect=_is_cudnn_ragged,
    lacks=_cuda_library("cuDNN's fused attention (nvidia-cudnn-frontend)"),
    dtypes=("float16", "bfloat16"),
    doc="varlen_workbench.workbench.audit.adapters.cudnn_ragged.cudnn_ragged_attention: cuDNN's SDPA graph with ragged offsets "
    "from cu_seqlens_*_padded and seq_len_q/kv from cu_seqlens (TransformerEngine's THD path), called by name.",
)
# Last: any other function whose parameters name the contract's arguments (a user's own included).
register_varlen(
    "contract",
    detect=lambda fn: True,
    doc="Any varlen function, each argument of the contract passed to the parameter of its name "
    "(varlen_workbench.workbench.audit.adapters.varlen.infer); what it has no parameter for is a feature it lacks.",
)
