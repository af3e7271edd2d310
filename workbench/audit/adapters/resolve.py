"""Which adapter calls a function, and the function behind the contract's signature on a device.

`detect(fn)` is the first registered adapter that recognises `fn` (by its parameter names);
`adapt(fn, adapter, device)` wraps `fn` (a callable or "module:function") through the adapter
given or detected, after checking that the adapter's call fits `fn`'s signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.workbench.adapter_example import REGISTER_EXAMPLE
from varlen_workbench.workbench.audit.adapters.base import ADAPTERS, Adapted, Adapter, _target_of, load, params
from varlen_workbench.workbench.audit.adapters.varlen import infer
from varlen_workbench.workbench.audit.spelling import option


def detect(fn: Callable) -> Adapter:
    """The adapter whose `detect` recognises `fn` (by its parameter names); the first that does."""
    names = set(params(fn))
    for adapter in ADAPTERS.values():
        if adapter.detect is not None and adapter.detect(fn, names):
            return adapter
    try:
        infer(fn)
        why = ""
    except ValueError as exc:
        why = f"{exc} "
    raise ValueError(
        f"no adapter recognises {getattr(fn, '__qualname__', fn)!r} (parameters: {params(fn)}): {why}"
        f"Pass {option('adapter', metavar='NAME')}, NAME one of {sorted(ADAPTERS)} (`bshd` is never guessed), or register "
        f"your own:\n\n{REGISTER_EXAMPLE}"
    )


def adapt(fn: Callable | str, adapter: str | Adapter | None = None, device: torch.device | str | None = None) -> Adapted:
    """`fn` (a callable or "module:function") behind the contract's signature on `device` (None:
    `varlen_workbench.kernels._compat.default_device()`)."""
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
        raise ValueError(f"{option('adapter', adapter)} is not registered; known adapters: {', '.join(sorted(ADAPTERS))}.")
    device = torch.device(device) if device is not None else default_device()
    check_signature(fn, chosen)
    named = chosen.aliases(fn) if callable(chosen.aliases) else chosen.aliases
    aliases = {**dict(zip(("q", "k", "v"), params(fn)[:3])), **named}
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    impl = chosen.wrap(fn)
    lacks = chosen.lacks_for(fn, device)
    if "window" not in lacks and not _takes_keyword(impl, "window_size"):
        # Windows are opt-in: an adapter (or a contract-shaped function) written without them is
        # never handed one, so the window check is n/a for it and the fuzzer draws none.
        lacks["window"] = f"{name} through adapter {chosen.name!r} takes no window_size keyword: no window can be passed"
    if "lse" not in lacks and not _takes_keyword(impl, "return_lse"):  # likewise: asked for only where it is taken
        lacks["lse"] = f"{name} through adapter {chosen.name!r} gives out alone (no return_lse keyword): no lse to check"
    if "one-process" not in lacks:  # it computes in one process: the context-parallel check is not for it
        lacks["context-parallel"] = (
            f"{name} is a single-process attention; the context-parallel check audits a context-parallel one "
            "(the call of varlen_workbench.workbench.instruments.context_parallel:context_parallel_attention)"
        )
    return Adapted(fn, chosen, device, impl, name, target, lacks, aliases)


def _takes_keyword(fn: Callable, keyword: str) -> bool:
    """`fn` names `keyword` among its parameters (a **kwargs pass-through does not count: it may
    hand the keyword to a function that has no such parameter)."""
    return keyword in params(fn)


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
            f"({exc}); pick the adapter that matches it ({option('adapter', metavar='NAME')}, NAME one of {sorted(ADAPTERS)}) "
            "or register your own."
        ) from exc
