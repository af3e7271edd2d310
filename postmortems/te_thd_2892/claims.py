"""The claims of te-thd-2892, checked on reproduce()'s results."""

from __future__ import annotations

import math

from varlen_workbench.postmortems.te_thd_2892 import on_te
from varlen_workbench.postmortems.te_thd_2892.cases import (
    HEALTH_FRACTIONS,
    HEALTH_STEPS,
    TE_MAIN,
    TE_V2_12,
    TRAINING_RUNS,
    WORKAROUND_FRACTION,
)
from varlen_workbench.postmortems.te_thd_2892.study import TeResults
from varlen_workbench.postmortems.te_thd_2892.training import qkv_norm_ratio
from varlen_workbench.workbench.postmortem import (
    OURS,
    REPLICA,
    TOY,
    UPSTREAM_GPU,
    Claims,
    source_at,
)
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import read_record

claims = Claims()


@claims(
    "TE's pad_between_seqs auto-detect, 2.12 to 2.17.1: a batch padded only at its end, or VERL's equal boundaries, "
    "reads as no padding between sequences",
    evidence=source_at(TE_V2_12),
)
def _auto_detect_old(r: TeResults):
    found = {name: old for name, (old, _) in r.auto_detect.items()}
    names = list(found)
    holds = found[names[0]] and not found[names[1]] and not found[names[2]] and not found[names[3]]
    return holds, "; ".join(f"{name}: {value}" for name, value in found.items())


@claims(
    "TE 2.18 to 2.20.2 (PR #2898; read at main d0067d0 and in the 2.20.2 release): any padded tensor that is not "
    "the very object passed as cu_seqlens counts as padding between sequences, VERL's equal values included",
    evidence=source_at(TE_MAIN),
)
def _auto_detect_new(r: TeResults):
    found = {name: new for name, (_, new) in r.auto_detect.items()}
    names = list(found)
    holds = found[names[0]] and found[names[1]] and found[names[2]] and not found[names[3]]
    return holds, "; ".join(f"{name}: {value}" for name, value in found.items())


# -- TransformerEngine itself, on the GPU (postmortems/te_thd_2892/on_te.py reads the records) ------


@claims(
    "TE 2.20.2, the report's script: as written it stops at its first slip (48 GQA groups for 32 heads), and each "
    "mended slip moves it to the next; with all three mended it runs both calls, Float8BlockScaling with "
    "cu_seqlens_q != cu_seqlens_q_padded included, and exits 0: no SIGSEGV",
    evidence=UPSTREAM_GPU,
)
def _te_script(r: TeResults):
    runs = on_te.script_runs()
    stops = [run.get("error", "").split(":")[0] for run in runs[:-1]]
    holds = all(run.get("code") == 1 for run in runs[:-1]) and runs[-1].get("code") == 0 and len(runs) == 4
    holds &= not any(run["outcome"] == "killed" for run in runs)
    return holds, f"stopped by {', '.join(stops)}, then exit {runs[-1].get('code')} ({on_te.made(on_te.te_record('cases'))})"


@claims(
    "TE 2.20.2 with cu_seqlens != cu_seqlens_padded (the report's shapes: 500 real tokens in 544 rows, head dim 48, "
    "causal), without FP8 and under delayed, current and block scaling of the GEMMs: TE's output has the padded 544 "
    "rows, not the unpadded size; REAL rows of out, dq, dk, dv are within the bound and padding rows exactly 0",
    evidence=UPSTREAM_GPU,
    headline=True,
)
def _te_different(r: TeResults):
    runs = on_te.case_runs()
    names = [f"{recipe}:different" for recipe in ("bf16", "delayed", "current", "block")]
    ran = [runs[n] for n in names]
    holds = all(run["contract"]["real_within_bound"] and run["contract"]["padding_exactly_zero"] for run in ran)
    holds &= all(run["te_output_shapes"] == [[544, 1536]] and run.get("code") == 0 for run in ran)
    worst = max(t["real_error"] / t["bound"] for run in ran for t in run["contract"]["tensors"].values())
    return (
        holds,
        f"{len(ran)} recipes, TE's output {ran[0]['te_output_shapes'][0]}, worst {worst:.2f} of the bound; {on_te._backend(ran[0])}",
    )


