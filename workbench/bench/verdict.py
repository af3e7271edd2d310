"""A benchmark's targets and their verdicts, and the time cells its tables print: what the kernel,
training-step and Hopper reports share (`kernel_report`, `step_report`, `hopper_report`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """One of issue 17's targets, judged on its worst case over the configurations it covers."""

    name: str
    measured: float
    bound: float
    at_least: bool  # met when measured >= bound (else measured <= bound)
    worst_case: str

    @property
    def met(self) -> bool:
        return self.measured >= self.bound if self.at_least else self.measured <= self.bound


def worst(name: str, values: dict[str, float], bound: float, at_least: bool) -> Target | None:
    """The target `name` judged on its worst value (the smallest when `at_least`, else the largest),
    None where nothing was measured (NaN)."""
    values = {k: v for k, v in values.items() if not math.isnan(v)}
    if not values:
        return None
    where = (min if at_least else max)(values, key=lambda k: values[k])
    return Target(name, values[where], bound, at_least, where)


def format_targets(found: list[Target], fastest: list[Target] | None = None) -> str:
    """One line per target: its worst ratio on the medians, whether it is met, where; with
    `fastest` (the same targets judged on `fastest_calls`), that verdict beside it."""
    judged = {t.name: t for t in fastest or ()}
    extra = f" {'fastest':>7}  {'met':<4}" if fastest is not None else ""
    lines = [f"{'target':<76} {'median':>7}  {'met':<4}{extra} worst case (median)"]
    for t in found:
        line = f"{t.name:<76} {t.measured:>7.3f}  {'yes' if t.met else 'NO':<4}"
        if fastest is not None:
            f = judged.get(t.name)
            line += f" {f.measured:>7.3f}  {'yes' if f.met else 'NO':<4}" if f else f" {'-':>7}  {'-':<4}"
        lines.append(f"{line} {t.worst_case}")
    return "\n".join(lines)


def targets_summary(found: list[Target], fastest: list[Target]) -> str:
    """The verdict on the targets as Markdown, from the same two judgements `format_targets` prints
    (medians, and the fastest calls): which hold, which a fastest call misses and by how much, and
    which fail either way. Nothing in it is typed: a re-recorded run re-words it."""
    on_fastest = {t.name: t for t in fastest}
    held = [t for t in found if t.met]
    missed = [on_fastest[t.name] for t in held if t.name in on_fastest and not on_fastest[t.name].met]
    failing = [t for t in found if not t.met and not (t.name in on_fastest and on_fastest[t.name].met)]
    lines = [f"**{len(held)} of {len(found)} targets hold on the medians:**", ""]
    lines += [f"- {t.name}" for t in held]
    if missed:
        lines += ["", "**On the fastest calls the same hold but:**", ""]
        lines += [
            f"- {t.name}: {t.measured:.3f}, {abs(t.measured / t.bound - 1):.1%} short of its bound, on {t.worst_case}"
            for t in missed
        ]
    else:
        lines += ["", "They hold on the fastest calls too."]
    if failing:
        lines += ["", f"**The {len(failing)} others fail on their worst workload, on the medians and on the fastest calls:**", ""]
        lines += [f"- {t.name}: {t.measured:.3f} on {t.worst_case}" for t in failing]
    return "\n".join(lines)


def ms_with_fastest(median: float | None, fastest: float | None) -> str:
    """A median time in ms with the fastest timed call in brackets, where the record kept one."""
    return "-" if median is None else f"{median:.3f}" if fastest is None else f"{median:.3f} ({fastest:.3f})"
