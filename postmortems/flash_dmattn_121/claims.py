"""The claims of flash-dmattn-121, checked on reproduce()'s results and the GPU record."""

from __future__ import annotations

import torch

from varlen_workbench.postmortems.flash_dmattn_121.cases import (
    GPU_SEEDS,
    META,
    PADDED_PATTERNS,
    REPLICA_CASES,
    SEED,
    TENSORS,
    TRAIN_VARIANTS,
    UPSTREAM_CASES,
    UPSTREAM_TENSORS,
    recorded,
)
from varlen_workbench.postmortems.flash_dmattn_121.study import (
    Results,
    UpstreamRun,
    observed_upstream_nan_grad_items,
    observed_upstream_nan_rows,
    predict_upstream_nan_grad_items,
    predict_upstream_nan_rows,
)
from varlen_workbench.workbench.postmortem import (
    OURS,
    REPLICA,
    TOY,
    UPSTREAM_CPU,
    UPSTREAM_GPU,
    Claims,
    recorded_probes,
)

claims = Claims()

_AFFECTED = ("8 fully masked rows", "leading block masked, 16 rows", "left-padded batch (40), causal")

_WORKAROUNDS = ("workaround: right-padded, loss mask", "workaround: padding rows see themselves, loss mask")

_RAGGED = ("the report's config at Q=K=200 (not a multiple of 64)", "no mask, Q=K=100")


def _counts(result, names) -> str:
    return ", ".join(f"{n} {result.nonfinite(n)}" for n in names)


def _item_rows_nan(result: UpstreamRun, name: str, item: int) -> bool:
    """Every row of batch item `item` of gradient `name` holds NaN."""
    return bool((~torch.isfinite(result.tensors[name][item].float())).flatten(1).any(-1).all())


@claims(
    "the report's snippet does not run on 1.2.2: `scale=` is no parameter, and without a bias the backward raises",
    evidence=UPSTREAM_CPU,
)
def _snippet(r: Results):
    errors = r.call_errors
    holds = errors["the report's snippet as written"].startswith("TypeError") and errors[
        "softmax_scale, attn_bias=None"
    ].startswith("RuntimeError")
    return holds, " | ".join(errors.values())


@claims(
    "the report's configuration (1x256x1x64, causal, no mask) on 1.2.2: finite and within the oracle's bound, also under NaN-filled memory",
    evidence=UPSTREAM_CPU,
)
def _seed(r: Results):
    plain, poisoned = r.up(SEED), r.seed_poisoned
    holds = all(x.all_finite and x.all_within for x in (plain, poisoned))
    worst = max(x.error_ratio(n) for x in (plain, poisoned) for n in UPSTREAM_TENSORS)
    return (
        holds,
        f"{r.upstream_dtype}; non-finite: {_counts(plain, UPSTREAM_TENSORS)}; poisoned: {_counts(poisoned, UPSTREAM_TENSORS)}; worst {worst:.2f} x bound",
    )


@claims(
    "fully masked rows on 1.2.2: NaN output on those rows only, but NaN in every dK and dV row of the batch item",
    evidence=UPSTREAM_CPU,
)
def _affected(r: Results):
    parts, good = [], 0
    for name in _AFFECTED:
        run_ = r.upstream[name]
        rows_ok = torch.equal(observed_upstream_nan_rows(run_), predict_upstream_nan_rows(run_.case))
        item = 1 if run_.case.pattern in PADDED_PATTERNS else 0
        grads_ok = _item_rows_nan(run_, "dk", item) and _item_rows_nan(run_, "dv", item)
        good += rows_ok and grads_ok
        parts.append(f"{name}: out NaN rows {run_.nan_rows('out')}, dK/dV NaN rows {run_.nan_rows('dk')}/{run_.nan_rows('dv')}")
    return good == len(_AFFECTED), "; ".join(parts)