@claims(
    "TE 2.20.2 runs no FP8 attention on THD on Hopper with the cuDNN 9.14 of torch's wheels: delayed scaling's fp8_dpa "
    "needs cuDNN 9.23 for THD, current scaling's needs sm100, Float8BlockScaling refuses fp8_dpa; every such call "
    "raises (no backend), so FP8 on THD reaches only the GEMMs",
    evidence=UPSTREAM_GPU,
)
def _te_no_fp8_attention(r: TeResults):
    runs = on_te.case_runs()
    dpa = [run for name, run in runs.items() if name.split(":")[0].endswith("-dpa")]
    reasons = {on_te._why_refused(run) for run in dpa}
    holds = len(dpa) == 9 and not any(run.get("contract", {}).get("ran", "nothing") != "nothing" for run in dpa)
    holds &= any("cuDNN 9.23" in reason for reason in reasons) and any("sm100" in reason for reason in reasons)
    return holds, "; ".join(sorted(reasons))


@claims(
    "VERL's workaround through TE 2.20.2 (causal, padding after each sequence's tokens): out and dq of REAL rows within "
    "the bound; dk and dv off it when padding rows send gradient back, within it when a loss over REAL tokens sends "
    "them none",
    evidence=UPSTREAM_GPU,
)
def _te_equal(r: TeResults):
    runs = [run for name, run in on_te.case_runs().items() if name.endswith(":equal") and "contract" in run]
    ran = [run for run in runs if run["contract"].get("ran") == "forward+backward"]
    split = all(
        run["contract"]["tensors"]["out"]["within"]
        and run["contract"]["tensors"]["dq"]["within"]
        and not run["contract"]["tensors"]["dk"]["within"]
        and run["contract_real_rows_grad"]["real_within_bound"]
        for run in ran
    )
    dk = ran[0]["contract"]["tensors"]["dk"]
    return split and len(
        ran
    ) == 4, f"{len(ran)} recipes; dk {dk['real_error']:.3g} vs bound {dk['bound']:.3g}; with dO zero on padding: within"


@claims(
    "TE#3487's case on TE 2.20.2: the padded boundaries' values in a separate tensor count as padding between "
    "sequences (UnfusedDotProductAttention leaves the candidates), yet TE picks the same fused backend, and every "
    "measured error equals the one-tensor run's",
    evidence=UPSTREAM_GPU,
)
def _te_3487(r: TeResults):
    runs = on_te.case_runs()
    pairs = [(runs[f"{n}:equal"], runs[f"{n}:equal-copies"]) for n in ("bf16", "delayed", "current", "block")]
    holds = all(one["boundaries_same_object"] == [True] and two["boundaries_same_object"] == [False] for one, two in pairs)
    holds &= all(one["backend"]["selected"] == two["backend"]["selected"] for one, two in pairs)
    holds &= all(
        "UnfusedDotProductAttention=True" in one["backend"]["available"][0]
        and "UnfusedDotProductAttention=False" in two["backend"]["available"][0]
        for one, two in pairs
    )
    holds &= all(one["contract"] == two["contract"] and one["as_called"] == two["as_called"] for one, two in pairs)
    return (
        holds,
        f"{len(pairs)} recipes; one tensor: {pairs[0][0]['backend']['available'][0]}; copies: {pairs[0][1]['backend']['available'][0]}",
    )


@claims(
    "the toy trained through TE 2.20.2's attention (BF16): causal, VERL's boundaries give the same loss at every step; "
    "bidirectional, its training loss ends higher and its held-out perplexity is worse, as through the replica",
    evidence=UPSTREAM_GPU,
)
def _te_training(r: TeResults):
    runs = {(x["attention"], x["objective"], x["boundaries"]): x for x in on_te.training_runs() if "error" not in x}
    out = []
    holds = True
    for attention in ("te-bf16", "replica"):
        causal = runs[attention, "causal", "separate"]["losses"] == runs[attention, "causal", "identical"]["losses"]
        apart, same = runs[attention, "bidirectional", "separate"], runs[attention, "bidirectional", "identical"]
        worse = same["final_loss"] > apart["final_loss"] and same["eval_perplexity"] > apart["eval_perplexity"]
        holds &= causal and worse
        out.append(
            f"{attention}: causal identical {causal}; bidirectional ppl {apart['eval_perplexity']:.2f} -> {same['eval_perplexity']:.2f}"
        )
    return holds, "; ".join(out)


