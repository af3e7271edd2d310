"""The claims of fsa-varlen-descriptors: the H200 records, the library under the interpreter, its source."""

from __future__ import annotations

import math

import torch

from varlen_workbench.postmortems.fsa_varlen_descriptors.cases import (
    AUDIT,
    BACKWARD_SOURCE,
    CASES,
    EMPTY,
    EMPTY_CHECK,
    FORWARD_SOURCE,
    FSA_SOURCE,
    FUNCTIONS,
    ILLEGAL_INSTRUCTION,
    MISALIGNED,
    MISALIGNED_CHECKS,
    NAMED,
    NO_QUERY,
    NO_QUERY_CHECK,
    PREPROCESS_FILE,
    PREPROCESS_LAUNCH,
    SANITIZER_FIRST_SITE,
    TAIL_ALLOCATIONS,
    TAIL_CASES,
)
from varlen_workbench.postmortems.fsa_varlen_descriptors.study import (
    ALIGNED,
    BARE,
    NO_EMPTY,
    REAL_ROWS,
    FsaDescriptorResults,
    misaligned_lse_bases,
    preprocess_source,
    varlen_allocations,
)
from varlen_workbench.postmortems.fsa_varlen_descriptors.upstream import TILE_M
from varlen_workbench.workbench.layout import Region, pack
from varlen_workbench.workbench.postmortem import UPSTREAM_CPU, UPSTREAM_GPU, Claims, source_at

claims = Claims()

PREPROCESS = ("_bwd_preprocess_kernel", "ops/triton/flash_bwd_preprocess.py")


def _verdicts(results: FsaDescriptorResults, row: str) -> dict[str, tuple[str, str]]:
    return {c["name"]: (c["verdict"], c["evidence"]) for c in results.audits[row]["checks"]}


@claims(
    "On the H200 (flash-sparse-attn 2.0.6, each check in a fresh process), both varlen functions raise 'misaligned "
    "address' in 8 checks (real-accuracy, tail-rows, padding-leak, custom-scale, fully-masked-rows, causal-unequal, "
    "gqa, determinism) and 'illegal instruction' in empty-sequences: no check that calls them passes",
    evidence=UPSTREAM_GPU,
    headline=True,
)
def _h200_audit(r: FsaDescriptorResults):
    parts, ok = [], True
    for row, record in r.audits.items():
        verdicts = _verdicts(r, row)
        misaligned = [c for c in MISALIGNED_CHECKS if verdicts[c][0] == "FAIL" and MISALIGNED in verdicts[c][1]]
        illegal = verdicts[EMPTY_CHECK][0] == "FAIL" and ILLEGAL_INSTRUCTION in verdicts[EMPTY_CHECK][1]
        passed = [name for name, (verdict, _) in verdicts.items() if verdict == "pass"]
        ok &= len(misaligned) == len(MISALIGNED_CHECKS) and illegal and not passed and "H200" in record["provenance"]["device"]
        parts.append(
            f"{row}: {len(misaligned)} misaligned address, empty-sequences illegal instruction {illegal}, passed {passed}"
        )
    return ok, "; ".join(parts)


@claims(
    "Every one of those 8 checks made a first call whose lse bases are not all 16-byte aligned, and the "
    "empty-sequences check's first call has empty sequences",
    evidence=UPSTREAM_CPU,
)
def _first_calls(r: FsaDescriptorResults):
    misaligned = {c: f"{r.first_calls[c]['misaligned']}/{r.first_calls[c]['bases']}" for c in MISALIGNED_CHECKS}
    ok = all(r.first_calls[c]["misaligned"] > 0 for c in MISALIGNED_CHECKS) and r.first_calls[EMPTY_CHECK]["empty"] > 0
    empty = r.first_calls[EMPTY_CHECK]
    return ok, f"misaligned bases {misaligned}; {EMPTY_CHECK}: {empty['layout']}, {empty['empty']} empty sequences"


