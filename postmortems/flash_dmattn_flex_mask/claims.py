"""The claims of flash-dmattn-flex-mask, checked on reproduce()'s results and the GPU records."""

from __future__ import annotations

import re
from typing import Any

import torch

from varlen_workbench.postmortems.flash_dmattn_flex_mask.cases import AUDITED, GPU_COMMAND, IMPLS, META, STUDY
from varlen_workbench.postmortems.flash_dmattn_flex_mask.study import PADDING_SET, Results, _predicted_rows, gpu_error_range
from varlen_workbench.postmortems.flash_dmattn_flex_mask.upstream import SOURCE
from varlen_workbench.workbench.postmortem import (
    OURS,
    UPSTREAM_CPU,
    UPSTREAM_GPU,
    Claims,
    NotRecorded,
    recorded_probes,
)
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import read_record

claims = Claims()


@claims(
    "in flash-dmattn 1.2.2's flex_attention_forward, attn_mask is read only to be sliced; the only mask_mod returns q_idx >= kv_idx, "
    "passed to flex_attention only when is_causal, and is_causal=None becomes True",
    evidence=SOURCE,
)
def _source_reads(r: Results):
    s = r.source
    holds = (
        not s["attn_mask_uses"]
        and s["mask_mods"] == {"causal_mask_mod": "q_idx >= kv_idx"}
        and s["block_mask_passed_as"] == "block_mask if is_causal else None"
        and s["causal_default"] == "is_causal = True"
    )
    return holds, (
        f"attn_mask read on lines {s['attn_mask_reads']} (its None test and its slice), used nowhere else; "
        f"the intended line commented out: {s['commented_out']}; "
        f"mask_mods {s['mask_mods']}; block_mask={s['block_mask_passed_as']}; {s['causal_default']} when None"
    )


@claims("attn_bias is honoured: the score_mod adds attn_bias[b][h][q_idx][kv_idx] to every score", evidence=SOURCE)
def _source_bias(r: Results):
    mods = r.source["score_mods"]
    return mods == {"score_mod": "score + attn_bias[batch_idx][head_idx][q_idx][kv_idx]"}, f"score_mods {mods}"


@claims(
    "attn_mask changes no bit of the output: padding, all-ones, all-zeros and upstream's own top-k mask give identical outputs",
    evidence=UPSTREAM_CPU,
)
def _bitwise(r: Results):
    rows = r.mask_effect["rows"]
    holds = len(rows) == 4 and all(x["identical to all-ones"] for x in rows)
    return holds, "; ".join(f"{x['mask']} ({x['kept keys']} keys kept): identical {x['identical to all-ones']}" for x in rows) + (
        f"; {r.mask_effect['error']}" if r.mask_effect["error"] else ""
    )


@claims(
    "the weights it applies, measured through its output, put weight on every padded key: softmax over all keys, the mask ignored",
    evidence=UPSTREAM_CPU,
)
def _weights(r: Results):
    w, mask = r.weights["weights"], r.weights["mask"]
    lens = STUDY.real_lengths("q")
    real_rows = torch.zeros_like(mask)
    for b, n in enumerate(lens):
        real_rows[b, :n] = True
    on_padded = w[real_rows & ~mask]
    fixed = r.weights["weights with the bias workaround"][real_rows & ~mask]
    holds = bool((on_padded > 0).all()) and bool((fixed == 0).all())
    return holds, (
        f"{on_padded.numel()} (real row, padded key) pairs: weight min {float(on_padded.min()):.3g}, "
        f"total per row up to {float((w * (real_rows & ~mask)).sum(-1).max()):.2f}; with (a) all exactly 0"
    )


@claims("is_causal=None is bitwise is_causal=True (top-left causal), not False", evidence=UPSTREAM_CPU)
def _causal(r: Results):
    c = r.causal
    return c["None == True (bitwise)"] and not c["None == False (bitwise)"] and c[
        "True is top-left causal (fp32 vs fp64 < 1e-5)"
    ], str(c)