@claims(
    "the report's FP8 mechanism on TE 2.20.2's own Linear (the report's 544 x 1536 packed rows): large values in "
    "padding rows raise the REAL rows' output error about 2.5x under delayed and current scaling (one scale per "
    "tensor) and leave it unchanged under block scaling (1 x 128 blocks along each row), whose weight gradient they "
    "still coarsen; zero padding changes no recipe's error",
    evidence=UPSTREAM_GPU,
)
def _te_fp8_linear(r: TeResults):
    from varlen_workbench.postmortems.te_thd_2892.te_probes import scale_damage

    rows = on_te.gemm_rows()
    damage = scale_damage(rows)
    by = {(x["name"], x["fill"]): x for x in rows}
    holds = damage["delayed"] > 2 and damage["current"] > 2 and abs(damage["block"] - 1) < 0.01 and damage["bf16"] == 1
    holds &= by["block", "large"]["dw_error"] > 1.3 * by["block", "zeros"]["dw_error"]
    holds &= all(by[n, "normal"]["y_real_error"] == by[n, "zeros"]["y_real_error"] for n in damage)
    return holds, ", ".join(f"{n} {d:.2f}x" for n, d in damage.items()) + (
        f"; block's dW {by['block', 'zeros']['dw_error']:.3g} -> {by['block', 'large']['dw_error']:.3g}"
    )


@claims(
    "TE 2.20.2's fused backward with GQA leaves dk and dv of a sequence that has keys but no query as memory held them "
    "(NaN under poisoned memory; 0 is right): without GQA, or with a query in that sequence, they are right; dtype, "
    "causality and the other sequences do not matter",
    evidence=UPSTREAM_GPU,
)
def _te_queryless_gqa(r: TeResults):
    runs = {run["variant"]: bool(run["result"]["findings"]) for run in on_te.te_record("probes", "variants")["variants"]}
    clean = ["without GQA", "the queryless sequence given a query", "a keyless sequence, every other one whole"]
    nan = [name for name in runs if name not in clean and name != "the empty-sequences check's layout"]
    holds = not any(runs[n] for n in clean) and all(runs[n] for n in nan) and not runs["the empty-sequences check's layout"]
    return holds, f"NaN in {len(nan)} of {len(runs)} variants; clean: {', '.join(clean)}"


@claims(
    "TE 2.20.2's fused backward: dq differs bitwise between identical runs by default, and is identical with "
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, as TE documents",
    evidence=UPSTREAM_GPU,
)
def _te_determinism(r: TeResults):
    runs = {run["setting"]: run for run in on_te.te_record("probes", "determinism")["determinism"]}
    holds = runs["default"]["verdict"] == "FAIL" and runs["deterministic"]["verdict"] == "pass"
    return holds, f"default: {runs['default']['evidence']}; with the switch: {runs['deterministic']['evidence']}"


@claims(
    "compute-sanitizer's initcheck on TE 2.20.2's forward + backward: the same count of uninitialised reads, in "
    "cuDNN's fmha_reduce_head_ragged, with GAP and TAIL rows, with either alone and with none: they do not come from "
    "padding rows",
    evidence=UPSTREAM_GPU,
)
def _te_initcheck(r: TeResults):
    runs = {run["layout"]: run for run in on_te.te_record("probes", "initcheck")["initcheck"]}
    padded = ["the audit's (GAP and TAIL)", "GAP only", "TAIL only", "no padding"]
    counts = {runs[n]["errors"] for n in padded}
    holds = len(counts) == 1 and all(runs[n]["completed"] and "fmha_reduce_head_ragged" in runs[n]["first"] for n in padded)
    return holds and 0 not in counts, f"{counts.pop() if len(counts) == 1 else counts} reads in each of {len(padded)} layouts"


@claims(
    "VERL's workaround, non-causal attention: REAL-row error above the bound at every padding fraction > 0, growing with it",
    evidence=REPLICA,
)
def _workaround_noncausal(r: TeResults):
    points = r.workaround_sweep[False]
    padded = [c for f, c in points if f > 0]
    errors = [c.error for c in padded]
    kernel, right = r.workaround_kernel[False], r.contract[False]
    holds = (
        points[0][1].within
        and not any(c.within for c in padded)
        and errors == sorted(errors)
        and not kernel.within
        and right.within
    )
    return holds, "errors " + ", ".join(f"{f:.2f}: {c.error:.3f}" for f, c in points) + (
        f"; our kernel at {WORKAROUND_FRACTION}: {kernel.error:.3f}; called right: {right.error:.2g}"
    )