@claims(
    "at a length that is not a multiple of 64, even with no mask, 1.2.2 NaN-fills every dK and dV row while out and dQ stay finite",
    evidence=UPSTREAM_CPU,
)
def _ragged(r: Results):
    parts, good = [], 0
    for name in _RAGGED:
        x = r.upstream[name]
        ok = (
            x.finite("out") and x.finite("dq") and all(_item_rows_nan(x, g, i) for g in ("dk", "dv") for i in range(x.case.batch))
        )
        good += ok
        parts.append(f"{name}: non-finite {_counts(x, UPSTREAM_TENSORS)}")
    return good == len(_RAGGED), "; ".join(parts)


@claims("dV is never NaN without dK on 1.2.2 (the report has dK clean): every case and random mask", evidence=UPSTREAM_CPU)
def _dv_with_dk(r: Results):
    runs = list(r.upstream.values())
    alone = sum(x.nonfinite("dv") > 0 and x.finite("dk") for x in runs)
    alone += sum(p["dv_nonfinite_fraction"] > 0 and p["dk_nonfinite_fraction"] == 0 for p in r.sweep.records)
    with_dv = sum(x.nonfinite("dv") > 0 for x in runs) + sum(p["dv_nonfinite_fraction"] > 0 for p in r.sweep.records)
    return alone == 0 and with_dv > 0, f"{with_dv} runs with NaN dV (cases + sweep), {alone} of them with a finite dK"


@claims(
    "a loss mask does not help: left-padded batch with dO = 0 on padding rows, 1.2.2 still NaN in every dK/dV row of the item",
    evidence=UPSTREAM_CPU,
)
def _loss_mask(r: Results):
    masked = r.upstream["left-padded, loss mask on padding"]
    holds = _item_rows_nan(masked, "dk", 1) and _item_rows_nan(masked, "dv", 1)
    return holds, f"non-finite: {_counts(masked, UPSTREAM_TENSORS)}"


@claims(
    "workarounds on 1.2.2 (pad on the right; let each padding row see itself): finite and within the oracle's bound",
    evidence=UPSTREAM_CPU,
)
def _workarounds(r: Results):
    runs = [r.upstream[n] for n in _WORKAROUNDS]
    good = sum(x.all_finite and x.all_within for x in runs)
    worst = max(x.error_ratio(n) for x in runs for n in UPSTREAM_TENSORS)
    return good == len(runs), f"{good}/{len(runs)}; worst error {worst:.2f} x bound"


@claims(
    "the two rules predict 1.2.2 exactly: NaN output rows (no visible key among keys 0-63) and NaN-filled dK/dV items (such a row, or a length not a multiple of 64)",
    evidence=UPSTREAM_CPU,
)
def _prediction(r: Results):
    cases = sum(
        torch.equal(predict_upstream_nan_rows(x.case), observed_upstream_nan_rows(x))
        and torch.equal(predict_upstream_nan_grad_items(x.case), observed_upstream_nan_grad_items(x))
        for x in r.upstream.values()
    )
    points = sum(bool(p.get("prediction_exact")) and bool(p.get("grad_items_exact")) for p in r.sweep.records)
    total = len(r.upstream) + len(r.sweep.records)
    return cases + points == total, f"{cases + points}/{total} (cases + random-mask sweep)"


@claims(
    "1.2.2's backward writes every dK/dV row: NaN-filled fresh memory changes no bit of finite gradients, so empty_like -> zeros_like changes nothing",
    evidence=UPSTREAM_CPU,
)
def _coverage(r: Results):
    good = sum(c.identical and c.finite for c in r.coverage)
    return good == len(
        r.coverage
    ), f"{good}/{len(r.coverage)} configurations bit-identical ({', '.join(c.case for c in r.coverage)})"


@claims("tl.isfinite does not exist in Triton: the patch as written cannot compile", evidence=REPLICA)
def _isfinite_missing(r: Results):
    return not r.isfinite_in_triton and "isfinite" in r.isfinite_error, r.isfinite_error


@claims("patch-equivalent on the failing cases: dV and dK become finite", evidence=REPLICA)
def _patch_finite(r: Results):
    failing = r.failing()
    finite = sum(r.get(c, "patch").finite("dv") and r.get(c, "patch").finite("dk") for c in failing)
    return finite == len(failing) > 0, f"{finite}/{len(failing)} failing cases"


