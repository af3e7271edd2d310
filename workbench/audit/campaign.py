"""The bad-input campaign: every malformed call of `varlen_workbench.workbench.malformed`, fed to one implementation.

It grades *input validation*, apart from correctness: an attention that computes every valid
layout right but checks nothing gets a low validation grade, never a FAIL of the audit. Each
call is classified by what the implementation does with it, with the same rules for every
implementation (`classify_exception` and `classify`):

    clear error     it raised, and the message names the offending argument, by our name or
                    the implementation's own (`cu_seq_q`), whatever the exception type:
                    `RuntimeError: cu_seqlens_q must have dtype int32` is a clear error
    vague error     it raised an ordinary error (ValueError, TypeError, RuntimeError,
                    AssertionError, a Triton compile error...) that does not say which argument
                    is wrong: refused, but the user must guess why
    crash           the call fell over instead of refusing: a CUDA fault (illegal memory access,
                    device-side assert: the process's CUDA context is lost), or an accident of
                    the code (IndexError, KeyError, AttributeError, ZeroDivisionError...)
    no output       it returned something that is not a tensor (None)
    correct         it accepted the call and its output equals the fp64 oracle of the call it
                    stands for (a Python list for cu_seqlens, a negative scale: not wrong)
    silent wrong    it accepted the call and its output differs from that fp64 oracle
    silent NaN      it accepted a call that has no meaningful answer and returned NaN/Inf
    accepted        it accepted a call that has no meaningful answer, with a finite output
    n/a             the implementation cannot express the call (no padded layout, no scale)

The grade: `validates` when every applicable call is a clear error or correct, `partial` when
some are, `none` when none is. The campaign runs on a layout without TAIL rows (`base_args(
tail=False)`), so a TAIL-row bug cannot pose as a malformed-input finding, under NaN-poisoned
memory, forward only.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from varlen_workbench.workbench.audit.adapters import Adapted, AdapterRefused, NoOutput
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.layout import DTYPE_NAMES
from varlen_workbench.workbench.malformed import CATALOGUE, HEAD_DIM, HEADS, Malformed, base_args, split_call


class Outcome(str, enum.Enum):
    CLEAR = "clear error"
    VAGUE = "vague error"
    CRASH = "crash"
    NO_OUTPUT = "no output"
    CORRECT = "correct"
    SILENT_WRONG = "silent wrong result"
    SILENT_NAN = "silent NaN"
    ACCEPTED = "accepted"
    NA = "n/a"
    NOT_RUN = "not run"


# What counts as good handling of a malformed (or legal but unusual) call.
GOOD = frozenset({Outcome.CLEAR, Outcome.CORRECT})
# Exceptions that are accidents of the code, not refusals: the call fell over.
ACCIDENTS = (IndexError, KeyError, AttributeError, ZeroDivisionError, NameError, RecursionError, MemoryError, SystemError)
# Sticky CUDA faults: the context is lost, every later call fails for their sake. (Not every
# "CUDA error" is one: "invalid argument" from a launch leaves the context usable.)
CUDA_FAULTS = (
    "illegal memory access",
    "device-side assert",
    "misaligned address",
    "unspecified launch failure",
    "illegal instruction",
    "an illegal instruction",
)
# Any CUDA error is a crash for the campaign's grading (not a refusal), sticky or not.
CUDA_ERRORS = ("CUDA error", "Triton Error [CUDA]", *CUDA_FAULTS)


def _first_line(exc: BaseException) -> str:
    return (
        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}" if str(exc).strip() else f"{type(exc).__name__} (no message)"
    )


def classify_exception(exc: BaseException, case: Malformed, aliases: dict[str, str] | None = None) -> Outcome:
    """clear error, vague error or crash: the one rule applied to every implementation."""
    text = f"{type(exc).__name__}: {exc}"
    if any(fault in text for fault in CUDA_ERRORS) or isinstance(exc, ACCIDENTS):
        return Outcome.CRASH
    return Outcome.CLEAR if case.names_argument(str(exc), aliases) else Outcome.VAGUE


def _why_not(impl: Adapted, case: Malformed) -> str | None:
    for feature in sorted(case.requires):
        if feature in impl.lacks:
            return impl.lacks[feature]
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_reference(call: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The reference call in plain form: tensors for lists, floats for 0-d tensors."""
    out = dict(call)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if not isinstance(out[name], torch.Tensor):
            out[name] = torch.tensor(out[name], dtype=torch.int32)
        out[name] = out[name].reshape(-1).to(torch.int64).cpu()
    for name in ("cu_seqlens_q_padded", "cu_seqlens_k_padded"):
        if isinstance(out[name], torch.Tensor):
            out[name] = out[name].to(torch.int64).cpu()
    if isinstance(out["scale"], torch.Tensor):
        out["scale"] = float(out["scale"])
    return out