@claims(
    "VERL's workaround, causal attention with padding at each sequence's end: REAL rows within the bound at every fraction",
    evidence=REPLICA,
)
def _workaround_causal(r: TeResults):
    points = r.workaround_sweep[True]
    kernel = r.workaround_kernel[True]
    worst = max(c.error / c.bound for _, c in points)
    return all(c.within for _, c in points) and kernel.within, (
        f"worst {worst:.2f} of the bound over {len(points)} fractions; our kernel {kernel.error / kernel.bound:.2f}"
    )


@claims("causal toy trained with the workaround: loss identical to the correct run at every step", evidence=TOY)
def _training_causal(r: TeResults):
    correct, workaround = (r.training[name][0] for name in TRAINING_RUNS[:2])
    return workaround.losses == correct.losses, f"{len(correct.losses)} steps, final loss {correct.final_loss:.4f} both"


@claims(
    "bidirectional toy, padding to multiples of 16: the workaround's training loss ends higher in most seeds, "
    "but its held-out loss does not (the sign changes with the random seed)",
    evidence=TOY,
)
def _training_bidirectional(r: TeResults):
    train_gaps = [s.train_gap for s in r.seeds]
    held_gaps = [s.heldout_gap for s in r.seeds]
    higher = sum(g > 0 for g in train_gaps)
    holds = higher > len(train_gaps) / 2 and any(g > 0 for g in held_gaps) and any(g < 0 for g in held_gaps)
    return holds, (
        f"{len(train_gaps)} seeds; training gap {min(train_gaps):+.3f} to {max(train_gaps):+.3f} (higher in {higher}); "
        f"held-out gap {min(held_gaps):+.3f} to {max(held_gaps):+.3f}"
    )


@claims(
    f"bidirectional toy, {HEALTH_FRACTIONS[0]:.0%} padding: the workaround's qkv gradient norms fall below half the correct run's "
    "(padding keys dilute attention)",
    evidence=TOY,
)
def _health(r: TeResults):
    ratio = qkv_norm_ratio(r.health)
    return ratio < 0.5, f"mean qkv gradient norm over the last 10 of {HEALTH_STEPS} steps, workaround / correct = {ratio:.2f}"


@claims(
    "padding only at the end through a backend that never writes the tail, in poisoned memory: NaN gradients at the first step; "
    "zeroing the tail rows of out and dq/dk/dv restores the correct run",
    evidence=REPLICA,
)
def _tail_blind(r: TeResults):
    end, blind, zeroed = (r.training[name] for name in TRAINING_RUNS[2:])
    chain = blind[1].causal_chain()
    holds = (
        math.isfinite(blind[0].losses[0])
        and all(math.isnan(x) for x in blind[0].losses[1:])
        and chain.origin is not None
        and chain.origin.step == 0
        and max(abs(a - b) for a, b in zip(zeroed[0].losses, end[0].losses)) < 1e-5
    )
    return holds, (
        f"tail-blind: first non-finite gradient at step {chain.origin.step if chain else '-'} in {chain.first_parameter}; "
        f"tail zeroed: final loss {zeroed[0].final_loss:.4f}, correct backend {end[0].final_loss:.4f} (every step within 1e-5)"
    )


@claims("FP8 scales from REAL rows: REAL-row error within the FP8 bound whatever the padding holds", evidence=REPLICA)
def _fp8_real(r: TeResults):
    checks = {fill: c for (fill, scales), c in r.fp8.items() if scales == "real"}
    return all(c.within for c in checks.values()), ", ".join(
        f"{fill}: {c.error:.3f} <= {c.bound:.3f}" for fill, c in checks.items()
    )


@claims("FP8 scales from all rows: a huge padding row rounds real tokens to 0, a NaN row makes them NaN", evidence=REPLICA)
def _fp8_all(r: TeResults):
    huge, nan = r.fp8[("huge", "all")], r.fp8[("nan", "all")]
    return huge.ratio > 10 * huge.factor and math.isnan(
        nan.error
    ), f"huge: error {huge.error:.3g} ({huge.error / huge.bound:.0f} x bound); NaN: error {nan.error}"


