"""The layout fuzzer: seeded random `Case`s, and the smallest failing one, shrunk greedily.

Each layout (a `varlen_workbench.workbench.layout.Case` from the shared `varlen_workbench.workbench.strategies.LayoutSpace`: lengths
including 0 and 1, GAP rows, TAIL rows, GQA, causal, a window where the implementation takes one, the
padding's fill, dtype) is probed once under NaN-poisoned memory and judged by
`layout_findings` (REAL rows within the bound, GAP and TAIL rows exactly 0); an exception on a
valid layout is a finding too. The first failure of each check is shrunk: drop sequences,
shorten them, remove padding, heads, causality, the window... keeping a change only if the case gets
smaller and still fails the same check, then drops every sequence the failure does not need.
The result is printed as a plain-torch snippet pasteable into an upstream issue
(`varlen_workbench.workbench.audit.snippets`), with a workbench replay beside it.

Two profiles: `tiny` for the Triton interpreter (a few dozen rows: CI runs hundreds of layouts)
and `native` for GPUs (up to a few thousand rows, block-edge lengths, head dims 32-128).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from varlen_workbench.workbench.audit.adapters import Adapted, AdapterRefused, NoOutput
from varlen_workbench.workbench.audit.checks import Finding, layout_findings, single_threaded
from varlen_workbench.workbench.audit.isolate import Crash, Spec, Worker, cuda_error, sticky
from varlen_workbench.workbench.audit.snippets import torch_snippet
from varlen_workbench.workbench.audit.spelling import option
from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.probes import ProbeRecord, probe
from varlen_workbench.workbench.strategies import LayoutSpace

RAISES = "raises-on-valid-layout"
SHRINK_SECONDS = 60  # with a time limit: how long shrinking may run after the search stops
PROBE_GRACE = 20  # seconds a shrink call may run past its stop time: the probe in flight
CHUNK_SECONDS = 180  # a chunk of layouts still running after this is killed, its layouts probed one by one
PROGRESS_SECONDS = 20  # at most this often, `fuzz(progress=...)` hears of the search so far
NO_OUTPUT = "no-output"


@dataclass(frozen=True)
class Profile:
    """The space layouts are drawn from."""

    name: str
    batch: int  # at most this many sequences
    lengths: tuple[int, ...]  # lengths drawn from these (edge values) ...
    longest: int  # ... or uniformly up to this
    extra_padding: int  # GAP rows per sequence, at most
    tail: int  # TAIL rows, at most
    heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    shrink_probes: int  # probes spent shrinking one failure, at most
    head_dims_v: tuple[int, ...] = ()  # v's head dims (empty: v has q and k's)

    def at_head_dim(self, head_dim: int, head_dim_v: int | None = None) -> Profile:
        """This profile's layouts at one head dim (`varlen-workbench audit --head-dim`), v's apart if given."""
        label = f"{head_dim}" + ("" if head_dim_v is None else f"/{head_dim_v}")
        return replace(
            self,
            name=f"{self.name} d{label}",
            head_dims=(head_dim,),
            head_dims_v=() if head_dim_v is None else (head_dim_v,),
        )


PROFILES = {
    # Interpreter cost grows with sequences x heads (one program each): few of both.
    "tiny": Profile("tiny", 3, (0, 1, 2, 3, 5, 8), 12, 3, 3, (1, 1, 2), (16, 32), ("float32", "float16", "bfloat16"), 40),
    # Natively every (head_dim, dtype, GQA group, causal) is a Triton compilation per kernel:
    # few of those, and all the variety in lengths, padding and fills, where the bugs live.
    "native": Profile(
        "native",
        6,
        (0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257),
        600,
        24,
        40,
        (2,),
        (64, 128),
        ("bfloat16",),
        200,
    ),
}


def default_profile(impl: Adapted) -> Profile:
    return PROFILES["native" if impl.device.type == "cuda" else "tiny"]


def _allowed(profile: Profile, impl: Adapted) -> tuple[tuple[str, ...], tuple[int, ...]]:
    dtypes = (
        tuple(d for d in profile.dtypes if impl.adapter.dtypes is None or d in impl.adapter.dtypes)
        or (impl.adapter.dtypes or ("float32",))[:1]
    )
    dims = (
        tuple(d for d in profile.head_dims if impl.adapter.head_dims is None or d in impl.adapter.head_dims)
        or (impl.adapter.head_dims or profile.head_dims)[:1]
    )
    return dtypes, dims


def layout_space(impl: Adapted, profile: Profile) -> LayoutSpace:
    """The layouts `profile` allows that the implementation can express (the shared strategy's
    bounds), each with at least one row of q and of k (a probe of zero-row tensors has nothing
    to look at)."""
    dtypes, dims = _allowed(profile, impl)
    return LayoutSpace(
        max_batch=profile.batch,
        longest=profile.longest,
        edge_lengths=profile.lengths,
        extra_padding=profile.extra_padding,
        tail=profile.tail,
        heads=profile.heads,
        head_dims=dims,
        head_dims_v=profile.head_dims_v,
        dtypes=dtypes,
        without=frozenset(impl.lacks),
    )


def random_case(rng: random.Random, impl: Adapted, profile: Profile) -> Case:
    """One layout of `layout_space(impl, profile)`, drawn from `rng`."""
    return layout_space(impl, profile).sample(rng)


def probe_layout(impl: Adapted, case: Case) -> tuple[ProbeRecord | None, list[Finding]]:
    """One poisoned probe of `case` against the oracle, and the contract violations it shows
    (an exception on this valid layout is one; a layout the adapter refuses shows none)."""
    try:
        record = probe(
            impl, pack(case, impl.device), name=impl.name, poisoned=True, backward=impl.backward, **impl.case_kwargs(case)
        )
    except AdapterRefused:
        return None, []
    except NoOutput as exc:  # nothing to judge: not a wrong result
        return None, [Finding(NO_OUTPUT, str(exc))]
    except Exception as exc:  # a valid layout must never raise
        return None, [Finding(RAISES, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")]
    return record, layout_findings(record)


def run_layout(impl: Adapted, case: Case) -> list[Finding]:
    return probe_layout(impl, case)[1]


# -- shrinking ----------------------------------------------------------------------------

_FILL_RANK = {fill: i for i, fill in enumerate((Fill.ZEROS, Fill.NAN, Fill.POS_INF, Fill.NEG_INF, Fill.HUGE, Fill.GARBAGE))}


def size(case: Case) -> tuple:
    """What 'smaller' means: fewer rows first, then fewer sequences, heads, dims, features."""
    return (
        case.total_rows("q") + case.total_rows("k"),
        case.batch,
        case.heads,
        case.kv_heads or case.heads,
        case.head_dim,
        case.head_dim_v is not None,
        case.seqlens_k is not None,
        case.padded_q is not None,
        case.causal,
        case.windowed,
        sum(side >= 0 for side in case.window),  # bounded sides
        sum(max(side, 0) for side in case.window),
        _FILL_RANK[case.fill],
        case.dtype != "float32",
        case.seed,
    )


def _normalised(case: Case) -> Case:
    """Drops descriptions that say nothing: seqlens_k equal to seqlens_q, padding equal to real."""
    changes: dict[str, Any] = {}
    if case.seqlens_k == case.seqlens_q:
        changes["seqlens_k"] = None
    for side in ("q", "k"):
        padded = getattr(case, f"padded_{side}")
        if padded is not None and padded == case.real_lengths(side):
            changes[f"padded_{side}"] = None
    if case.kv_heads == case.heads:
        changes["kv_heads"] = None
    return case.with_(**changes) if changes else case


def _per_sequence(case: Case) -> list[str]:
    return [
        f.name
        for f in fields(case)
        if f.name in ("seqlens_q", "seqlens_k", "padded_q", "padded_k") and getattr(case, f.name) is not None
    ]


def candidates(case: Case, impl: Adapted, profile: Profile) -> list[Case]:
    """Simpler variants of `case` (some invalid or not smaller: the caller filters)."""
    out: list[dict[str, Any]] = []
    per_seq = _per_sequence(case)
    for i in range(case.batch):
        if case.batch > 1:
            out.append({n: getattr(case, n)[:i] + getattr(case, n)[i + 1 :] for n in per_seq})
    for name in per_seq:
        values = getattr(case, name)
        for i, n in enumerate(values):
            for smaller in {0, 1, n // 2, n - 1}:
                if 0 <= smaller < n:
                    changed = {name: values[:i] + (smaller,) + values[i + 1 :]}
                    if name.startswith("seqlens"):  # keep the padded layout valid: shrink it along
                        side = "q" if name == "seqlens_q" else "k"
                        padded = getattr(case, f"padded_{side}")
                        if padded is not None:
                            changed[f"padded_{side}"] = padded[:i] + (padded[i] - (n - smaller),) + padded[i + 1 :]
                    out.append(changed)
    for name in ("seqlens_k", "padded_q", "padded_k"):
        if getattr(case, name) is not None:
            out.append({name: None})
    for name in ("tail_q", "tail_k"):
        n = getattr(case, name)
        out += [{name: m} for m in {0, 1, n // 2} if m < n]
    out += [{"heads": 1, "kv_heads": None}, {"kv_heads": None}, {"heads": case.heads // 2, "kv_heads": None}]
    if case.kv_heads:
        out.append({"heads": case.heads // 2, "kv_heads": max(case.kv_heads // 2, 1)})
    dtypes, dims = _allowed(profile, impl)
    out += [{"head_dim": d} for d in dims if d < case.head_dim]
    if case.head_dim_v is not None:
        out.append({"head_dim_v": None})
    out += [{"causal": False}, {"fill": Fill.ZEROS}, {"fill": Fill.NAN}, {"seed": 0}]
    if case.windowed:  # no window, one side unbounded, a bounded side narrowed to 0 or halved
        left, right = case.window
        out += [{"window": (-1, -1)}, {"window": (-1, right)}, {"window": (left, -1)}]
        out += [{"window": (w, right)} for w in {0, left // 2} if 0 <= w < left]
        out += [{"window": (left, w)} for w in {0, right // 2} if 0 <= w < right]
    if "float32" in dtypes:
        out.append({"dtype": "float32"})
    variants = []
    for changes in out:
        try:
            variant = _normalised(case.with_(**changes))
        except (ValueError, TypeError):  # an invalid variant (e.g. heads not a multiple of kv_heads)
            continue
        if variant.total_rows("q") and variant.total_rows("k"):
            variants.append(variant)
    return variants


def shrink(
    impl: Adapted, case: Case, finding: Finding, profile: Profile, budget: int | None = None, stop_at: float | None = None
) -> tuple[Case, Finding, int]:
    """The smallest variant of failing `case` that still fails `finding.check` (greedy), with its
    finding and the probes spent; `stop_at` (time.time()) ends both passes early."""
    budget = profile.shrink_probes if budget is None else budget
    current, spent, improved = case, 0, True
    while improved and spent < budget and (stop_at is None or time.time() < stop_at):
        improved = False
        for candidate in sorted(set(candidates(current, impl, profile)), key=size):
            if size(candidate) >= size(current):
                continue
            if spent >= budget or (stop_at is not None and time.time() > stop_at):
                break
            spent += 1
            hit = next((f for f in run_layout(impl, candidate) if f.check == finding.check), None)
            if hit:
                current, finding, improved = candidate, hit, True
                break
    current, finding, extra = _drop_unneeded_sequences(impl, current, finding, stop_at)
    return current, finding, spent + extra


def _drop_unneeded_sequences(
    impl: Adapted, case: Case, finding: Finding, stop_at: float | None = None
) -> tuple[Case, Finding, int]:
    """A last pass, outside the budget (at most one probe per sequence) but not past `stop_at`:
    drop every sequence the failure does not need, such as an unrelated empty key sequence the
    greedy pass kept because its budget ran out first."""
    spent, i = 0, 0
    while i < case.batch and case.batch > 1 and (stop_at is None or time.time() < stop_at):
        per_seq = _per_sequence(case)
        try:
            variant = _normalised(case.with_(**{n: getattr(case, n)[:i] + getattr(case, n)[i + 1 :] for n in per_seq}))
        except (ValueError, TypeError):
            i += 1
            continue
        hit = None
        if variant.total_rows("q") and variant.total_rows("k"):
            spent += 1
            hit = next((f for f in run_layout(impl, variant) if f.check == finding.check), None)
        if hit:
            case, finding = variant, hit
        else:
            i += 1
    return case, finding, spent


# -- the fuzzer ---------------------------------------------------------------------------


@dataclass
class FuzzFailure:
    """The smallest layout found that fails one check."""

    check: str
    evidence: str
    case: Case  # shrunk
    original: Case  # as first drawn
    shrink_probes: int
    snippet: str  # plain torch where the adapter spells out its call (varlen_workbench.workbench.audit.snippets), else the replay
    replay: str = ""  # the same case replayed through the workbench

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "evidence": self.evidence,
            "case": self.case.to_dict(),
            "original": self.original.to_dict(),
            "shrink_probes": self.shrink_probes,
            "snippet": self.snippet,
            "replay": self.replay,
        }


@dataclass
class FuzzResult:
    tried: int
    seconds: float
    seed: int
    profile: str
    failures: list[FuzzFailure] = field(default_factory=list)
    failing_layouts: int = 0  # layouts with any finding (the first of each check is shrunk)
    stopped_early: str = ""  # why fewer layouts than the budget were tried
    time_limit: float | None = None  # the search's, as asked
    search_seconds: float = 0.0  # how long the search ran (then shrinking); so far, in a progress report
    workers: int = 1  # processes the search ran in at once
    partial: str = ""  # in a progress report: what had not run yet ("" once the fuzzer ended)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tried": self.tried,
            "seconds": round(self.seconds, 2),
            "search_seconds": round(self.search_seconds, 2),
            "time_limit": self.time_limit,
            "workers": self.workers,
            "seed": self.seed,
            "profile": self.profile,
            "failing_layouts": self.failing_layouts,
            "stopped_early": self.stopped_early,
            **({"partial": self.partial} if self.partial else {}),
            "failures": [f.to_dict() for f in self.failures],
        }

    def summary(self) -> str:
        rate = f", {self.tried / self.seconds:.1f} layouts/s" if self.seconds else ""
        head = f"fuzzer: {self.tried} layouts ({self.profile} profile, seed {self.seed}) in {self.seconds:.1f} s{rate}; "
        head += f"{self.failing_layouts} failing" + (f"; stopped early: {self.stopped_early}" if self.stopped_early else "")
        return head + (f" ({self.partial})" if self.partial else "")


def layout(impl: Adapted, profile: Profile, seed: int, index: int) -> Case:
    """Layout number `index` of fuzzing run `seed`: the same whichever worker draws it."""
    return random_case(random.Random(seed * 1_000_003 + index), impl, profile)


def _scan(
    impl: Adapted,
    profile: Profile,
    seed: int,
    indices: Sequence[int],
    deadline: float | None,
    stop: Callable[[str], bool] = sticky,
) -> tuple[int, list[tuple[int, Finding]]]:
    """Probes the layouts `indices` until `deadline` (time.time()) or a finding `stop` accepts
    (by default a sticky CUDA fault: every later layout would fail for its sake);
    (layouts tried, (index, finding)s)."""
    tried, found = 0, []
    with single_threaded():
        for index in indices:
            if deadline is not None and time.time() > deadline:
                break
            findings = run_layout(impl, layout(impl, profile, seed, index))
            found += [(index, f) for f in findings]
            tried += 1
            if any(stop(f.evidence) for f in findings):
                break
    return tried, found


CHUNK = 16  # layouts per task sent to a child process


def _scan_isolated(
    worker: Worker, profile: Profile, seed: int, indices: Sequence[int], deadline: float | None
) -> tuple[int, list[tuple[int, Finding]]]:
    """`_scan` in `worker`'s child, resumed in a fresh child after a layout raises a CUDA error;
    a chunk that kills its child is probed again one layout at a time to name the layout."""
    tried, found = 0, list[tuple[int, Finding]]()
    remaining = list(indices)
    while remaining:
        # Never past the search's end plus SHRINK_SECONDS (the fuzzer's own end), nor CHUNK_SECONDS
        # for one chunk: a hanging layout costs its chunk's time, not the worker's whole search.
        timeout = None if deadline is None else min(max(deadline - time.time(), 0), CHUNK_SECONDS) + SHRINK_SECONDS
        value = worker.call(_scan, profile, seed, remaining, deadline, cuda_error, timeout=timeout)
        if isinstance(value, Crash):
            if len(remaining) == 1:
                if not value.timed_out:
                    tried, found = tried + 1, [*found, (remaining[0], Finding(RAISES, f"its process {value}"))]
                break
            for index in remaining:
                if deadline is not None and time.time() > deadline:  # a fresh child would probe nothing
                    break
                n, f = _scan_isolated(worker, profile, seed, [index], deadline)
                tried, found = tried + n, found + f
            break
        n, f = value
        tried, found, remaining = tried + n, found + f, remaining[n:]
        if not any(cuda_error(finding.evidence) for _, finding in f):
            break  # done, or the deadline came
        worker.retire()
    return tried, found


Tally = Callable[[int, list[tuple[int, Finding]]], None]


def _scan_workers(
    workers: list[Worker], profile: Profile, seed: int, budget: int, deadline: float | None, tally: Tally | None = None
) -> tuple[int, list[tuple[int, Finding]]]:
    """Layouts 0..budget-1 in chunks of CHUNK, each worker's child taking the next chunk;
    `tally(tried, found)` hears of every layout tried so far after each chunk."""
    from concurrent.futures import ThreadPoolExecutor

    chunks = iter(range(0, budget, CHUNK))
    lock = threading.Lock()
    tried, found = 0, list[tuple[int, Finding]]()

    def drive(worker: Worker) -> None:
        nonlocal tried, found
        while True:
            with lock:
                start = next(chunks, None)
            if start is None or (deadline is not None and time.time() > deadline):
                return
            n, f = _scan_isolated(worker, profile, seed, range(start, min(start + CHUNK, budget)), deadline)
            with lock:
                tried, found = tried + n, found + f
                if tally:
                    tally(tried, found)

    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(drive, workers))
    return tried, found


def _shrink_task(impl: Adapted, case: Case, finding: Finding, profile: Profile, stop_at: float | None):
    with single_threaded():
        return shrink(impl, case, finding, profile, stop_at=stop_at)


def _shrink_isolated(
    worker: Worker, case: Case, finding: Finding, profile: Profile, stop_at: float | None
) -> tuple[Case, Finding, int]:
    """`shrink` in a child. A CUDA error may have poisoned that child's later probes (so every
    candidate "failed"): such a shrunk layout counts only if it fails again in a fresh child;
    otherwise, and when the child dies or runs PROBE_GRACE past `stop_at`, the layout as drawn."""
    timeout = None if stop_at is None else max(stop_at - time.time(), 0) + PROBE_GRACE
    value = worker.call(_shrink_task, case, finding, profile, stop_at, timeout=timeout)
    if isinstance(value, Crash):
        return case, finding, 0
    small, small_finding, spent = value
    if cuda_error(finding.evidence) and small != case:
        worker.retire()
        timeout = None if stop_at is None else max(stop_at - time.time(), 0) + PROBE_GRACE
        again = worker.call(run_layout, small, timeout=timeout)
        worker.retire()
        if isinstance(again, Crash) or not any(f.check == finding.check for f in again):
            return case, finding, spent
    return small, small_finding, spent


def fuzz(
    impl: Adapted,
    budget: int,
    *,
    seed: int = 0,
    profile: Profile | str | None = None,
    time_limit: float | None = None,
    workers: int = 1,
    isolate: bool = False,
    progress: Callable[[FuzzResult], None] | None = None,
) -> FuzzResult:
    """Tries `budget` random layouts; shrinks the first failure of each check to a minimal case.

    `time_limit` (seconds) stops the search early, saying so in the result; shrinking comes
    after, bounded by the profile's `shrink_probes` and, with a time limit, by SHRINK_SECONDS:
    the whole fuzzer then ends within time_limit + SHRINK_SECONDS + PROBE_GRACE (a failure
    left no time is kept as drawn). `workers` > 1 probes in that many child processes
    (natively: Python and Triton compilation are the bottleneck, not the GPU); `isolate`
    probes in child processes even with one worker, so that a layout that faults the device
    or kills the process costs that layout alone (`varlen_workbench.workbench.audit.isolate`): the search
    resumes in a fresh child. Either needs an importable target ("module:function").
    `progress` (with child processes) hears of the search so far every PROGRESS_SECONDS, and
    once more when it ends: a `FuzzResult` with `partial` set and its failures as drawn, so
    that a caller killed before the end keeps the layouts tried.
    """
    if budget < 0:
        raise ValueError(f"{option('budget', budget)} must be >= 0 (the number of layouts to try).")
    if workers < 1:
        raise ValueError(f"{option('workers', workers)} must be >= 1.")
    profile = PROFILES[profile] if isinstance(profile, str) else (profile or default_profile(impl))
    start = time.perf_counter()
    began = time.time()
    deadline = None if time_limit is None else began + time_limit
    isolated = isolate or (workers > 1 and budget >= 2)

    def tallied(tried: int, found: list[tuple[int, Finding]], partial: str) -> FuzzResult:
        """The result of the layouts so far, each check's first failure as drawn."""
        result = FuzzResult(tried, time.perf_counter() - start, seed, profile.name, failing_layouts=len({i for i, _ in found}))
        result.time_limit, result.search_seconds, result.partial = time_limit, time.time() - began, partial
        result.workers = max(len(children), 1)
        firsts: dict[str, tuple[int, Finding]] = {}
        for index, finding in sorted(found, key=lambda x: x[0]):
            firsts.setdefault(finding.check, (index, finding))
        for index, finding in firsts.values():
            case = layout(impl, profile, seed, index)
            result.failures.append(FuzzFailure(finding.check, finding.evidence, case, case, 0, snippet(impl, case, finding)))
        return result

    last = [time.time()]

    def tally(tried: int, found: list[tuple[int, Finding]]) -> None:
        if progress and time.time() - last[0] >= PROGRESS_SECONDS:
            last[0] = time.time()
            progress(tallied(tried, found, "search under way: its failures as drawn, not shrunk"))

    with contextlib.ExitStack() as stack:
        children = [stack.enter_context(Worker(Spec.of(impl))) for _ in range(workers)] if isolated else []
        if children:
            tried, found = _scan_workers(children, profile, seed, budget, deadline, tally)
        else:
            tried, found = _scan(impl, profile, seed, range(budget), deadline)
        search_seconds = time.time() - began
        if progress and found:  # shrinking may not end before the caller's own deadline
            progress(tallied(tried, found, "search ended, shrinking under way: its failures as drawn, not shrunk"))
        result = FuzzResult(tried, 0.0, seed, profile.name, failing_layouts=len({i for i, _ in found}))
        result.time_limit, result.search_seconds, result.workers = time_limit, search_seconds, max(len(children), 1)
        # In one process a sticky fault ends the search (children resume in a fresh one instead).
        faulted = None if children else next((i for i, f in sorted(found, key=lambda x: x[0]) if sticky(f.evidence)), None)
        if faulted is not None:
            result.stopped_early = f"CUDA context lost at layout {faulted} (a fault is sticky: nothing after it can run)"
        elif tried < budget:
            result.stopped_early = f"time limit of {time_limit:g} s reached"
        shrunk: set[str] = set()
        stop_at = None if deadline is None else deadline + SHRINK_SECONDS  # shrinking's time, in all
        for index, finding in sorted(found, key=lambda x: x[0]):
            if finding.check in shrunk:
                continue
            shrunk.add(finding.check)
            case = layout(impl, profile, seed, index)
            if faulted is not None or (stop_at is not None and time.time() >= stop_at):  # no probe can run, or no time
                small, small_finding, spent = case, finding, 0
            elif children:
                small, small_finding, spent = _shrink_isolated(children[0], case, finding, profile, stop_at)
            else:
                with single_threaded():
                    small, small_finding, spent = shrink(impl, case, finding, profile, stop_at=stop_at)
            replay = snippet(impl, small, small_finding)
            plain = torch_snippet(impl, small, small_finding)
            result.failures.append(
                FuzzFailure(finding.check, small_finding.evidence, small, case, spent, plain or replay, replay)
            )
    result.seconds = time.perf_counter() - start
    return result


