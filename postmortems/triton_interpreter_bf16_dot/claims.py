"""The claims of triton-interpreter-bf16-dot, checked on reproduce()'s results and the GPU records."""

from __future__ import annotations

import math

from varlen_workbench.postmortems.triton_interpreter_bf16_dot.cases import FIXED, META, REPRODUCTION, SOURCE_READ, WORKAROUND
from varlen_workbench.postmortems.triton_interpreter_bf16_dot.study import _decade, _row
from varlen_workbench.workbench.postmortem import (
    OURS,
    UPSTREAM_CPU,
    UPSTREAM_GPU,
    Claims,
    source_at,
)

claims = Claims()


@claims(
    "bf16 tl.dot under the interpreter differs from the fp32 product by many orders of magnitude; fp16 does not",
    evidence=UPSTREAM_CPU,
    headline=True,
)
def _orders_of_magnitude(results):
    run = results.interpreter["detector"]
    rel = {name: check["relative"] for name, check in run["checks"].items()}
    holds = rel["bfloat16"] > 1e6 and rel["float16"] < 1e-5 and rel["float32"] < 1e-5
    return holds, f"relative error bf16 {_decade(rel['bfloat16'])}; fp16 and fp32 below 1e-5 (triton {run['triton']})"


@claims("the interpreter's bf16 tl.dot is exactly numpy's matmul of the raw uint16 bit patterns", evidence=UPSTREAM_CPU)
def _mechanism(results):
    gap = results.interpreter["detector"]["bit_pattern_gap"]
    return gap == 0.0, f"max |tl.dot - np.matmul(bits, bits)| = {gap:g}"


@claims(
    "the same uint16 storage breaks the interpreter's bf16 tl.sum (triton#11604): the sum of a vector holding NaN "
    "comes out finite, so the NaN is silently lost; in fp16 it is NaN",
    evidence=UPSTREAM_CPU,
)
def _sum_loses_nan(results):
    found = results.sum_nan or {}
    bf16, fp16 = found.get("bfloat16"), found.get("float16", 0.0)  # None: the sum is NaN
    said = {name: "NaN" if x is None else f"{x:g}" for name, x in (("bf16", bf16), ("fp16", fp16))}
    holds = bf16 is not None and math.isfinite(bf16) and "float16" in found and fp16 is None
    return holds, f"tl.sum([NaN, 2, ..., 16]): bf16 {said['bf16']}, fp16 {said['fp16']}"


@claims(
    "the interpreter stores bf16 as uint16 and its create_dot converts only 8-bit float operands before np.matmul",
    evidence=source_at(SOURCE_READ),
)
def _source_says_so(results):
    storage, dot = results.source["storage"], results.source["create_dot"]
    stored = "tl.bfloat16: np.dtype(np.uint16)" in storage
    only_fp8 = "primitive_bitwidth == 8" in dot and "bfloat16" not in dot and "np.matmul" in dot
    read = SOURCE_READ[: SOURCE_READ.index("@") + 8]
    if stored and only_fp8:
        return True, f"as read at {read}; the installed interpreter's _get_np_dtype and create_dot say the same"
    return False, f"installed interpreter: bf16 stored as uint16: {stored}; create_dot converts only 8-bit floats: {only_fp8}"


@claims(
    "a bf16 attention forward with two tl.dot under the interpreter is finite but far off, and probe flags it",
    evidence=UPSTREAM_CPU,
)
def _probe_flags_it(results):
    raw = _row(results, REPRODUCTION)
    others = [_row(results, REPRODUCTION, dtype) for dtype in ("float32", "float16")]
    out = raw["errors"]["out"]
    holds = raw["real_finite"] and not raw["real_within_bound"] and all(r["real_within_bound"] for r in others)
    return (
        holds,
        f"bf16 REAL rows finite, out error {_decade(out['error'])} vs bound {_decade(out['bound'])}; fp32 and fp16 within bound",
    )


@claims("compiled natively on a GPU, Triton's bf16 tl.dot is correct: the bug is the interpreter's alone", evidence=UPSTREAM_GPU)
def _native_is_right(results):
    runs = [(r["provenance"], r["results"]["native"]) for r in results.gpu if r["results"].get("native")]
    if results.native is not None:
        runs.append(({"device": "this machine", "date": "now"}, results.native))
    if not runs:
        return (
            False,
            f"no native run: record one with `varlen-workbench repro {META.id} --device cuda --record data/gpu/{META.id}-<gpu>.json`",
        )
    right = [
        p for p, native in runs if native["detector"]["checks"]["bfloat16"]["correct"] and not native["detector"]["interpreted"]
    ]
    where = "; ".join(f"{p['device']} ({p['date'][:10]})" for p, _ in runs)
    return len(right) == len(runs), f"{len(right)}/{len(runs)} native runs correct in bf16: {where}"


@claims("our kernels are within the bound of the oracle in bf16 under the interpreter", evidence=OURS)
def _ours_within_bound(results):
    fixed, workaround = _row(results, FIXED), _row(results, WORKAROUND)
    within = [name for name, e in fixed["errors"].items() if e["error"] <= e["bound"]]
    holds = fixed["real_within_bound"] and fixed["padding_exactly_zero"] and workaround["real_within_bound"]
    return holds, f"fixed kernel: {', '.join(within)} within bound, padding exactly 0; reproduction + upcast: out within bound"


@claims("the detector's answer matches the observed behaviour", evidence=OURS)
def _detector_matches(results):
    run = results.interpreter["detector"]
    observed = not run["checks"]["bfloat16"]["correct"] and not _row(results, REPRODUCTION)["real_within_bound"]
    holds = run["bf16_dot_is_broken"] == observed
    evidence = f"interpreter: detector says broken={run['bf16_dot_is_broken']}, dot and attention observed broken={observed}"
    native = results.native
    if native is not None:
        native_observed = not native["detector"]["checks"]["bfloat16"]["correct"]
        holds = holds and native["detector"]["bf16_dot_is_broken"] is False and not native_observed
        evidence += f"; native: detector says broken=False, observed broken={native_observed}"
    return holds, evidence


@claims("natively the workaround is compiled out: bf16 operands reach the tensor cores", evidence=OURS)
def _compiled_out(results):
    off, on = results.compiled["off"], results.compiled["on"]
    holds = off["operand_type"] == "bf16" and off["conversions"] == 0 and any("bf16" in op for op in off["mma"])
    holds = holds and on["conversions"] == 2 and not on["mma"]  # the contrast: the flag really changes code
    native = results.native
    if native is not None:
        holds = holds and native["detector"]["bf16_dot_is_broken"] is False
    return holds, f"sm_{off['arch']}, flag off: {' '.join(off['mma'])}, 0 conversions; flag on: {on['fma']} scalar FMAs, no mma"
