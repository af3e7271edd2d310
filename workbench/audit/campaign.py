"""The bad-input campaign: every malformed call of `workbench.malformed`, fed to one implementation.

Each call is classified by what the implementation does with it:

    clear error   ValueError/TypeError whose message names the argument (the contract's answer)
    vague error   ValueError/TypeError that does not say which argument is wrong
    crash         any other exception (RuntimeError from deep inside, IndexError, a CUDA fault)
    silent NaN    it returned, and the output holds NaN/Inf (NaN-poisoned memory makes unwritten
                  rows show up as NaN every time)
    silent wrong  it returned a finite output: malformed metadata silently accepted
    n/a           the implementation cannot express the call (no padded layout, no scale), or
                  the input is malformed only for our kernel (head_dim 24) and the adapter
                  declares nothing about it

Arguments are named by our names or the implementation's own (`cu_seq_q` for torch).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from workbench.audit.adapters import Adapted, AdapterRefused
from workbench.layout import DTYPE_NAMES
from workbench.malformed import CATALOGUE, HEADS, Malformed, base_args, split_call
from workbench.poison import poisoned_memory


class Outcome(str, enum.Enum):
    CLEAR = "clear error"
    VAGUE = "vague error"
    CRASH = "crash"
    SILENT_NAN = "silent NaN"
    SILENT_WRONG = "silent wrong result"
    NA = "n/a"
    NOT_RUN = "not run"


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _why_not(impl: Adapted, case: Malformed) -> str | None:
    for feature in sorted(case.requires):
        if feature in impl.lacks:
            return impl.lacks[feature]
    if case.outside is None:
        return None
    what, value = case.outside
    declared = impl.adapter.head_dims if what == "head_dim" else impl.adapter.dtypes
    value_name = str(value).removeprefix("torch.")
    if declared is None:
        return f"adapter {impl.adapter.name!r} declares no supported {what}s, so {what} {value_name} may be legal"
    if value in declared or value_name in declared:
        return f"adapter {impl.adapter.name!r} declares {what} {value_name} supported"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def classify(impl: Adapted, case: Malformed, base: dict[str, Any]) -> tuple[Outcome, str]:
    """Runs one malformed call (forward only, poisoned memory) and says what happened."""
    why = _why_not(impl, case)
    if why:
        return Outcome.NA, why
    positional, keywords = split_call(case.build(base))
    try:
        with torch.no_grad(), poisoned_memory():
            out = impl(*positional, **keywords)
            _sync(impl.device)
    except AdapterRefused as exc:
        return Outcome.NA, str(exc)
    except (ValueError, TypeError) as exc:
        named = case.names_argument(str(exc), impl.aliases)
        return (Outcome.CLEAR if named else Outcome.VAGUE), _first_line(exc)
    except Exception as exc:  # anything else is what the campaign is looking for
        return Outcome.CRASH, _first_line(exc)
    if not isinstance(out, torch.Tensor):
        return Outcome.SILENT_WRONG, f"returned {type(out).__name__}"
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        return Outcome.SILENT_NAN, f"returned an output with {bad} non-finite values"
    return Outcome.SILENT_WRONG, "returned a finite output without complaint"


def run_campaign(impl: Adapted, dtype: str) -> list[dict[str, str]]:
    """One row per catalogue case: id, outcome, evidence."""
    base = base_args(
        DTYPE_NAMES[dtype],
        impl.device,
        padded="padded" not in impl.lacks,
        kv_heads=HEADS if "gqa" in impl.lacks else 2,
    )
    rows: list[dict[str, str]] = []
    lost = None  # a CUDA fault poisons the context: later calls would all "crash" for its sake
    for case in CATALOGUE:
        if lost:
            outcome, evidence = Outcome.NOT_RUN, f"the CUDA context was lost at {lost}"
        else:
            outcome, evidence = classify(impl, case, base)
            if (
                outcome is Outcome.CRASH
                and impl.device.type == "cuda"
                and ("CUDA error" in evidence or "illegal memory" in evidence)
            ):
                lost = case.id
        rows.append({"id": case.id, "outcome": outcome.value, "evidence": evidence})
    return rows


def summarize(rows: list[dict[str, str]]) -> tuple[bool | None, str]:
    """(all applicable cases are clear errors, or None if none applies; one-line evidence)."""
    by_outcome: dict[str, list[str]] = {}
    for row in rows:
        by_outcome.setdefault(row["outcome"], []).append(row["id"])
    not_applicable = by_outcome.pop(Outcome.NA.value, [])
    clear = by_outcome.pop(Outcome.CLEAR.value, [])
    applicable = len(rows) - len(not_applicable)
    if applicable == 0:
        return None, "no case of the catalogue can be expressed"
    summary = f"{len(clear)}/{applicable} clear errors" + (f" ({len(not_applicable)} n/a)" if not_applicable else "")
    return not by_outcome, "; ".join([summary, *(f"{o}: {', '.join(ids)}" for o, ids in by_outcome.items())])