# -- reproduction snippets ----------------------------------------------------------------


def case_source(case: Case) -> str:
    """Python source constructing `case`: only the fields that differ from the defaults."""
    defaults = Case(case.seqlens_q)
    parts = [f"seqlens_q={case.seqlens_q!r}"]
    for f in fields(case):
        value = getattr(case, f.name)
        if f.name == "seqlens_q" or value == getattr(defaults, f.name):
            continue
        parts.append(f"{f.name}=Fill.{value.name}" if isinstance(value, Fill) else f"{f.name}={value!r}")
    return f"Case({', '.join(parts)})"


# What a replay snippet imports (varlen_workbench.workbench.audit.records.shown_snippet reads older
# records' snippets with these).
SNIPPET_IMPORTS = (
    "from varlen_workbench.workbench.layout import Case, Fill, pack",
    "from varlen_workbench.workbench.probes import probe",
    "from varlen_workbench.workbench.audit import adapt, layout_findings",
)


def snippet(impl: Adapted, case: Case, finding: Finding) -> str:
    """A ready-to-run reproduction: build the case, probe the implementation, print what broke."""
    if impl.target:
        load = f'impl = adapt("{impl.target}", adapter="{impl.adapter.name}", device="{impl.device.type}")'
    else:
        load = f'impl = adapt(your_function, adapter="{impl.adapter.name}", device="{impl.device.type}")  # your_function: {impl.name}'
    return "\n".join(
        [
            f"# {finding.check}: {finding.evidence}",
            *SNIPPET_IMPORTS,
            "",
            load,
            f"case = {case_source(case)}",
            "record = probe(impl, pack(case, impl.device), poisoned=True, backward=impl.backward, **impl.case_kwargs(case))",
            'print(*layout_findings(record), sep="\\n")',
        ]
    )