@claims(
    "grouped K/V (the docs' 'GQA Support' for Flex) raise: flex_attention is called without enable_gqa",
    evidence=UPSTREAM_CPU,
)
def _gqa(r: Results):
    return r.gqa.startswith("ValueError") and "enable_gqa" in r.gqa, r.gqa


@claims(
    "every failing case of the H200 audit fails here too, finite, its out error over 20 times PyTorch's own in fp16/bf16",
    evidence=UPSTREAM_CPU,
)
def _cases_fail(r: Results):
    runs = r.runs[IMPLS[0]].values()
    holds = all(not x.within and x.finite and x.ratios["out"] > 20 for x in runs)
    return holds, ", ".join(f"{x.check} {x.ratios['out']:.3g}x" for x in runs)


@claims(
    "exactly the predicted real rows come out right, in every audited case: those whose mask row is all True (nothing to drop), "
    "and those of a sequence with no key (all weight on zero-filled padding: 0, by accident)",
    evidence=UPSTREAM_CPU,
)
def _rule(r: Results):
    runs = r.runs[IMPLS[0]].values()
    exact = [x.check for x in runs if x.rows_right == x.rows_predicted]
    right = sum(sum(x.rows_right) for x in runs)
    total = sum(len(x.rows_right) for x in runs)
    return len(exact) == len(AUDITED), f"{len(exact)}/{len(AUDITED)} cases exact; {right} of {total} real rows right"


@claims(
    "the CPU forward reproduces the H200 record: same first failing case per check, out error within 10% of the recorded ratio",
    evidence=UPSTREAM_GPU,
)
def _matches_gpu(r: Results):
    parts, good = [], 0
    for check, (case, _) in AUDITED.items():
        rec = r.recorded.get(check)
        run = r.run(IMPLS[0], check)
        ok = rec is not None and rec["case"] == case and abs(run.ratios["out"] / rec["ratios"]["out"] - 1) < 0.10
        good += ok
        parts.append(f"{check}: here {run.ratios['out']:.3g}x, H200 {rec['ratios']['out'] if rec else '-'}x")
    return good == len(AUDITED), "; ".join(parts)


@claims(
    "on the H200 (fp16/bf16, compiled): every failing check on zero or random padding is finite and wrong in out, dq, "
    "dk and dv, each over 20 times PyTorch's own error; most fuzzed layouts fail",
    evidence=UPSTREAM_GPU,
    headline=True,
)
def _gpu_record(r: Results):
    wrong = {k: v for k, v in r.recorded.items() if k not in PADDING_SET}
    holds = all(
        not v["nonfinite"] and set(v["ratios"]) == {"out", "dq", "dk", "dv"} and min(v["ratios"].values()) > 20
        for v in wrong.values()
    )
    fuzz = r.audit["fuzz"]
    holds = holds and 2 * fuzz["failing_layouts"] > fuzz["tried"]
    lo, hi = gpu_error_range(r.recorded)
    prov = r.audit["provenance"]
    return holds, (
        f"{r.audit['file']} ({prov['device']}, torch {prov['torch']}, {prov['date']}): {len(wrong)} failing checks, "
        f"ratios {lo:.3g}-{hi:.3g}x, none non-finite; fuzzer {fuzz['failing_layouts']}/{fuzz['tried']} layouts failing"
    )


@claims(
    "sliding-window on the H200 (the window given as attn_mask, huge garbage values in the padding): the ignored mask lets "
    "the garbage in, so out is off by over 1200x PyTorch's own error or turns non-finite",
    evidence=UPSTREAM_GPU,
)
def _gpu_window(r: Results):
    window = r.recorded.get("sliding-window")
    if window is None:
        return False, f"{r.audit['file']}: no sliding-window FAIL recorded"
    holds = window["nonfinite"] or window["ratios"].get("out", 0) > 1200
    return holds, window["evidence"]


