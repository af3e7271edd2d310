"""Host syncs of a callable, counted with the profiler and attributed to the code that issued them.

A host sync is a moment the CPU waits for the GPU: it stalls the launch queue, so a training
step that syncs once per layer pays the GPU's whole backlog that many times. The profiler sees
every CUDA runtime call, so it sees the waits `torch.cuda.set_sync_debug_mode` cannot: an
event's `synchronize()`, a stream's, `torch.cuda.synchronize()`.

    found = count_syncs(step, phases=("forward", "backward"))
    found.host_syncs, found.by_owner["ours"], found.examples["ours"]

What is counted (`wait_kind`): stream, event and device synchronizations, and device-to-host
copies, whose direction comes from the GPU activity correlated with the runtime call ("Memcpy
DtoH (Device -> Pageable)"). A copy makes the host wait unless it is an asynchronous call into
pinned memory. The calls one torch op makes count as one host sync: `.item()` copies the
value, then synchronizes the stream, and waits once.

Whose code issued it (`owner`): the innermost Python frame of the call's stack outside torch
and the standard library, and outside this module and the benchmark that drives it, names the
owner: "ours" (the repository's kernels/ or workbench/), "transformers", or "other" (another
library, a user's script, or no Python frame at all: a sync the autograd engine makes in C++).
A sync torch makes on behalf of transformers (a boolean mask's `.all()` read on the host) is
transformers'; one FlashAttention makes inside our wrapper is "other", with the stack to show it.

Frames come from the profiler's Python tracer (`with_stack=True`): the Python-function events
enclosing the call, found through the op it ran inside or, for a call made outside any op (an
event's `synchronize()`), by time.
"""

from __future__ import annotations

import functools
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from varlen_workbench.workbench.provenance import REPO

OWNERS = ("ours", "transformers", "other")
# Our code: the repository's folders (a frame's file must exist there: Hugging Face's `kernels`,
# installed, prints as kernels/... too), or installed from a wheel under the import name.
OUR_FOLDERS = ("kernels", "workbench")
NAMESPACE = "varlen_workbench"
# Frames of the measurement itself: they call the code under test and issue nothing of their own.
HARNESS = ("workbench/instruments/syncs.py", "workbench/bench/stepbench.py")
WINDOW = "varlen_workbench.workbench.instruments.syncs: counted"  # the profiler range around the callable; calls outside it are not counted
UNPHASED = "outside the named phases"

# Runtime calls that block the host until the GPU catches up. The profiler (kineto) keeps every
# runtime call but a few noisy ones, and of the driver's calls only launches and virtual-memory
# calls (libkineto/src/CuptiCbidRegistry.cpp and isTrackedDriverCbid in CuptiActivity.h, read at
# pytorch/kineto@114171d): a library that synchronizes through the driver (cuStreamSynchronize)
# is not in the trace. cudaEventSynchronize left kineto's blocklist in 2023 (pytorch/kineto#808);
# tests/test_syncs.py's GPU test checks the installed profiler. torch's own waits are all runtime calls.
WAITS = {"cudaStreamSynchronize": "stream sync", "cudaEventSynchronize": "event sync", "cudaDeviceSynchronize": "device sync"}
COPY_PREFIX = "cudaMemcpy"
BLOCKING_COPY = "DtoH copy"  # the host waits for it: the synchronous API, or pageable memory
ASYNC_COPY = "DtoH copy, async into pinned memory"  # counted as a call, never as a wait
# A copy no GPU activity was matched to (by correlation id): counted as a call, never as a wait,
# so that a trace where the matching fails shows it.
UNMATCHED_COPY = "copy of unknown direction"

_FRAME = re.compile(r"^(?P<path>.+)\((?P<line>\d+)\): (?P<function>.+)$")


def _base_name(name: str) -> str:
    """A runtime call's name without its per-thread-stream or version suffix (`_ptsz`, `_v2`)."""
    return name.split("_", 1)[0]


def wait_kind(name: str, activity: str = "") -> str | None:
    """What kind of host-side call `name` is, given the GPU activity correlated with it (a copy's
    "Memcpy DtoH (Device -> Pinned)"): one of WAITS' values, BLOCKING_COPY, ASYNC_COPY,
    UNMATCHED_COPY, or None (a launch, a copy to the device, anything the host does not wait for)."""
    base = _base_name(name)
    if base in WAITS:
        return WAITS[base]
    if not base.startswith(COPY_PREFIX):
        return None
    if not activity:
        return UNMATCHED_COPY
    if "DtoH" not in activity:
        return None
    asynchronous = base.endswith("Async")
    return ASYNC_COPY if asynchronous and "Pinned" in activity else BLOCKING_COPY


