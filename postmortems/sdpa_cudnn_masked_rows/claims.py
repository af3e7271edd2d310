"""The claims of sdpa-cudnn-masked-rows, checked on reproduce()'s results and the H200 records."""

from __future__ import annotations

import torch

from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.cases import CASES, CHECK_OF, FULLY, META, RECORD_TOLERANCE, TENSORS
from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.study import (
    MaskedRowsResults,
    keyless_rows,
    keyless_rows_beside_keys,
    keys_of_keyless_sequences,
)
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.postmortem import (
    OURS,
    REPLICA,
    UPSTREAM_CPU,
    UPSTREAM_GPU,
    Claims,
    recorded_probes,
)

claims = Claims()


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RECORD_TOLERANCE * abs(b)


@claims(
    "On the H200 (torch 2.11.0+cu130, fp16), the cuDNN backend fails fully-masked-rows and causal-unequal with REAL-row "
    "errors hundreds of times torch's own, while the math and memory-efficient backends pass both on the same calls",
    evidence=UPSTREAM_GPU,
    headline=True,
)
def _recorded(r: MaskedRowsResults):
    parts, ok = [], True
    for case in CASES:
        rec = r.recorded[case.label()]
        cud = rec["sdpa-cudnn"]
        worst = min(e[2] for e in cud["errors"].values()) if cud["errors"] else 0.0
        ok &= cud["verdict"] == "FAIL" and set(cud["errors"]) == set(TENSORS) and worst > 100
        ok &= rec["sdpa-math"]["verdict"] == "pass" and rec["sdpa-efficient"]["verdict"] == "pass"
        ok &= cud["case"]["seqlens_q"] == list(case.seqlens_q) and cud["case"]["seqlens_k"] == list(case.seqlens_k)
        parts.append(
            f"{CHECK_OF[case]}: cuDNN {cud['verdict']} (all four tensors >= {worst:.0f}x), math "
            f"{rec['sdpa-math']['verdict']}, efficient {rec['sdpa-efficient']['verdict']}"
        )
    return ok and "H200" in r.provenance[
        "device"
    ], f"{'; '.join(parts)} ({r.provenance['date']}, commit {r.provenance['commit']})"


@claims(
    "With no backend asked for, SDPA ran cuDNN, forward and backward, for every masked call measured on the H200: "
    "boolean and additive float masks, GQA, fp16 and bf16 (and is_causal without a mask too)",
    evidence=UPSTREAM_GPU,
)
def _default_backend(r: MaskedRowsResults):
    parts, ok = [], bool(r.default_backend)
    for rec in r.default_backend:
        settings = rec["settings"]
        ran = {(s["forward"], s["backward"], s["dispatcher_choice"]) for s in settings}
        masks = {s["mask"] for s in settings}
        ok &= ran == {("CUDNN_ATTENTION",) * 3} and "H200" in rec.get("gpu", "")
        ok &= {"bool", "float"} <= masks and any(s["kv_heads"] != s["heads"] for s in settings)
        ok &= {"float16", "bfloat16"} <= {s["dtype"] for s in settings}
        ok &= all(any("cudnn" in k for k in s["kernels"]) for s in settings)
        p = rec["provenance"]
        parts.append(
            f"{rec['file']}: {len(settings)} calls ({' / '.join(s['name'] for s in settings)}), ran "
            f"{' / '.join(sorted({s['forward'] for s in settings}))} (aten op and cuDNN kernels, forward and backward); "
            f"{rec.get('gpu')}, torch {rec['torch']}, cuDNN {rec['cudnn']}, {p['date']}"
        )
    return ok, "; ".join(parts)


@claims(
    "On the H200, SDPA unpinned gives the keyless rows the pinned cuDNN output; an additive mask of -65504 reproduces "
    "the boolean mask bit for bit, and one of -inf gives those rows 0 with every REAL-row error within 2x the "
    "memory-efficient backend's",
    evidence=UPSTREAM_GPU,
)
def _gpu_mechanism(r: MaskedRowsResults):
    points = recorded_probes(r.gpu, META)["points"]
    record = r.gpu or {}  # recorded_probes has raised NotRecorded when there is none
    by = {(p["layout"], p["dtype"], p["backend"], p["mask"]): p for p in points}
    ok, worst, n = True, 0.0, 0
    for layout, dtype in sorted({(p["layout"], p["dtype"]) for p in points}):
        default, cudnn = by[(layout, dtype, "default", "bool")], by[(layout, dtype, "CUDNN_ATTENTION", "bool")]
        fill, inf = by[(layout, dtype, "CUDNN_ATTENTION", "float -65504")], by[(layout, dtype, "CUDNN_ATTENTION", "float -inf")]
        eff = by[(layout, dtype, "EFFICIENT_ATTENTION", "bool")]
        ok &= default["default_choice"] == "CUDNN_ATTENTION" and default["keyless_out_max_abs"] == cudnn["keyless_out_max_abs"]
        ok &= cudnn["keyless_out_max_abs"] > 0.1 and fill["bitwise_equal_to_bool_mask"] is True
        ok &= inf["keyless_out_max_abs"] == 0.0 and inf["keyless_dq_max_abs"] == 0.0
        worst = max([worst] + [inf["real_errors"][t] / eff["real_errors"][t] for t in TENSORS])
        n += 1
    return ok and worst <= 2 and n > 0, (
        f"{n} layout/dtype points ({record['file']}, {record['provenance']['date']}); -inf mask's worst REAL-row error "
        f"/ memory-efficient's: {worst:.2f}"
    )


