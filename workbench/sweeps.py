"""Sweeps: run a function over a grid of points, every point a tidy record, failures included.

    result = sweep(run_point, base=Case(seqlens_q=(5,)),
                   tail_q=[0, 2, 8], seqlens_q=[(5,), (3, 7)], impl=["buggy", "fixed"])
    result.records      # [{'tail_q': 0, 'seqlens_q': (5,), 'impl': 'buggy', 'ok': True, ...}, ...]

Axes named like a `Case` field are applied to `base` with `Case.with_` and `fn` receives the
case: `fn(case, **other_axes)`; without `base`, `fn(**point)`. `fn` returns a mapping of
results, a `ProbeRecord` (its `summary()` is used) or any value (stored as `value`). An
exception in one point becomes that point's record (`ok=False`, `error_type`, `error`), never a
crash of the sweep. `workers > 0` runs points in that many processes (spawn: `fn` must be
importable, i.e. defined in a module, not in a notebook cell).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from varlen_workbench.workbench.layout import Case

STATUS_COLUMNS = ("ok", "error_type", "error", "seconds")
_CASE_FIELDS = frozenset(f.name for f in dataclasses.fields(Case))


@dataclass
class SweepResult:
    """The grid's axes (in order) and one flat record per point, in grid order."""

    axes: dict[str, list[Any]]
    records: list[dict[str, Any]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.records if not r["ok"]]

    def where(self, **fixed: Any) -> list[dict[str, Any]]:
        """Records whose axis values equal `fixed` (e.g. `where(impl="fixed")`)."""
        unknown = set(fixed) - set(self.axes)
        if unknown:
            raise ValueError(f"where(): {sorted(unknown)} are not axes of this sweep; axes are {list(self.axes)}.")
        return [r for r in self.records if all(r[k] == v for k, v in fixed.items())]

    def table(self, columns: Sequence[str] | None = None) -> str:
        """A plain-text table (deterministic: no timings unless asked for)."""
        columns = list(columns or [*self.axes, "ok", "error_type"])
        rows = [[_cell(r.get(c, "")) for c in columns] for r in self.records]
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
        return "\n".join(line.rstrip() for line in lines)

    def to_frame(self):
        """The records as a pandas DataFrame (pandas is optional and imported only here)."""
        import pandas

        return pandas.DataFrame(self.records)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def _normalise(result: Any) -> dict[str, Any]:
    if hasattr(result, "summary") and callable(result.summary):
        result = result.summary()
    if isinstance(result, Mapping):
        return dict(result)
    return {"value": result}


def _run_point(fn: Callable, base: Case | None, point: dict[str, Any]) -> dict[str, Any]:
    """One point, exceptions captured (runs in the worker process when workers > 0)."""
    start = time.perf_counter()
    try:
        if base is None:
            result = fn(**point)
        else:
            case_changes = {k: v for k, v in point.items() if k in _CASE_FIELDS}
            rest = {k: v for k, v in point.items() if k not in _CASE_FIELDS}
            result = fn(base.with_(**case_changes), **rest)
        status: dict[str, Any] = {"ok": True, "error_type": None, "error": None}
        values = _normalise(result)
    except Exception as exc:  # a failing point is a result, whatever it raised
        status = {"ok": False, "error_type": type(exc).__name__, "error": str(exc)}
        values = {}
    status["seconds"] = time.perf_counter() - start
    return {"result": values, **status}


def _record(point: dict[str, Any], outcome: dict[str, Any]) -> dict[str, Any]:
    """Axis values first, then the result's columns, then the status columns.

    A result key equal to an axis name or a status column is stored as `result_<key>`.
    """
    record = dict(point)
    for key, value in outcome["result"].items():
        record[f"result_{key}" if key in point or key in STATUS_COLUMNS else key] = value
    record.update({k: outcome[k] for k in STATUS_COLUMNS})
    return record


def _check_axes(axes: Mapping[str, Any], base: Case | None) -> dict[str, list[Any]]:
    if not axes:
        raise ValueError("sweep() needs at least one axis, e.g. sweep(fn, tail_q=[0, 8]).")
    checked = {}
    for name, values in axes.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"axis {name!r} must be a list or tuple of values, got {type(values).__name__}; write {name}=[...].")
        if not values:
            raise ValueError(f"axis {name!r} is empty; give at least one value.")
        checked[name] = list(values)
    if base is not None and not isinstance(base, Case):
        raise TypeError(f"base must be a varlen_workbench.workbench.layout.Case or None, got {type(base).__name__}.")
    return checked


def _spawnable(fn: Callable) -> None:
    """Fails early, with the fix, when `fn` cannot reach a spawned worker process."""
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"sweep(workers>0): {getattr(fn, '__qualname__', fn)!r} is defined interactively (a notebook cell); "
            "worker processes cannot import it. Move it into a module, or use workers=0."
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"sweep(workers>0): fn cannot be sent to worker processes ({exc}); use a module-level "
            "function (not a lambda or a closure), or workers=0."
        ) from None


def _single_thread() -> None:
    import torch

    torch.set_num_threads(1)  # one process per core: no oversubscription


def sweep(
    fn: Callable,
    *,
    base: Case | None = None,
    workers: int = 0,
    progress: bool = True,
    desc: str | None = None,
    **axes: Sequence[Any],
) -> SweepResult:
    """Runs `fn` on every point of the product of `axes` and returns tidy records in grid order.

    `workers=0` runs in this process; `workers=N` in N spawned processes, each with one torch
    thread. A worker process that dies takes its pending points with it: they are recorded as
    failures (`BrokenProcessPool`), and the sweep still returns.
    """
    checked = _check_axes(axes, base)
    if workers < 0:
        raise ValueError(f"workers = {workers} must be >= 0 (0 runs every point in this process).")
    points = [dict(zip(checked, values)) for values in itertools.product(*checked.values())]
    bar = tqdm(total=len(points), desc=desc or getattr(fn, "__name__", "sweep"), disable=not progress)
    outcomes: list[dict[str, Any]] = [{} for _ in points]
    try:
        if workers == 0:
            for i, point in enumerate(points):
                outcomes[i] = _run_point(fn, base, point)
                bar.update()
        else:
            _spawnable(fn)
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(workers, mp_context=context, initializer=_single_thread) as pool:
                futures = {pool.submit(_run_point, fn, base, point): i for i, point in enumerate(points)}
                for future in as_completed(futures):
                    try:
                        outcomes[futures[future]] = future.result()
                    except Exception as exc:  # the worker died (crash, kill, unpicklable result)
                        outcomes[futures[future]] = {
                            "result": {},
                            "ok": False,
                            "error_type": type(exc).__name__,
                            "error": str(exc),
                            "seconds": 0.0,
                        }
                    bar.update()
    finally:
        bar.close()
    return SweepResult(checked, [_record(p, o) for p, o in zip(points, outcomes)])