def compare_with_oracle(out: torch.Tensor, call: dict[str, Any]) -> tuple[bool, str]:
    """(output within the bound of the fp64 oracle on REAL rows, evidence)."""
    from varlen_workbench.workbench.bounds import error_check
    from varlen_workbench.workbench.reference import reference_attention

    ref = _as_reference(call, out.device)
    q, k, v = (ref[n].detach().cpu() for n in ("q", "k", "v"))
    expected = (*q.shape[:2], v.shape[2])  # q's rows and heads, v's head dim
    if tuple(out.shape) != expected:
        return False, f"output shape {tuple(out.shape)}, the call's is {expected} (q's rows and heads, v's head dim)"
    args = (ref["cu_seqlens_q"], ref["cu_seqlens_k"], ref["max_seqlen_q"], ref["max_seqlen_k"])
    kwargs = dict(
        cu_seqlens_q_padded=ref["cu_seqlens_q_padded"], cu_seqlens_k_padded=ref["cu_seqlens_k_padded"], scale=ref["scale"]
    )
    oracle = reference_attention(q.double(), k.double(), v.double(), *args, **kwargs, validate=False)
    baseline_dtype = q.dtype if q.dtype != torch.float64 else torch.float32
    baseline = reference_attention(q, k, v, *args, **kwargs, compute_dtype=baseline_dtype, validate=False)
    starts = (ref["cu_seqlens_q_padded"] if ref["cu_seqlens_q_padded"] is not None else ref["cu_seqlens_q"]).tolist()
    real = torch.zeros(q.shape[0], dtype=torch.bool)
    for start, n in zip(starts, ref["cu_seqlens_q"].diff().tolist()):
        real[start : start + n] = True
    got = out.detach().cpu()[real]
    bad = int((~torch.isfinite(got)).sum())
    if bad:
        return False, f"{bad} non-finite values in REAL rows; the fp64 oracle is finite"
    check = error_check("out", got.double(), oracle[real], baseline[real].double(), q.dtype, keys=int(ref["max_seqlen_k"]))
    if check.within:
        return True, f"accepted; REAL rows match the fp64 oracle (error {check.error:.2g}, bound {check.bound:.2g})"
    return False, f"REAL rows differ from the fp64 oracle: error {check.error:.3g} > bound {check.bound:.3g}"


def classify(impl: Adapted, case: Malformed, base: dict[str, Any]) -> tuple[Outcome, str]:
    """Runs one malformed call (forward only, poisoned memory) and says what happened."""
    why = _why_not(impl, case)
    if why:
        return Outcome.NA, why
    built = case.build(base)
    positional, keywords = split_call(built)
    try:
        with torch.no_grad(), poisoned_memory():
            out = impl(*positional, **keywords)
            _sync(impl.device)
    except AdapterRefused as exc:
        return Outcome.NA, str(exc)
    except NoOutput as exc:
        return Outcome.NO_OUTPUT, str(exc)
    except Exception as exc:  # the one rule for every implementation
        return classify_exception(exc, case, impl.aliases), _first_line(exc)
    reference = case.reference_call(base, built)
    if reference is not None:
        try:
            ok, evidence = compare_with_oracle(out, reference)
        except Exception as exc:  # the oracle cannot compute it (e.g. head dims that differ): no answer to compare
            return Outcome.ACCEPTED, f"accepted; no fp64 answer to compare with ({_first_line(exc)})"
        return (Outcome.CORRECT if ok else Outcome.SILENT_WRONG), evidence
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        return Outcome.SILENT_NAN, f"accepted; the output holds {bad} non-finite values"
    return Outcome.ACCEPTED, "accepted without complaint; the call has no meaningful answer to compare"