@claims(
    "The failing layouts are exactly the ones with a REAL query row that sees no key: an empty key sequence, and causal "
    "bottom-right rows with len_q > len_k",
    evidence=UPSTREAM_GPU,
)
def _layouts(r: MaskedRowsResults):
    counts = {CHECK_OF[c]: len(r.keyless[c.label()]) for c in CASES}
    # causal-unequal's first case (q=[5,3], k=[9,7]) has no keyless row and is not the FAIL evidence.
    first = Case((5, 3), seqlens_k=(9, 7), causal=True)
    named = all(r.recorded[c.label()]["sdpa-cudnn"]["evidence"].startswith(c.label()) for c in CASES)
    return all(counts.values()) and not keyless_rows(first) and named, (
        f"keyless REAL rows: {counts}; causal-unequal's passing first case q=[5,3] k=[9,7]: {len(keyless_rows(first))}"
    )


@claims(
    "torch's math backend gives every REAL row with no visible key exactly 0, and 0 gradient to its query",
    evidence=UPSTREAM_CPU,
)
def _math_zero(r: MaskedRowsResults):
    m = {c: r.mechanism[c.label()] for c in CASES}
    within = all(r.probes[c.label()]["math backend"].real_within_bound for c in CASES)
    ok = within and all(v["math_max_abs"] == 0.0 and v["math_dq_max_abs"] == 0.0 for v in m.values())
    return ok, f"torch {torch.__version__}: max |out|, |dq| on keyless rows " + ", ".join(
        f"{CHECK_OF[c]} {v['math_max_abs']:.3g}, {v['math_dq_max_abs']:.3g}" for c, v in m.items()
    ) + f"; REAL rows within the bound: {within}"


@claims(
    "SDPA given the additive mask torch builds for cuDNN (-65504 where the boolean mask is False) reproduces the "
    "recorded cuDNN errors of out, dq, dk and dv in both cases within 2%",
    evidence=REPLICA,
)
def _replica_matches(r: MaskedRowsResults):
    pairs = []
    for case in CASES:
        rec = r.recorded[case.label()]["sdpa-cudnn"]["errors"]
        rep = r.probes[case.label()]["cuDNN's mask on math (replica)"].errors
        pairs += [(f"{CHECK_OF[case]} {t}", rep[t].error, rec[t][0]) for t in TENSORS]
    worst = max(abs(a - b) / b for _, a, b in pairs)
    return all(_close(a, b) for _, a, b in pairs), f"8 errors, worst relative difference {worst:.2%}: " + ", ".join(
        f"{n} {a:.3g} vs {b:.3g}" for n, a, b in pairs[:2]
    ) + ", ..."


@claims(
    "In the replica a keyless row is unmasked attention over every key slot of its batch row, padding slots included "
    "(the softmax of scores all shifted by the same constant)",
    evidence=REPLICA,
)
def _mechanism(r: MaskedRowsResults):
    m = {CHECK_OF[c]: r.mechanism[c.label()] for c in CASES}
    ok = all(v["replica_vs_unmasked"] < 2e-3 and v["replica_max_abs"] > 0.1 for v in m.values())
    return ok, "; ".join(
        f"{n}: max |out| {v['replica_max_abs']:.3g}, max |out - unmasked| {v['replica_vs_unmasked']:.2g}" for n, v in m.items()
    )


@claims(
    "With zero padding the damage is confined and predictable: out and dq go wrong exactly on the keyless rows of "
    "sequences that have keys, dk and dv exactly on those keys; every other row stays within the bound",
    evidence=REPLICA,
)
def _damage(r: MaskedRowsResults):
    parts, ok = [], True
    for case in CASES:
        d = r.damaged[case.label()]["cuDNN's mask on math (replica)"]
        want_q, want_k = keyless_rows_beside_keys(case), keys_of_keyless_sequences(case)
        ok &= d["out"] == want_q and d["dq"] == want_q and d["dk"] == want_k and d["dv"] == want_k
        parts.append(f"{CHECK_OF[case]}: out/dq rows {d['out']}/{d['dq']}, dk/dv rows {d['dk']}/{d['dv']}")
    return ok, "; ".join(parts)