@claims(
    "padding-leak on the H200 (NaN in the padding): the non-finite values in out, dq, dk and dv are exactly the rows the rule "
    "predicts wrong (the padded sequences' real rows) x heads x head dim",
    evidence=UPSTREAM_GPU,
)
def _gpu_leak(r: Results):
    leak = r.recorded["padding-leak"]
    case = leak["case"]
    wrong = _predicted_rows(case).count(False)
    predicted = wrong * case.heads * case.head_dim
    counts = dict(re.findall(r"(\w+): (\d+) non-finite REAL values", leak["evidence"]))
    holds = set(counts) == {"out", "dq", "dk", "dv"} and all(int(n) == predicted for n in counts.values())
    return (
        holds,
        f"{case.label()} ({case.fill.value} padding): recorded {counts}; predicted {wrong} rows x {case.heads} x {case.head_dim} = {predicted}",
    )


@claims(
    "flash-sparse-attn 2.0.6 keeps the same function (deprecated/flash_sparse_attn_flex.py): identical AST, bit-identical output",
    evidence=UPSTREAM_CPU,
)
def _successor(r: Results):
    same_ast = r.source["forward_ast"] == r.successor_source["forward_ast"]
    return same_ast and r.successor_identical_output, (
        f"flex_attention_forward AST identical {same_ast}; output on the study batch bit-identical {r.successor_identical_output}"
    )


def _workaround_holds(r: Results, impl: str) -> tuple[bool, str]:
    """Every audited case within the bound and finite through `impl`, and the worst error ratio."""
    runs = r.runs[impl].values()
    worst = max(max(x.ratios.values()) for x in runs)
    return all(
        x.within and x.finite for x in runs
    ), f"{sum(x.within for x in runs)}/{len(runs)} cases; worst {worst:.2f}x PyTorch's error"


@claims(
    "workaround (a), the mask as a -inf attn_bias of the same function: forward within the bound on every audited case, fully masked rows included",
    evidence=UPSTREAM_CPU,
)
def _bias_workaround(r: Results):
    return _workaround_holds(r, IMPLS[1])


@claims(
    "workaround (b), torch's flex_attention with a mask_mod reading the mask: forward within the bound on every audited case",
    evidence=UPSTREAM_CPU,
)
def _flex_workaround(r: Results):
    return _workaround_holds(r, IMPLS[2])


@claims(
    "torch's own flex_attention with a document BlockMask passed real-accuracy on the H200 (the audit's flex-document row)",
    evidence=UPSTREAM_GPU,
)
def _flex_document(r: Results):
    path = GPU_DATA / "audit-flex-document.json"
    record = read_record(path, how="python scripts/gpu_audit_matrix.py --rows flex-document")
    verdict = next(c["verdict"] for c in record["checks"] if c["name"] == "real-accuracy")
    return (
        verdict == "pass",
        f"{path.name}: real-accuracy {verdict} ({record['provenance']['device']}, torch {record['provenance']['torch']})",
    )


@claims("our varlen_attention on the study case: real rows within the bound, forward and backward", evidence=OURS)
def _ours(r: Results):
    run = r.run(IMPLS[3], "real-accuracy")
    return run.within and run.finite, f"worst {max(run.ratios.values()):.2f}x PyTorch's error over {sorted(run.ratios)}"


def _probes(r: Results) -> dict[str, Any]:
    """gpu_probes' measurements in the latest GPU record; a record without them (one made when
    `varlen-workbench repro` found no gpu_probes to call) leaves these claims NOT RECORDED, with the command."""
    probes = recorded_probes(r.gpu, META)
    if not probes:
        raise NotRecorded(
            f"{(r.gpu or {}).get('file')} ({(r.gpu or {})['provenance']['date']}) re-ran the study on the GPU, forward "
            f"only, and holds no gradients: not yet measured on a GPU; `{GPU_COMMAND}` records them"
        )
    return probes


def _gpu_study(r: Results) -> dict[str, Any]:
    """The results of `reproduce()` as the latest GPU record ran it on its GPU (compiled FlexAttention)."""
    recorded_probes(r.gpu, META)  # NotRecorded, naming the command that makes one, when there is no record
    record = r.gpu or {}
    if record["results"]["device"] != "cuda":
        raise NotRecorded(f"{record['file']} was not made on a GPU")
    return record["results"]