def frame_file(frame: str) -> str | None:
    """The file of one profiler stack entry "path(line): function"; None for a builtin
    ("<built-in method item of Tensor object at 0x...>"), which is torch's or Python's."""
    found = _FRAME.match(frame)
    return found["path"] if found else None


def _relative(path: str, repo: Path) -> PurePosixPath:
    """`path` as the profiler prints it, made comparable: relative to the repository when inside
    it, relative to site-packages when installed there, else as given (the profiler already
    strips the sys.path entry it found the file under)."""
    pure = PurePosixPath(path)
    if pure.is_absolute():
        try:
            return pure.relative_to(PurePosixPath(repo))
        except ValueError:
            parts = pure.parts
            for marker in ("site-packages", "dist-packages"):
                if marker in parts:
                    return PurePosixPath(*parts[parts.index(marker) + 1 :])
    return pure


def frame_owner(frame: str, repo: Path = REPO) -> str | None:
    """The owner of one frame, or None for a frame that names nobody: torch's, the standard
    library's, a builtin, the harness's."""
    path = frame_file(frame)
    if path is None or path.startswith("<"):  # a builtin, or frozen importlib
        return None
    relative = _relative(path, repo)
    installed = bool(relative.parts) and relative.parts[0] == NAMESPACE
    if installed:
        relative = PurePosixPath(*relative.parts[1:])
    if str(relative) in HARNESS or not relative.parts:
        return None
    top = relative.parts[0]
    if top == "torch" or top.removesuffix(".py") in sys.stdlib_module_names:
        return None
    if installed or (top in OUR_FOLDERS and (repo / relative).is_file()):
        return "ours"
    if top == "transformers":
        return "transformers"
    return "other"


def owner(frames: Sequence[str], repo: Path = REPO) -> str:
    """Whose code issued a call whose stack is `frames` (innermost first): see the module docstring."""
    for frame in frames:
        found = frame_owner(frame, repo)
        if found is not None:
            return found
    return "other"


@dataclass(frozen=True)
class RuntimeCall:
    """One CUDA runtime call the host made, as the counter sees it."""

    name: str
    start_us: float
    end_us: float
    activity: str = ""  # the GPU activity correlated with it (a copy's direction and memory)
    issuer: int | None = None  # the torch op it ran inside: one op's calls are one host sync
    frames: tuple[str, ...] = ()  # its Python stack, innermost first
    phase: str = ""  # the innermost of the caller's named ranges it ran in

    @property
    def kind(self) -> str | None:
        return wait_kind(self.name, self.activity)