@claims(
    "FP8 scales from all rows with the padding rows zeroed: scales and codes identical to scales from REAL rows", evidence=REPLICA
)
def _fp8_zeros(r: TeResults):
    zero = r.fp8[("zeros", "all")]
    return (
        r.fp8_zero_scales_equal and zero.within,
        f"scales and codes equal: {r.fp8_zero_scales_equal}; error {zero.error:.3f} <= {zero.bound:.3f}",
    )


@claims(
    "our kernel on TE's docstring layout: padded output shape, padding rows exactly 0 in out/dq/dk/dv, REAL rows within bound",
    evidence=OURS,
)
def _layout(r: TeResults):
    record = r.layout
    shape = tuple(record.tensors["out"].shape)
    holds = shape == (13, 2, 16) and record.padding_exactly_zero and record.real_finite and record.real_within_bound
    worst = max(c.ratio for c in record.errors.values())
    return (
        holds,
        f"out {shape} for cu_seqlens_q_padded[-1] = 13; padding zero {record.padding_exactly_zero} (NaN inputs, poisoned memory); worst {worst:.2f} x PyTorch",
    )


@claims(
    "TE's own THD padding test (0-3 padding rows per sequence, unpadded reference) passes on our kernel, TE's fp16 tolerance and our bound",
    evidence=OURS,
)
def _recipe(r: TeResults):
    result = r.recipe
    return (
        result.te_passes and result.within_bound and result.padding_max_abs == 0.0,
        f"pads {result.pads}; TE margin max {max(result.te_error.values()):.2g} <= {result.te_tolerance:g}; padding max |x| {result.padding_max_abs:g}",
    )


@claims(
    "RoPE positions from cu_seqlens_padded (Megatron-Core MLA's choice): every sequence's real tokens get 0..len-1",
    evidence=REPLICA,
)
def _rope_padded(r: TeResults):
    study = r.rope
    return study.consistent, f"{len(study.sequences)} sequences, {int(study.from_padded.numel())} rows"


@claims(
    "RoPE positions from cu_seqlens on a padded layout: a restart inside a sequence corrupts attention; a constant shift does not",
    evidence=REPLICA,
)
def _rope_real(r: TeResults):
    kinds = {kind: [s for s in r.rope.sequences if s.kind == kind] for kind in ("restarted", "shifted")}
    holds = (
        bool(kinds["restarted"])
        and not any(s.check.within for s in kinds["restarted"])
        and all(s.check.within for s in kinds["shifted"])
    )
    return holds, "; ".join(
        f"{kind}: " + ", ".join(f"seq {s.index} {s.check.ratio:.3g} x" for s in seqs) for kind, seqs in kinds.items()
    )


@claims(
    "sizing lesson, our all-gather on 2 processes: sized from cu_seqlens_padded[-1] it reproduces one process exactly",
    evidence=OURS,
)
def _seqpar_padded(r: TeResults):
    run = r.seqpar.run("padded")
    return run.exact, f"{r.seqpar.backend}: {run.rows} rows gathered, output torch.equal to one process: {run.exact}"


@claims(
    "sizing lesson: sized from cu_seqlens[-1] the buffer is too small; our check names the boundary and the fix", evidence=OURS
)
def _seqpar_real(r: TeResults):
    study = r.seqpar
    checked, raw = study.run("real"), study.run("real", validate=False)
    clear = all(
        e and e.startswith("SizingError") and "cu_seqlens[-1]" in e and "cu_seqlens_padded[-1]" in e for e in checked.errors
    )
    return clear and raw.out is None, (
        f"{checked.rows} real rows vs {study.layout_rows} in the layout; unchecked, torch says: {raw.error.split(':', 1)[0] if raw.error else 'nothing'}"
    )