@claims(
    "With padding slots that hold a pad token's key and value instead of zeros, the replica returns exactly that pad "
    "token's value on every row of the empty key sequence; the math backend returns 0",
    evidence=REPLICA,
)
def _pad_token(r: MaskedRowsResults):
    p = r.pad_token
    ok = p["replica_max_abs"] > 0.1 and p["replica_vs_v_pad"] < 2e-3 and p["math_max_abs"] == 0.0
    return (
        ok,
        f"replica max |out| {p['replica_max_abs']:.3g}, max |out - v_pad| {p['replica_vs_v_pad']:.2g}; math max |out| {p['math_max_abs']:.3g}",
    )


@claims(
    "Workaround (a), zeroing rows with no visible key after the call, puts the replica within the bound on every REAL "
    "row of out, dq, dk and dv",
    evidence=REPLICA,
)
def _workaround_a(r: MaskedRowsResults):
    recs = {CHECK_OF[c]: r.probes[c.label()]["(a) replica + zero rows without key"] for c in CASES}
    return all(x.real_within_bound for x in recs.values()), "; ".join(
        f"{n}: worst {max(e.ratio for e in x.errors.values()):.2f}x torch's own error" for n, x in recs.items()
    )


@claims(
    "Workaround (c), dropping sequences with no key, removes only the empty-key rows: causal rows with len_q > len_k "
    "still see no key",
    evidence=UPSTREAM_CPU,
)
def _workaround_c(r: MaskedRowsResults):
    return r.dropped["after"] > 0 and r.dropped["after"] < r.dropped["before"], (
        f"{FULLY.label()}: {r.dropped['before']} keyless REAL rows, {r.dropped['after']} after dropping the empty key sequence"
    )


@claims(
    "The check-your-run lines flag the replica (non-zero output on rows without key) and pass torch's own CPU backends",
    evidence=UPSTREAM_CPU,
)
def _check_run(r: MaskedRowsResults):
    c = r.check_run
    ok = c["replica of cuDNN"]["max_abs_there"] > 0.1 and c["SDPA unpinned"]["max_abs_there"] == 0.0
    ok &= c["math backend"]["max_abs_there"] == 0.0
    return ok, "; ".join(f"{k}: {v['rows_without_key']} rows, max |out| {v['max_abs_there']:.3g}" for k, v in c.items())


@claims(
    "Our kernel gives every keyless row 0 and passes both layouts",
    evidence=OURS,
)
def _ours(r: MaskedRowsResults):
    recs = {c: r.probes[c.label()]["(d) our kernel"] for c in CASES}
    peaks = {CHECK_OF[c]: float(x.tensors["out"][r.keyless[c.label()]].abs().max()) for c, x in recs.items()}
    return all(x.real_within_bound for x in recs.values()) and not any(peaks.values()), f"max |out| on keyless rows {peaks}"


@claims(
    "The initcheck reports of the cuDNN row are reads by our adapter's gather of cuDNN's output, in a layout with "
    "no keyless REAL row (so not this bug); memcheck reports 0 errors",
    evidence=UPSTREAM_GPU,
)
def _sanitizer(r: MaskedRowsResults):
    s = r.sanitizer
    watched = Case((37, 0, 100, 64), seqlens_k=(40, 5, 100, 64), causal=True)
    ok = s["errors"].get("initcheck", 0) > 0 and s["errors"].get("memcheck") == 0
    ok &= s["printed_reports"] > 0 and all("bshd_to_thd" in f or "_back_to_thd" in f for f in s["first_frame_of_ours"])
    ok &= not keyless_rows(watched) and "q=[37, 0, 100, 64]" in s["program"]
    return ok, f"{s['errors']}; {s['printed_reports']} printed reports, our first frame: {s['first_frame_of_ours']}"


@claims(
    "The audit's sliding-window failure on cuDNN is the same mechanism: the replica, on the recorded case, reproduces "
    "the recorded out error within 2%, and the REAL rows beyond the bound are exactly the rows the window leaves "
    "without a key",
    evidence=REPLICA,
)
def _sliding_window(r: MaskedRowsResults):
    w = r.sliding_window
    close = abs(w["error"] - w["recorded"]) <= RECORD_TOLERANCE * w["recorded"]
    same = bool(w["wrong_rows"]) and w["wrong_rows"] == w["keyless_rows"]
    return close and same, (
        f"{w['case']}: replica error {w['error']:.3g}, recorded {w['recorded']:.3g}; {len(w['wrong_rows'])} rows "
        f"beyond the bound, {len(w['keyless_rows'])} rows without a key, the same rows: {same}"
    )