@claims("patch-equivalent leaves out, lse and dq exactly as non-finite as before", evidence=REPLICA)
def _patch_untouched(r: Results):
    failing = r.failing()
    same = sum(
        all(r.get(c, "patch").nonfinite(n) == r.get(c, "replica").nonfinite(n) for n in ("out", "lse", "dq")) for c in failing
    )
    still = sum(r.get(c, "patch").nonfinite("dq") > 0 for c in failing)
    return same == len(failing), f"{same}/{len(failing)} failing cases unchanged; dq still non-finite in {still}"


def patch_error_ratios(r: Results) -> dict[str, float]:
    """Failing case -> the smaller of the patch's dK and dV error, in units of the oracle's bound."""
    return {c.name: min(r.get(c, "patch").error_ratio(g) for g in ("dk", "dv")) for c in r.failing()}


@claims("patch-equivalent's now-finite dV/dK are silently wrong: error more than 10x the bound", evidence=REPLICA)
def _patch_wrong(r: Results):
    ratios = patch_error_ratios(r)
    return min(ratios.values()) > 10, "dV/dK error / bound: " + ", ".join(f"{x:.0f}x" for x in ratios.values())


@claims(
    "on the report's symptom (replica, all-True mask, Q=K=100: dK/dV NaN, out finite) the patch leaves no sign: every tensor finite, dK/dV more than 10x off",
    evidence=REPLICA,
)
def _patch_silent(r: Results):
    case = REPLICA_CASES[1]
    buggy, patched = r.get(case, "replica"), r.get(case, "patch")
    holds = buggy.finite("out") and not buggy.finite("dv") and patched.all_finite
    worst = min(patched.error_ratio(g) for g in ("dk", "dv"))
    return (
        holds and worst > 10,
        f"replica non-finite: {_counts(buggy, TENSORS)}; patch: all finite, dK/dV error {worst:.0f}x the bound or more",
    )


@claims("patch-equivalent swallows NaN arriving through dO: dV finite where autograd gives NaN", evidence=REPLICA)
def _patch_swallows(r: Results):
    oracle_nan = r.nan_do_oracle_nonfinite["dv"]
    buggy, patched = r.nan_do["replica"], r.nan_do["patch"]
    holds = oracle_nan > 0 and buggy.nonfinite("dv") > 0 and patched.finite("dv")
    return (
        holds,
        f"non-finite dV: oracle {oracle_nan}, replica {buggy.nonfinite('dv')}, patch 0 of {patched.tensors['dv'].numel()}",
    )


@claims(
    "a guard for rows with no visible key (output 0, gradient 0): every replica case finite and within the oracle's bound",
    evidence=REPLICA,
)
def _guard(r: Results):
    fixed = [r.get(c, "guard") for c in REPLICA_CASES]
    good = sum(f.all_finite and f.all_within for f in fixed)
    worst = max(f.error_ratio(n) for f in fixed for n in TENSORS)
    return good == len(fixed), f"{good}/{len(fixed)} cases; worst error {worst:.2f} x bound"


@claims("our varlen_attention on the same left-padded batch packed: padding exactly zero, real rows within bound", evidence=OURS)
def _ours(r: Results):
    fixed = r.ours
    holds = fixed.padding_exactly_zero and fixed.real_within_bound and fixed.real_finite
    return (
        holds,
        f"padding zero {fixed.padding_exactly_zero}, real rows finite {fixed.real_finite}, within bound {fixed.real_within_bound}",
    )


@claims(
    "tiny model, left padding 24 of 64: 1.2.2 and the patch NaN in every parameter's gradient at step 0; sanitizing gives finite, wrong gradients; the workaround finite",
    evidence=TOY,
)
def _training_claim(r: Results):
    t = r.training["variants"]
    buggy, patched, sanitized, fixed = (t[v] for v in TRAIN_VARIANTS)
    holds = all(x["nonfinite_at_step0"] == x["params"] for x in (buggy, patched))
    holds = holds and sanitized["first_nonfinite_step"] is None and fixed["first_nonfinite_step"] is None
    holds = holds and r.training["deviation"] > 0.05
    return holds, (
        f"parameters with a non-finite gradient at step 0: 1.2.2 {buggy['nonfinite_at_step0']}/{buggy['params']}, "
        f"patch {patched['nonfinite_at_step0']}/{patched['params']}; sanitized and workaround never; "
        f"sanitized gradient norms up to {r.training['deviation']:.0%} off the workaround's"
    )