@claims(
    "context parallelism's zig-zag split (each sequence cut into 2 x cp_size equal chunks, rank r holding chunks r and "
    "2 x cp_size - 1 - r), on 2 processes: a sequence whose padded length is not a multiple of 2 x cp_size has no "
    "equal chunks; cut into floor-sized ones, its last rows are on no rank, and under a causal mask the gradients "
    "those queries send to earlier keys (dk, dv) are lost while out and dq of the rows held stay right",
    evidence=REPLICA,
)
def _cp_rule_broken(r: TeResults):
    study = r.cp_rule
    holds = study.rows_on_no_rank > 0 and study.lost_tensors == ["dk", "dv"]
    return holds, (
        f"{study.backend}, {study.cp_size} ranks, real and padded lengths {list(study.broken.seqlens_q)}: "
        f"{study.rows_on_no_rank} rows on no rank; REAL rows off the bound in {', '.join(study.lost_tensors) or 'nothing'}"
    )


@claims(
    "our context-parallel attention (our kernel on each block, partial results merged by log-sum-exp) on 2 processes, "
    "every sequence padded to a multiple of 2 x cp_size: on every rank REAL rows of out, dq, dk, dv within the bound "
    "and the padding rows the rule adds exactly 0 (NaN inputs there, poisoned memory); a layout without the rule is "
    "refused, naming the sequence and the fix",
    evidence=OURS,
)
def _cp_rule_kept(r: TeResults):
    study = r.cp_rule
    refused = "not a multiple of 2 x cp_size" in study.refusal and "Pad each sequence" in study.refusal
    holds = not study.kept_findings and refused
    return holds, (
        f"{study.backend}: real {list(study.kept.seqlens_q)} padded to {list(study.kept.padded_lengths('q'))}: "
        f"{len(study.kept_findings)} findings; without the rule: {study.refusal.split(':')[0]}"
    )


@claims(
    "fp32 -> e4m3: Triton's own cast differs from torch's only under the interpreter; our quantizer's explicit rounding matches torch",
    evidence=OURS,
)
def _cast(r: TeResults):
    values, sample = r.cast["values"], r.cast["sample"]
    differs = values["triton_differs"] > 0 and sample["triton_differs"] > 0
    holds = differs == values["interpreted"] and values["quantizer_matches"] and sample["quantizer_matches"]
    where = "interpreted" if values["interpreted"] else "native"
    return holds, (
        f"{where}: 124.3 -> {values['triton'][0]:g} (torch {values['torch'][0]:g}); {sample['triton_differs']:.1%} of N(0, 9) values differ; "
        f"quantizer == torch: {values['quantizer_matches'] and sample['quantizer_matches']}"
    )


@claims(
    "On the H200, cuDNN's ragged SDPA (the kernel TE's THD path runs on Hopper; cudnn-frontend 1.32.0, bf16) given "
    "TE's two boundaries, real cu_seqlens for the mask and cu_seqlens_padded for the memory offsets, keeps REAL rows "
    "within the bound on layouts with GAP and TAIL rows, also with NaN, +-Inf or huge values in the padding; it leaves "
    "the GAP and TAIL rows of out, dq, dk, dv unwritten, as the tail-blind backend above leaves its TAIL rows",
    evidence=UPSTREAM_GPU,
)
def _cudnn_ragged(r: TeResults):
    record = read_record(GPU_DATA / "audit-cudnn-ragged.json")
    checks = {c["name"]: c for c in record["checks"]}
    right = [name for name in ("real-accuracy", "padding-leak") if checks[name]["verdict"] == "pass"]
    padded = all(case["padded_q"] and case["padded_k"] and case["tail_q"] for case in checks["padding-leak"]["cases"])
    padded &= any(case["padded_q"] and case["tail_q"] for case in checks["real-accuracy"]["cases"])
    unwritten = [
        name
        for name, region in (("gap-rows", "GAP"), ("tail-rows", "TAIL"))
        if checks[name]["verdict"] == "FAIL"
        and f"{region} rows" in checks[name]["evidence"]
        and "REAL" not in checks[name]["evidence"]
    ]
    blind = r.training[TRAINING_RUNS[3]][0]  # the tail-blind replica in poisoned memory
    holds = len(right) == 2 and padded and len(unwritten) == 2 and "H200" in record["provenance"]["device"]
    holds &= math.isnan(blind.losses[-1])
    return holds, (
        f"passed: {', '.join(right)} ({checks['padding-leak']['evidence']}); unwritten padding: {', '.join(unwritten)} "
        f"({record['versions'].get('nvidia-cudnn-frontend')}, {record['provenance']['date']})"
    )
