"""Every piece of process-wide state of `varlen_workbench.kernels`, owned here, and `reset()`.

Nothing else in kernels/ keeps state between calls: every other module holds constants, and
tests/test_module_state.py fails on module-level state anywhere else. What lives here:

- memoized functions (`cached`): answers that cannot change within a process but cost host time
  on every call (a device's compute capability, FA4's import, the tiles of a head dim, ...). Each
  stays in its own module, decorated `@cached`, which registers it here;
- one instance per class (`instance`): the tile tuner's choices (`tuner.TileTuner`), the pinned
  host buffers that device checks reuse (`device_check._HostVerdicts`);
- what a backend derives from a `VarlenMetadata` (`derived`): kept per backend and per metadata
  object, weakly (it goes with the object), never written onto the object;
- `LAST`: the metadata the last positional call or HF swap built (`Memo`, one value);
- the blocks open now (`OpenBlocks`): `runtime.use_interpreter()` (`FORCED`) and
  `runtime.interpreting()` (`INTERPRETING`). They are not caches: each block closes itself, so
  `reset()` leaves them.

`reset()` puts every cache back as a fresh process has it: for tests, and for a process that
changed what the caches answered (another FA4 installed, ...). Call it outside any kernel call.
After it `op.pinned(name)` makes a new callable, no longer `varlen_attention_<name>` itself.
The default device is no state: `_compat.default_device()` reads WORKBENCH_DEVICE on each call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from functools import _lru_cache_wrapper, cache
from typing import Any, TypeVar

import torch

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_CACHED: list[_lru_cache_wrapper] = []  # every function `cached` wrapped, in decoration order
_INSTANCES: dict[type, Any] = {}  # `instance`'s objects, by class
_DERIVED: dict[str, weakref.WeakKeyDictionary] = {}  # `derived`'s values: by backend, then by metadata object


def cached(fn: F) -> F:
    """`functools.cache`, registered so that `reset()` clears it. For answers that cannot change
    within a process; the function keeps its `cache_clear()`."""
    wrapped = cache(fn)
    _CACHED.append(wrapped)
    return wrapped  # type: ignore[return-value]


def instance(cls: Callable[[], T]) -> T:
    """The process's one `cls()`, made when first asked for (not at import); `reset()` drops it."""
    try:
        return _INSTANCES[cls]  # type: ignore[index]
    except KeyError:
        return _INSTANCES.setdefault(cls, cls())  # type: ignore[call-overload]


def derived(backend: str, metadata: object, build: Callable[[], T]) -> T:
    """What `backend` derives from `metadata` (a `VarlenMetadata`), built once per object by
    `build()` and kept while the object lives."""
    values = _DERIVED.setdefault(backend, weakref.WeakKeyDictionary())
    try:
        return values[metadata]
    except KeyError:
        value = values[metadata] = build()
        return value


class Memo:
    """One value kept for the very same caller tensors, unmodified, and the same other arguments:
    a match needs the same tensor objects (weak references: a freed tensor never matches, even
    if a new one gets its memory), each with the version counter it had (an in-place write bumps
    it). A write that bypasses torch's version counter (a raw kernel writing into the tensor's
    memory) is not seen: build a new VarlenMetadata for new boundary values. One value, so it is
    bounded: the next miss replaces it."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.refs: tuple = ()
        self.versions: tuple = ()
        self.extra: Any = None
        self.value: Any = None

    def get(self, tensors: Sequence[torch.Tensor | None], extra: Any, build: Callable[[], Any]) -> Any:
        if self._holds(tensors, extra):
            return self.value
        value = build()
        self.refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self.versions = tuple(None if t is None else t._version for t in tensors)
        self.extra, self.value = extra, value
        return value

    def _holds(self, tensors: Sequence[torch.Tensor | None], extra: Any) -> bool:
        if self.value is None or len(self.refs) != len(tensors) or self.extra != extra:
            return False
        for ref, t, version in zip(self.refs, tensors, self.versions):
            if (ref is None) != (t is None):
                return False
            if t is not None and (not isinstance(t, torch.Tensor) or ref() is not t or t._version != version):
                return False
        return True


# The metadata of the last positional call (kernels/varlen/metadata.py `implicit`) or of the
# transformers swap (kernels/hf.py `step_metadata`), keyed on the tensors the caller handed over:
# the layers of one step find it without a host read.
LAST = Memo()


class OpenBlocks:
    """How many blocks of one kind are open, counted under `lock` (all threads)."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.open = 0


FORCED = OpenBlocks(threading.Lock())  # `runtime.use_interpreter()` blocks open, all threads
# `runtime.interpreting()` blocks open in the thread holding the lock: interpreted launches take
# it one at a time (Triton's interpreter patches `triton.language` for every thread).
INTERPRETING = OpenBlocks(threading.RLock())


def reset() -> None:
    """Clears every cache: the `cached` functions, the `instance` objects, every backend's
    `derived` values and `LAST`. Open blocks (`FORCED`, `INTERPRETING`) are left to close."""
    for fn in _CACHED:
        fn.cache_clear()
    _INSTANCES.clear()
    _DERIVED.clear()
    LAST.clear()