@claims(
    "Run alone on the H200 with CUDA_LAUNCH_BLOCKING=1, each call in its own process, both functions' audit call "
    "(q [18, 2, 64], cu_seqlens_q [0, 5, 8, 15]) and the same call without its TAIL rows reach the backward and raise "
    "'misaligned address' at the launch of the backward preprocess kernel (flash_bwd_preprocess.py:227); the lse "
    "bases off a 16-byte boundary (by 4, 8 or 12 bytes) are exactly those LSE + h * rows + cu_seqlens_q[b] predicts; "
    "the call whose starts and row count are multiples of 4 (cu_seqlens_q [0, 8, 12, 24]) completes",
    evidence=UPSTREAM_GPU,
)
def _faulting_kernel(r: FsaDescriptorResults):
    record, parts, ok = r.misaligned_h200, [], "H200" in r.misaligned_h200["provenance"]["device"]
    for call in record["results"]:
        (launch,) = call["preprocess_lse_bases"]
        bad = {program: m for program, m in launch["base_mod16"].items() if m}
        cu = torch.tensor(call["cu_seqlens_q"])
        predicted = {f"b{b} h{h}" for b, h in misaligned_lse_bases(cu, call["q_shape"][0], call["q_shape"][1])}
        if predicted:  # faults at the preprocess kernel's own launch, where the arithmetic says
            ok &= call["stage"] == "backward" and MISALIGNED in call["error"] and PREPROCESS_LAUNCH in call["library_frames"]
            ok &= set(bad) == predicted and set(bad.values()) <= {4, 8, 12}
            parts.append(
                f"{call['function']} {call['case']}: {len(bad)} of {len(launch['base_mod16'])} bases off, raised at {PREPROCESS_LAUNCH.split()[0]}"
            )
        else:
            ok &= call["stage"] == "done" and not bad and launch["synchronize_after_it"] == "ok"
            parts.append(f"{call['function']} {call['case']}: done")
    ok &= len(parts) == 6
    return ok, "; ".join(parts)


@claims(
    "The no-real-query call (q=[0, 0], k=[3, 2], 2 TAIL query rows, finite garbage in the padding) is the one call that "
    "returns on the H200: both functions give every value of out's and dq's 2 TAIL rows non-finite, in NaN-poisoned "
    "memory",
    evidence=UPSTREAM_GPU,
)
def _no_real_query_on_h200(r: FsaDescriptorResults):
    values = NO_QUERY.tail_q * NO_QUERY.heads * NO_QUERY.head_dim
    expected = f"out: {values} non-finite values in {NO_QUERY.tail_q} TAIL rows; dq: {values} non-finite values in {NO_QUERY.tail_q} TAIL rows"
    ok, parts = r.first_calls[NO_QUERY_CHECK]["case"] == NO_QUERY, []
    for row in r.audits:
        verdict, evidence = _verdicts(r, row)[NO_QUERY_CHECK]
        ok &= verdict == "FAIL" and evidence.endswith(expected) and "raised" not in evidence
        parts.append(f"{row}: {verdict}: {evidence}")
    return ok, "; ".join(parts)


@claims(
    "Under the interpreter, in NaN-poisoned memory, both functions leave out's and dq's TAIL rows NaN, every value: the "
    "no-real-query call gives the H200's counts exactly, and builds no lse descriptor (its backward preprocess kernel "
    "runs no program: max_seqlen_q is 0); dk's and dv's TAIL rows are 0, and REAL rows are within the bound",
    evidence=UPSTREAM_CPU,
)
def _tail_rows_unwritten(r: FsaDescriptorResults):
    parts, ok = [], True
    for function in FUNCTIONS:
        for case in TAIL_CASES:
            call = r.call(function, BARE, case, poisoned=True)
            bad, values = call.probe.nonfinite, case.tail_q * case.heads * case.head_dim
            ok &= bad["out"]["TAIL"] == bad["dq"]["TAIL"] == values and call.probe.real_within_bound
            ok &= all(call.probe.max_abs[n]["TAIL"] == 0 for n in ("dk", "dv"))
            if case == NO_QUERY:
                ok &= not any(d["kernel"] == PREPROCESS[0] for d in call.descriptors)
            if function == FUNCTIONS[0]:
                parts.append(f"{case.label()}: out {bad['out']['TAIL']}, dq {bad['dq']['TAIL']} of {values} TAIL values NaN")
    return ok, "; ".join(parts) + " (both functions)"


@claims(
    "Upstream source: the varlen forward allocates out with torch.empty_like(query) (flash_dense_fwd.py:876, "
    "flash_sparse_fwd.py:886 in the 2.0.6 wheel); flash_dense_fwd.py's varlen forward does the same at this commit",
    evidence=source_at(FORWARD_SOURCE),
)
def _out_allocation(r: FsaDescriptorResults):
    return _allocations("out")