def _covered(runs: list[dict[str, Any]]) -> bool:
    """Every audited case has at least one run (a run's time limit may skip later seeds and dtypes)."""
    return {x["check"] for x in runs} == set(AUDITED)


def _skipped(probes: dict[str, Any]) -> str:
    """Which probes the GPU run left out at its time limit (the later seeds and dtypes), said plainly."""
    return f"{len(probes['skipped'])} probes left out at the run's time limit" if probes["skipped"] else "every probe ran"


def _gpu_as_is(r: Results) -> tuple[bool, str]:
    probes = _probes(r)
    runs = [x for x in probes["runs"] if x["impl"] == IMPLS[0]]
    bad = [x for x in runs if "error" in x or x["within"] or not x["finite"]]
    holds = probes["backward"] and _covered(runs) and not bad
    return (
        holds,
        f"{len(runs) - len(bad)}/{len(runs)} runs finite and over the bound; {_skipped(probes)}",
    )


def _gpu_workarounds(r: Results) -> tuple[bool, str]:
    probes = _probes(r)
    parts, good = [], bool(probes["backward"])
    for impl in IMPLS[1:3]:
        runs = [x for x in probes["runs"] if x["impl"] == impl]
        ok = [x for x in runs if "error" not in x and x["within"] and x["finite"]]
        good = good and _covered(runs) and len(ok) == len(runs)
        worst = max((max(x["ratios"].values()) for x in ok), default=float("nan"))
        parts.append(f"{impl}: {len(ok)}/{len(runs)} within (worst {worst:.2f}x)")
    return good, "; ".join(parts) + f"; {_skipped(probes)}"


def _gpu_bitwise(r: Results) -> tuple[bool, str]:
    rows = _gpu_study(r)["mask_effect"]["rows"]
    same = sum(x["identical to all-ones"] for x in rows)
    p = (r.gpu or {})["provenance"]
    return len(rows) == 4 and same == 4, (
        f"{same}/{len(rows)} masks give the all-ones output bit for bit ({r.gpu and r.gpu['file']}: the study re-run on "
        f"{p['device']}, torch {p['torch']}, {p['date']})"
    )


def _gpu_forward(r: Results) -> tuple[bool, str]:
    runs = _gpu_study(r)["runs"]
    as_is = runs[IMPLS[0]].values()
    fixed = [x for impl in IMPLS[1:3] for x in runs[impl].values()]
    holds = set(runs[IMPLS[0]]) == set(AUDITED) and all(set(runs[i]) == set(AUDITED) for i in IMPLS[1:3])
    holds &= all(x["finite"] and not x["within"] for x in as_is) and all(x["finite"] and x["within"] for x in fixed)
    return holds, (
        f"as is: {sum(not x['within'] for x in as_is)}/{len(as_is)} cases over the bound (out "
        f"{min(x['ratios']['out'] for x in as_is):.3g}-{max(x['ratios']['out'] for x in as_is):.3g}x PyTorch's error); "
        f"(a) and (b): {sum(x['within'] for x in fixed)}/{len(fixed)} within (worst "
        f"{max(x['ratios']['out'] for x in fixed):.2f}x)"
    )


GPU_CLAIMS = (
    ("on the GPU, compiled: attn_mask changes no bit of the output (the four masks)", _gpu_bitwise),
    (
        "on the GPU, compiled, forward: every audited case as is finite and over the bound; workarounds (a) and (b) "
        "within it in every case",
        _gpu_forward,
    ),
    (
        "on the GPU, forward and backward, every audited case (fp16/bf16, the seeds the record holds): as is, finite and over the bound",
        _gpu_as_is,
    ),
    (
        "on the GPU, forward and backward, every audited case: workarounds (a) and (b) within the bound in every run",
        _gpu_workarounds,
    ),
)

for statement, check in GPU_CLAIMS:
    claims(statement, evidence=UPSTREAM_GPU)(check)