@dataclass
class SyncCount:
    """The host syncs of one profiled call: the headline `host_syncs` (host waits, one per op),
    by owner, by phase and owner ({"forward": {"ours": 1, ...}, ...}), one example stack per
    owner, and every runtime call of a kind `wait_kind` names, by kind."""

    host_syncs: int = 0
    by_owner: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OWNERS, 0))
    by_phase: dict[str, dict[str, int]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """As a record holds it."""
        return asdict(self)


def tally(calls: Iterable[RuntimeCall], repo: Path = REPO) -> SyncCount:
    """Counts the host syncs among `calls`: the calls of one issuing op (or a call made outside
    any op) that include a wait are one host sync, owned by the stack of its first wait."""
    count = SyncCount()
    kinds: Counter[str] = Counter()
    waits: dict[object, RuntimeCall] = {}
    for i, call in enumerate(calls):
        kind = call.kind
        if kind is None:
            continue
        kinds[kind] += 1
        if kind in (ASYNC_COPY, UNMATCHED_COPY):
            continue
        waits.setdefault(call.issuer if call.issuer is not None else ("alone", i), call)
    count.calls = dict(kinds)
    for call in waits.values():
        who = owner(call.frames, repo)
        count.host_syncs += 1
        count.by_owner[who] += 1
        count.by_phase.setdefault(call.phase or UNPHASED, dict.fromkeys(OWNERS, 0))[who] += 1
        count.examples.setdefault(who, [f"{call.name} ({call.activity})" if call.activity else call.name, *call.frames])
    return count


# -- from profiler events ---------------------------------------------------------------------


def _is_cpu(event: Any) -> bool:
    from torch.autograd import DeviceType

    return bool(event.device_type == DeviceType.CPU)


def _is_python(event: Any) -> bool:
    """A Python-function event of the tracer; by its name ("path(line): function", "<built-in
    ...>") where the profiler's events do not say (torch before the attribute)."""
    flag = getattr(event, "is_python_function", None)
    if flag is not None:
        return bool(flag)
    return bool(_FRAME.match(event.name)) or event.name.startswith("<built-in")


def _span(event: Any) -> tuple[float, float]:
    return event.time_range.start, event.time_range.end


def _inside(inner: tuple[float, float], outer: tuple[float, float]) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def _innermost(span: tuple[float, float], candidates: Iterable[Any]) -> Any | None:
    """The shortest of `candidates` whose span contains `span`."""
    containing = [c for c in candidates if _inside(span, _span(c))]
    return min(containing, key=lambda c: _span(c)[1] - _span(c)[0], default=None)


def _stack(event: Any, python_events: Sequence[Any]) -> tuple[int | None, tuple[str, ...]]:
    """The op `event` ran inside (by object identity) and its Python frames, innermost first.

    Up the profiler's tree: the innermost op, below any Python frame, is the issuer;
    Python-function events are the frames.
    An ancestor's recorded `stack` stands in where the tree holds no Python frame (older
    profilers, backward ops given their forward's stack). A call outside any op has no parent:
    the innermost Python-function event enclosing it in time gives its frames."""
    issuer: int | None = None
    frames: list[str] = []
    recorded: list[str] = []
    parent = event.cpu_parent
    if parent is None:
        parent = _innermost(_span(event), python_events)
    while parent is not None:
        if _is_python(parent):
            frames.append(parent.name)
        else:
            if issuer is None and not frames:  # an op above a Python frame (a profiler range) issued nothing
                issuer = id(parent)
            if not recorded and parent.stack:
                recorded = list(parent.stack)
        parent = parent.cpu_parent
    return issuer, tuple(frames or recorded)


def runtime_calls(events: Sequence[Any], window: str = WINDOW, phases: Sequence[str] = ()) -> list[RuntimeCall]:
    """The host-side calls `wait_kind` names among profiler `events` (`prof.events()`, or
    objects with the same attributes), issued inside the range named `window`; each with its
    correlated GPU activity, issuing op, frames and phase (the innermost range named in `phases`)."""
    cpu = [e for e in events if _is_cpu(e)]
    ranges = [e for e in cpu if e.name == window and not _is_python(e)]
    if not ranges:
        raise ValueError(f"runtime_calls: no range named {window!r} among the events; profile the callable through count_syncs.")
    counted = _span(ranges[0])
    activities = {e.id: e.name for e in events if not _is_cpu(e)}
    python_events = [e for e in cpu if _is_python(e)]
    phase_ranges = [e for e in cpu if e.name in phases and not _is_python(e)]
    found = []
    for e in cpu:
        span, activity = _span(e), activities.get(e.id, "")
        if _is_python(e) or wait_kind(e.name, activity) is None or not _inside(span, counted):
            continue
        issuer, frames = _stack(e, python_events)
        phase = _innermost(span, phase_ranges)
        found.append(RuntimeCall(e.name, *span, activity, issuer, frames, phase.name if phase is not None else ""))
    return found


@functools.cache
def _start_profiler_once() -> None:
    """One empty profiled session: the profiler imports modules on its first start, and torch's
    Python tracer names the frames of a module executed inside a session from its code object
    after the import has freed it (a UnicodeDecodeError, or garbage, when the trace is read)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True):
        pass


def count_syncs(fn: Callable[[], object], phases: Sequence[str] = (), repo: Path = REPO) -> SyncCount:
    """Runs `fn()` once under the profiler (CPU, and CUDA where available, Python stacks on) and
    counts its host syncs. `phases`: names of `torch.profiler.record_function` ranges `fn` opens
    (e.g. "forward", "backward"), to split the count by. Without CUDA there is nothing to wait
    for: every count is 0. Call `fn` once before counting: its first call may import modules,
    which the profiler cannot name (see `_start_profiler_once`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    _start_profiler_once()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()  # nothing queued before the window drains into it
    with profile(activities=activities, with_stack=True) as prof:
        with record_function(WINDOW):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # outside the window: lets the GPU activities reach the trace
    try:
        events = prof.events()
    except UnicodeDecodeError as exc:
        raise RuntimeError(
            f"count_syncs: the profiler cannot read a Python frame's name ({exc}), the frame of a module first "
            "imported inside the profiled call; call it once before counting, so that its imports are done."
        ) from None
    return tally(runtime_calls(events, WINDOW, phases), repo)