@claims(
    "Upstream source: the varlen backward allocates dq with torch.empty_like(query) (flash_dense_bwd.py:854, "
    "flash_sparse_bwd.py:871 in the 2.0.6 wheel); flash_dense_bwd.py's varlen backward does the same at this commit",
    evidence=source_at(BACKWARD_SOURCE),
)
def _dq_allocation(r: FsaDescriptorResults):
    return _allocations("dq")


def _allocations(name: str) -> tuple[bool, str]:
    """Whether the wheel assigns `name` from torch.empty_like(query) at each line TAIL_ALLOCATIONS names."""
    parts, ok = [], True
    for file, (assigned, line) in TAIL_ALLOCATIONS.items():
        if assigned == name:
            function, text = varlen_allocations(file).get(line, ("", ""))
            ok &= text.startswith(f"{name} = ")
            parts.append(f"{file.rsplit('/', 1)[-1]}:{line} in {function or '?'}: {text or 'absent'}")
    return ok, "; ".join(parts)


@claims(
    "Workaround (c), the call on the rows up to cu_seqlens[-1] with its output padded with zeros, and workaround (b), "
    "in NaN-poisoned memory: out, dq, dk and dv exactly 0 on every TAIL row, REAL rows within the bound; (c) keeps the "
    "misaligned lse bases of the audit's call, (b) leaves none",
    evidence=UPSTREAM_CPU,
)
def _tail_workarounds(r: FsaDescriptorResults):
    parts, ok = [], True
    for variant in (REAL_ROWS, ALIGNED):
        fixed = [r.call(f, variant, c, poisoned=True) for f in FUNCTIONS for c in TAIL_CASES]
        ok &= all(c.probe.padding_exactly_zero and c.probe.real_within_bound for c in fixed)
        misaligned = r.call(FUNCTIONS[0], variant, AUDIT, poisoned=True).misaligned
        ok &= (misaligned > 0) == (variant == REAL_ROWS)
        parts.append(f"{variant}: {len(fixed)} calls, TAIL rows exactly 0; audit call's lse bases misaligned {misaligned}")
    return ok, "; ".join(parts)


@claims(
    f"compute-sanitizer memcheck on the H200 reports, first, an illegal instruction in each function's forward at "
    f"{SANITIZER_FIRST_SITE}, its Q descriptor load",
    evidence=UPSTREAM_GPU,
)
def _sanitizer(r: FsaDescriptorResults):
    firsts = {row: record["tools"]["memcheck"]["first"] for row, record in r.sanitizers.items()}
    ok = all(f.startswith("Illegal instruction") and "_fwd_" in f and f.endswith(SANITIZER_FIRST_SITE) for f in firsts.values())
    return ok, "; ".join(f"{row}: {first}" for row, first in firsts.items())


@claims(
    "Under the interpreter, each replayed call's only descriptor that breaks Triton's 16-byte rule is the backward "
    "preprocess kernel's lse descriptor, in exactly the programs whose base LSE + h * rows + cu_seqlens_q[b] is not a "
    "multiple of 4 floats",
    evidence=UPSTREAM_CPU,
)
def _lse_only(r: FsaDescriptorResults):
    parts, ok = [], True
    for call in (c for c in r.calls if c.variant == BARE):
        batch = pack(call.case, "cpu")
        blocks = math.ceil(max(call.case.seqlens_q) / TILE_M)  # the preprocess grid: m blocks x sequences x heads
        predicted = blocks * len(misaligned_lse_bases(batch.cu_seqlens_q, batch.q.shape[0], call.case.heads))
        ok &= call.violations() == {PREPROCESS} and call.misaligned == predicted > 0
        if call.function == FUNCTIONS[0]:
            parts.append(f"{call.case.label()}: {call.misaligned} (predicted {predicted})")
    return ok, "; ".join(parts) + " (both functions)"


@claims(
    "Under the interpreter, only the call with empty sequences builds descriptors over no element: its forward "
    "stores each empty sequence's output through one, and its backward's kernels build more",
    evidence=UPSTREAM_CPU,
)
def _zero_extent(r: FsaDescriptorResults):
    bare = [c for c in r.calls if c.variant == BARE]
    empty = [c for c in bare if c.case == EMPTY]
    forward = [d for c in empty for d in c.descriptors if d["kernel"].startswith("_fwd") and d.get("zero_extent")]
    others = sum(c.zero_extent for c in bare if c.case != EMPTY)
    ok = others == 0 and all(c.zero_extent > 0 for c in empty) and len(forward) == len(empty)
    ok &= all(d["zero_extent_accesses"] > 0 for d in forward)
    sites = sorted({d["site"] for d in forward})
    return ok, f"{EMPTY.label()}: {[c.zero_extent for c in empty]} programs, forward at {sites}; the other calls: {others}"