@claims(
    "flash-sparse-attn 2.0.6 (the successor) cannot be imported: it needs `triton_kernels`, which it does not declare",
    evidence=UPSTREAM_CPU,
)
def _successor_import(r: Results):
    return "triton_kernels" in r.successor_import, r.successor_import


def _gpu_probes(r: Results) -> dict:
    return recorded_probes(r.gpu, META)


@claims(
    "on the GPU in bf16, the report's configuration over 8 seeds, with and without NaN-filled memory: no NaN, within the oracle's bound",
    evidence=UPSTREAM_GPU,
)
def _gpu_seed(r: Results):
    seeds = _gpu_probes(r)["seed_config_seeds"]
    holds = all(
        s["runs"] == len(GPU_SEEDS) and not s["errors"] and s["nonfinite_runs"] == 0 and s["worst_error_over_bound"] <= 1
        for s in seeds.values()
    )
    return holds, "; ".join(
        f"{k}: {s['nonfinite_runs']}/{s['runs']} runs with NaN, worst {s['worst_error_over_bound']:.2f} x bound"
        for k, s in seeds.items()
    )


@claims(
    "on the GPU in bf16: fully masked rows and lengths not a multiple of 64 give the CPU's NaN pattern, the workarounds are finite and within bound",
    evidence=UPSTREAM_GPU,
    headline=True,
)
def _gpu_cases(r: Results):
    cases = _gpu_probes(r)["cases"]
    parts, good = [], 0
    for name in _AFFECTED:
        c = recorded(cases, name)
        item_rows = r.upstream[name].case.seqlen
        ok = (
            c["ok"]
            and c["nan_rows"]["dk"] == c["nan_rows"]["dv"] == item_rows
            and c["nan_rows"]["out"] == r.upstream[name].nan_rows("out")
        )
        good += ok
        parts.append(
            f"{name}: out NaN rows {c['nan_rows']['out'] if c['ok'] else c['error']}, dV NaN rows {c['nan_rows']['dv'] if c['ok'] else '-'}"
        )
    for name in _RAGGED:
        c = recorded(cases, name)
        ok = (
            c["ok"]
            and c["nonfinite"]["out"] == c["nonfinite"]["dq"] == 0
            and c["nan_rows"]["dv"] == c["nan_rows"]["dk"] == r.upstream[name].nan_rows("dv")
        )
        good += ok
        parts.append(
            f"{name}: dK/dV NaN rows {c['nan_rows']['dk'] if c['ok'] else c['error']}, out finite {c['ok'] and c['nonfinite']['out'] == 0}"
        )
    for name in _WORKAROUNDS:
        c = recorded(cases, name)
        ok = c["ok"] and not any(c["nonfinite"].values()) and max(c["error_over_bound"].values()) <= 1
        good += ok
        parts.append(f"{name}: finite and within {ok}")
    return good == len(_AFFECTED) + len(_RAGGED) + len(_WORKAROUNDS), "; ".join(parts)


@claims(
    "flash-sparse-attn 2.0.6's dense kernel (triton_kernels stubbed), on the GPU in bf16: finite and within bound on the report's configuration and at 200 tokens",
    evidence=UPSTREAM_GPU,
)
def _gpu_successor(r: Results):
    successor = _gpu_probes(r)["successor"]
    runs = [recorded(successor, c.name) or {"ok": False, "error": "not run"} for c in (SEED, UPSTREAM_CASES[1])]
    good = sum(x["ok"] and not any(x["nonfinite"].values()) and max(x["error_over_bound"].values()) <= 1 for x in runs)
    return good == 2, "; ".join(
        f"{c.name}: " + (f"worst {max(x['error_over_bound'].values()):.2f} x bound" if x["ok"] else x["error"])
        for c, x in zip((SEED, UPSTREAM_CASES[1]), runs)
    )
