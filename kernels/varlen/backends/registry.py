"""The registry of backends: the kernels that can compute a `varlen_attention` call.

A backend says what it cannot take (a reason, or None), how strongly "auto" prefers it for a call
(`preference`: the highest among those that take the call wins; ties go to the earlier
registered), and runs the call, forward and backward (its outputs carry autograd).
`backend="<name>"` runs the named one or raises its reason; `backend="auto"` asks each
registered backend in order. Adding a backend is one module with one `register(...)`
(kernels/varlen/backends/__init__.py imports the shipped ones).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from varlen_workbench.kernels.varlen.metadata import VarlenMetadata

AUTO = "auto"


class Call(NamedTuple):
    """One checked call, as every backend receives it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    metadata: VarlenMetadata
    causal: bool
    scale: float
    window_left: int
    window_right: int
    return_lse: bool
    eager: bool  # nothing traces the call (no torch.compile, no dispatch mode)

    @property
    def mask(self) -> tuple[bool, float, int, int]:
        """(causal, scale, window_left, window_right): the launchers' trailing arguments."""
        return (self.causal, self.scale, self.window_left, self.window_right)


class Backend(Protocol):
    name: str  # what backend= takes
    label: str  # a few words: the benchmark's variant name (workbench/bench/kernels.py)
    summary: str  # docs/contract.md's backend table: what computes the call
    takes: str  # the table: which calls it runs
    dtypes: tuple[torch.dtype, ...] | None  # None: every dtype varlen_attention takes

    def unavailable(self, device: torch.device) -> str | None:
        """Why it runs no call at all on `device` in this process (None: it may)."""

    def cannot_take(self, call: Call) -> str | None:
        """Why this backend cannot compute `call` (None: it can)."""

    def preference(self, call: Call) -> int:
        """How strongly "auto" prefers it for `call`, among the backends that take it."""

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out, lse): lse (H, T_q) float32 when `call.return_lse`, else whatever it has or None."""


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add `backend` after those registered; a name is registered once."""
    if backend.name == AUTO or backend.name in _REGISTRY:
        raise ValueError(f"a backend named {backend.name!r} is already registered; pick another name.")
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    del _REGISTRY[name]


def registered() -> tuple[Backend, ...]:
    """Every backend, in registration order ("auto"'s order of asking)."""
    return tuple(_REGISTRY.values())


def lookup(name: str) -> Backend:
    """The registered backend of that name."""
    if name not in _REGISTRY:
        raise ValueError(f"no backend named {name!r} is registered; the registered ones: {', '.join(map(repr, _REGISTRY))}.")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    """What `backend=` takes: "auto" and every registered name."""
    return (AUTO, *_REGISTRY)


def check_backend(backend: object) -> str:
    if backend not in names():
        raise ValueError(
            f"backend = {backend!r} is not one of {', '.join(map(repr, names()))}; pass {AUTO!r} (the preferred "
            "backend that can take the call, docs/contract.md, Backends) or one of the registered names."
        )
    return str(backend)


def choose(backend: str, call: Call) -> Backend:
    """The backend that computes `call`: the named one, or (auto) the most preferred that takes it."""
    if backend != AUTO:
        named = _REGISTRY[backend]
        reason = named.cannot_take(call)
        if reason:
            raise ValueError(
                f'backend="{backend}" cannot run this call: {reason}. Pass backend="auto" to run it on a registered '
                f"backend that can ({', '.join(map(repr, _REGISTRY))})."
            )
        return named
    best: tuple[int, Backend] | None = None
    for candidate in _REGISTRY.values():
        if candidate.cannot_take(call) is None:
            rank = candidate.preference(call)
            if best is None or rank > best[0]:
                best = (rank, candidate)
    if best is None:
        raise ValueError(f"no registered backend ({', '.join(map(repr, _REGISTRY))}) can run this call.")
    return best[1]


def table() -> str:
    """docs/contract.md's backend table, in registration order (tests/test_contract_doc.py keeps them equal)."""
    rows = [f"| `{b.name}` | {b.summary} | {b.takes} |" for b in _REGISTRY.values()]
    return "\n".join(["| backend | what computes the call | the calls it runs |", "| --- | --- | --- |", *rows])