# The catalogue's head dim first. An implementation that refuses it outright (our FA4 path takes
# 64 and 128 only) gets the first of the others it runs: else every case would grade its refusal
# of the head dim, not its validation of the case.
BASE_HEAD_DIMS = (HEAD_DIM, 64, 128)


def _runs(impl: Adapted, call: dict[str, Any]) -> bool:
    positional, keywords = split_call(call)
    try:
        with torch.no_grad():
            impl(*positional, **keywords)
            _sync(impl.device)
    except Exception:  # whatever the refusal: this head dim is not the implementation's
        return False
    return True


def run_campaign(impl: Adapted, dtype: str) -> list[dict[str, str]]:
    """One row per catalogue case: id, outcome, evidence, and the head dim of its base call.
    Padded cases on a padded layout, the others on an unpadded one; neither has TAIL rows."""

    def base(padded: bool, head_dim: int) -> dict[str, Any]:
        kv_heads = HEADS if "gqa" in impl.lacks else 2
        return base_args(DTYPE_NAMES[dtype], impl.device, padded=padded, kv_heads=kv_heads, tail=False, head_dim=head_dim)

    head_dim = next((d for d in BASE_HEAD_DIMS if _runs(impl, base(False, d))), HEAD_DIM)
    bases = {padded: base(padded, head_dim) for padded in ({False, True} if "padded" not in impl.lacks else {False})}
    rows: list[dict[str, str]] = []
    lost = None  # a CUDA fault poisons the context: later calls would all "crash" for its sake
    for case in CATALOGUE:
        if lost:
            outcome, evidence = Outcome.NOT_RUN, f"the CUDA context was lost at {lost}"
        else:
            outcome, evidence = classify(impl, case, bases.get("padded" in case.requires, bases[False]))
            if outcome is Outcome.CRASH and impl.device.type == "cuda" and any(f in evidence for f in CUDA_FAULTS):
                lost = case.id
        rows.append({"id": case.id, "outcome": outcome.value, "evidence": evidence, "head_dim": str(head_dim)})
    return rows


GRADES = ("validates", "partial", "none")


def summarize(rows: list[dict[str, str]]) -> tuple[str | None, str]:
    """(grade: validates / partial / none, or None if no case applies; one-line evidence)."""
    by_outcome: dict[str, list[str]] = {}
    for row in rows:
        by_outcome.setdefault(row["outcome"], []).append(row["id"])
    not_applicable = by_outcome.pop(Outcome.NA.value, [])
    applicable = len(rows) - len(not_applicable)
    if applicable == 0:
        return None, "no case of the catalogue can be expressed"
    good = sum(len(by_outcome.get(o.value, [])) for o in GOOD)
    clear, correct = by_outcome.pop(Outcome.CLEAR.value, []), by_outcome.pop(Outcome.CORRECT.value, [])
    summary = f"{len(clear)}/{applicable} clear errors" + (f", {len(correct)} accepted correctly" if correct else "")
    summary += f" ({len(not_applicable)} n/a)" if not_applicable else ""
    head_dims = {row.get("head_dim", str(HEAD_DIM)) for row in rows}
    summary += "" if head_dims == {str(HEAD_DIM)} else f" (at head_dim {', '.join(sorted(head_dims))}: it refuses {HEAD_DIM})"
    grade = "validates" if good == applicable else "none" if not clear else "partial"
    return grade, "; ".join([summary, *(f"{o}: {', '.join(ids)}" for o, ids in by_outcome.items())])