@claims(
    "Upstream source: the backward preprocess kernel bases lse's descriptor on the unpadded layout "
    "(USE_PADDED=False: LSE + h * total_q + cu_seqlens_q[b]) while dPsum's and lse_log2's use the padded one, "
    "whose per-sequence offsets are multiples of the tile; the 2.0.6 wheel has the same lines",
    evidence=source_at(FSA_SOURCE),
)
def _source(r: FsaDescriptorResults):
    bases = preprocess_source()
    ok = bases == {"lse_base": False, "dpsum_base": True, "lse_log2_base": True}
    return ok, f"{PREPROCESS_FILE} in the wheel, USE_PADDED per base: {bases}"


@claims(
    "Workaround (a), empty sequences dropped from cu_seqlens before the call and their rows returned as 0, builds no "
    "descriptor over no element, and gives REAL rows exactly the outputs and gradients of the call with them",
    evidence=UPSTREAM_CPU,
)
def _no_empty(r: FsaDescriptorResults):
    parts, ok = [], True
    for function in FUNCTIONS:
        bare, fixed = r.call(function, BARE, EMPTY), r.call(function, NO_EMPTY, EMPTY)
        same = all(_real_equal(bare.probe, fixed.probe, name) for name in ("out", "dq", "dk", "dv"))
        ok &= fixed.zero_extent == 0 and same and fixed.probe.real_within_bound
        parts.append(f"{function}: extent-0 descriptors {bare.zero_extent} -> {fixed.zero_extent}, REAL rows identical {same}")
    return ok, "; ".join(parts)


@claims(
    "Workaround (b), each sequence's queries padded to a multiple of 4 with dummy rows at its start (and empty "
    "sequences dropped), leaves no misaligned descriptor and none over no element in any call, causal ones "
    "included, and keeps out, dq, dk and dv on REAL rows within the bound set by PyTorch's own float16 error",
    evidence=UPSTREAM_CPU,
)
def _aligned(r: FsaDescriptorResults):
    fixed = [c for c in r.calls if c.variant == ALIGNED]
    ok = len(fixed) == 2 * len(CASES) and all(c.misaligned == c.zero_extent == 0 and not c.violations() for c in fixed)
    ok &= all(c.probe.real_within_bound for c in fixed)
    worst = max(e.ratio for c in fixed for e in c.probe.errors.values())
    return (
        ok,
        f"{len(fixed)} calls: misaligned {sum(c.misaligned for c in fixed)}, extent 0 {sum(c.zero_extent for c in fixed)}, worst error {worst:.2f}x fp16's",
    )


@claims(
    "Workaround (b) on the H200 (flash-sparse-attn 2.0.6) runs the four calls replayed here through both functions "
    "without a fault: each reaches its end with REAL rows within the bound set by PyTorch's own float16 error and "
    "padding rows exactly 0",
    evidence=UPSTREAM_GPU,
)
def _aligned_on_h200(r: FsaDescriptorResults):
    record = r.workaround_h200
    calls = {(c["function"], c["case"]): c for c in record["results"]}
    wanted = [(f, f"workaround:{name}") for f in FUNCTIONS for name in NAMED]
    ran = [calls[w] for w in wanted if w in calls]
    ok = len(ran) == len(wanted) and "H200" in record["provenance"]["device"]
    ok &= all(c["stage"] == "done" and c["real_within_bound"] and c["padding_exactly_zero"] for c in ran)
    worst = max((e for c in ran for e in c["error_over_fp16s"].values()), default=math.nan)
    return (
        ok,
        f"{len(ran)} of {len(wanted)} calls reached their end ({record['provenance']['commit']}); worst error {worst:.2f}x fp16's",
    )


def _real_equal(a, b, name: str) -> bool:
    """The two probes' `name` equal on REAL rows, bit for bit."""
    real = a.regions(name) == Region.REAL
    return bool((a.tensors[name][real] == b.tensors[name][real]).all())
