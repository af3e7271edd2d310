"""The claims of torch-varlen-176793, checked on reproduce()'s results and the GPU records."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from varlen_workbench.postmortems.torch_varlen_176793.cases import GPU_PADS, GPU_TRAILING, GRADS, META, STUDY, VARLEN_PY
from varlen_workbench.postmortems.torch_varlen_176793.study import QKV, TorchVarlenResults, norm_inflation
from varlen_workbench.postmortems.torch_varlen_176793.upstream import upstream_code
from varlen_workbench.postmortems.torch_varlen_176793.workarounds import LATER_KEYWORDS
from varlen_workbench.workbench.postmortem import (
    OURS,
    REPLICA,
    TOY,
    UPSTREAM_GPU,
    Claims,
    recorded_probes,
)

claims = Claims()


@claims(
    "upstream source: varlen_attn hands q, k, v at full length to aten._flash_attention_forward/_backward, with no "
    "check of cu_seq_q[-1] and no zeroing of any row (installed torch read too)",
    evidence=VARLEN_PY,
)
def _source(r: TorchVarlenResults):
    code = upstream_code()
    calls = "_flash_attention_forward" in code and "_flash_attention_backward" in code
    guards = [token for token in (".item()", "[-1]", "zero_(", "masked_fill", "torch.where") if token in code]
    return calls and not guards, f"installed torch {torch.__version__}: calls FA2 ops {calls}; guards found: {guards or 'none'}"


@claims(
    "replica, memory poisoned (NaN-filled fresh buffers): the original report's out.sum() is NaN in the forward, only TAIL rows "
    "of out and x.grad are non-finite; the GPU record checks this on varlen_attn itself",
    evidence=REPLICA,
)
def _corrected_poisoned(r: TorchVarlenResults):
    c = r.corrected["poisoned"]
    holds = math.isnan(c["loss"]) and c["out_tail_nonfinite"] > 0 and c["grad_tail_nonfinite"] > 0
    holds = holds and c["out_real_nonfinite"] == 0 and c["grad_real_nonfinite"] == 0
    return holds, f"loss {c['loss']}; non-finite TAIL out {c['out_tail_nonfinite']}, x.grad {c['grad_tail_nonfinite']}; REAL 0"


@claims(
    "replica, stale finite memory instead: the same out.sum() is finite and x.grad has no NaN, so nothing warns "
    "(replica only: what torch's allocator leaves varies)",
    evidence=REPLICA,
)
def _corrected_stale(r: TorchVarlenResults):
    c = r.corrected["stale"]
    nonfinite = c["out_tail_nonfinite"] + c["grad_tail_nonfinite"] + c["out_real_nonfinite"] + c["grad_real_nonfinite"]
    return math.isfinite(c["loss"]) and nonfinite == 0, f"loss {c['loss']:.4g}; non-finite elements {nonfinite}"


@claims(
    "replica, stale finite memory, loss over real rows only: no NaN anywhere, yet the TAIL rows of d(qkv) hold "
    "garbage and the QKV weight gradient is wrong by more than 10%; the GPU record checks varlen_attn itself",
    evidence=REPLICA,
)
def _damage(r: TorchVarlenResults):
    d = r.damage
    holds = d["weight_grad_finite"] and d["dqkv_tail_nonfinite"] == 0 and d["dqkv_tail_max_abs"] > 0
    holds = holds and d["weight_grad_rel_error"] > 0.1 and d["correct_tail_zero"] and math.isfinite(d["loss"])
    return holds, (
        f"weight grad finite {d['weight_grad_finite']}; TAIL d(qkv) max |x| {d['dqkv_tail_max_abs']:.3g}; "
        f"relative error {d['weight_grad_rel_error']:.3g}"
    )


@claims(
    "replica: no TAIL rows, no symptom; every trailing pad > 0 gives non-finite TAIL rows in out, dq, dk, dv", evidence=REPLICA
)
def _replica_map(r: TorchVarlenResults):
    points = [(p["tail_q"], p["record"]) for p in r.sweep.where(impl="replica")]
    clean = sum(rec.nonfinite_in("TAIL") == 0 and rec.real_finite for pad, rec in points if pad == 0)
    broken = sum(
        all(rec.nonfinite[t]["TAIL"] > 0 for t in ("out",) + GRADS) and rec.real_finite for pad, rec in points if pad > 0
    )
    n0 = sum(pad == 0 for pad, _ in points)
    return clean == n0 and broken == len(
        points
    ) - n0, f"pad 0 clean {clean}/{n0}; pad > 0 non-finite TAIL {broken}/{len(points) - n0}"


def _workaround(r_points, name: str, loss: str) -> dict[str, Any]:
    (point,) = [p for p in r_points if p["workaround"] == name and p["loss"] == loss]
    return point


def _zero_and_right(p: dict[str, Any]) -> bool:
    return "error" not in p and p["tail_zero"] and p["real_within_bound"]


@claims(
    "workaround (a) on the replica, poisoned: with a loss mask the dummy sequence's rows get exactly 0 gradients; "
    "without one they get finite non-zero gradients (the padding is trained)",
    evidence=REPLICA,
)
def _dummy(r: TorchVarlenResults):
    masked = _workaround(r.workarounds, "(a) dummy last sequence", "loss mask")
    every = _workaround(r.workarounds, "(a) dummy last sequence", "every row")
    unmasked_ok = "error" not in every and every["tail_nonfinite"] == 0 and not every["tail_zero"] and every["real_within_bound"]
    return _zero_and_right(
        masked
    ) and unmasked_ok, f"loss mask: TAIL 0 {masked.get('tail_zero')}; every row: max |x| {every.get('tail_max_abs')}"


@claims(
    "workarounds (b) slice and (c) device zeroing on the replica, poisoned: TAIL rows of out, dq, dk, dv exactly 0, "
    "REAL rows within bound, whatever the loss reads",
    evidence=REPLICA,
)
def _slice_and_zero(r: TorchVarlenResults):
    names = ("(b) slice to cu_seqlens[-1]", "(c) zero TAIL rows on device")
    good = [p for p in r.workarounds if p["workaround"] in names and _zero_and_right(p)]
    return len(good) == 4, f"{len(good)}/4 (workaround x loss) points exactly 0 and within bound"


@claims(
    "fixed kernel: TAIL rows of out and all gradients exactly zero, REAL rows within the relative bound of the oracle, "
    "at every sweep point",
    evidence=OURS,
)
def _fixed_sweep(r: TorchVarlenResults):
    points = [p["record"] for p in r.sweep.where(impl="fixed")]
    good = sum(rec.padding_exactly_zero and rec.real_within_bound for rec in points)
    return good == len(points) > 0, f"{good}/{len(points)} points (poisoned memory)"


@claims(
    "the proposed ValueError (PRs #186786/#188933), wrapped around the replica, rejects a layout the fixed kernel handles "
    "correctly",
    evidence=REPLICA,
)
def _check_rejects(r: TorchVarlenResults):
    c = r.check
    error = c.rejects_tail["error"] or "nothing"
    fixed = r.at("fixed")
    fixed_ok = fixed.padding_exactly_zero and fixed.real_within_bound
    holds = error.startswith("ValueError") and c.accepts_no_tail["ok"] and fixed_ok
    return holds, f"{STUDY.tail_q} TAIL rows: the check raises {error.split(':')[0]}; fixed kernel exact: {fixed_ok}"


@claims(
    "our drop-in `varlen_workbench.kernels.varlen.varlen_attn` takes every keyword torch's later releases add: "
    "enable_gqa=True runs grouped K/V (as K/V repeated per query head); seqused_k, block_table and num_splits "
    "raise ValueError naming what the fixed kernel does not do",
    evidence=OURS,
)
def _keywords(r: TorchVarlenResults):
    from varlen_workbench.kernels.varlen import varlen_attn

    taken = set(LATER_KEYWORDS) <= set(inspect.signature(varlen_attn).parameters)
    refused = [k for k in LATER_KEYWORDS[1:] if r.keywords.get(k, "").startswith(f"ValueError: varlen_attn got {k}")]
    runs = r.keywords.get("enable_gqa") == "runs, matches K/V repeated per query head"
    return taken and runs and refused == list(LATER_KEYWORDS[1:]), "; ".join(f"{k}: {v}" for k, v in r.keywords.items())


@claims(
    "audit matrix, H200 (torch 2.11): the fuzzer's real-accuracy FAIL of varlen_attn lies on REAL rows of a layout "
    "with no padding, where a sequence has more queries than keys and the window's right bound is at least "
    "max_seqlen_k; FlashAttention-2's reset of that bound to -1, applied to the fp64 oracle here, moves the output "
    "of the rows the window leaves keyless by the recorded error (within 5%); our kernel holds the bound there",
    evidence=UPSTREAM_GPU,
)
def _window_reset(r: TorchVarlenResults):
    w = r.window
    if w is None:
        return False, "the audit matrix's varlen_attn record holds no fuzzer failure of real-accuracy"
    recorded = w.recorded_out_error
    matches = recorded is not None and abs(w.reset_error - recorded) <= 0.05 * recorded
    judged = w.judgement is not None and w.judgement.mechanism == "fa2-window-bound-clamp"
    holds = w.padding_rows == 0 and w.keyless_rows > 0 and w.reset_applies and matches and judged and w.ours == "within bound"
    return holds, (
        f"{w.case.label()}: padding rows {w.padding_rows}, keyless REAL rows {w.keyless_rows}; recorded out error "
        f"{recorded}, the reset moves the oracle by {w.reset_error:.3g}; ours: {w.ours} ({w.provenance['date']})"
    )


@claims(
    "around the replica, host reads (the check's .item(), the slice's int()) break torch.compile(fullgraph=True); "
    "the dummy sequence, device zeroing and the fixed kernel compile",
    evidence=REPLICA,
)
def _compile(r: TorchVarlenResults):
    c = r.check.compile
    breaks = [n for n in c if n.endswith("proposed check") or "(b) slice" in n]
    holds = all(not c[n]["ok"] for n in breaks) and all(c[n]["ok"] for n in c if n not in breaks) and len(breaks) == 2
    return holds, "; ".join(f"{n}: {'compiles' if o['ok'] else o['error'].split(':')[0]}" for n, o in c.items())


@claims("toy LM, memory poisoned: the replica's loss goes NaN after one step, the fixed kernel's stays finite", evidence=TOY)
def _training_loss(r: TorchVarlenResults):
    if r.training is None:
        return False, "not run: the training study needs the Triton interpreter (CPU)"
    replica_losses, fixed_losses = r.training.runs["replica"].losses, r.training.runs["fixed"].losses
    first_nan = next((i for i, x in enumerate(replica_losses) if not math.isfinite(x)), None)
    holds = first_nan is not None and 0 < first_nan and all(math.isfinite(x) for x in fixed_losses)
    return (
        holds,
        f"replica loss non-finite from step {first_nan}; fixed: {sum(map(math.isfinite, fixed_losses))}/{len(fixed_losses)} finite",
    )


@claims("the health monitor names the first non-finite gradient and the NaN tracer names the replica's forward op", evidence=TOY)
def _training_diagnosis(r: TorchVarlenResults):
    if r.training is None:
        return False, "not run: the training study needs the Triton interpreter (CPU)"
    first = r.training.monitors["replica"].causal_chain().first_parameter
    culprit = r.training.culprit
    names_op = culprit is not None and culprit.phase == "forward" and "torch_varlen_fwd" in culprit.op
    clean = not r.training.monitors["fixed"].causal_chain()
    op = f"{culprit.op} in {culprit.module or '<no module>'}" if culprit else "none"
    return first is not None and names_op and clean, f"first non-finite gradient: {first}; culprit op: {op}"


@claims(
    "toy LM, stale finite memory: with trailing rows the replica's qkv.weight gradient norm exceeds the fixed "
    "kernel's by 2x or more at some step, with no NaN; without trailing rows the two runs agree",
    evidence=TOY,
)
def _norms(r: TorchVarlenResults):
    if r.norms is None:
        return False, "not run: the gradient-norm study needs the Triton interpreter (CPU)"
    ratios = {pad: norm_inflation(m) for pad, m in r.norms.items()}
    finite = all(math.isfinite(x) for m in r.norms.values() for h in m.values() for x in h.norms(QKV))
    holds = finite and all(ratio >= 2 for pad, ratio in ratios.items() if pad > 0) and abs(ratios.get(0, math.nan) - 1) < 0.05
    return holds, "max ratio per trailing rows: " + ", ".join(f"{pad}: {ratio:.3g}" for pad, ratio in ratios.items())


def _gpu_points(r: TorchVarlenResults, impl: str, poisoned: bool) -> list[dict[str, Any]]:
    return [p for p in recorded_probes(r.gpu, META)["points"] if p["impl"] == impl and p["poisoned"] is poisoned]


def register_gpu_claims(target: Claims) -> None:
    """Registers in `target` the claims read from a GPU record's probes (`results.gpu`)."""

    @target(
        "H200: the original report's code verbatim (2-D float32 chunks) stops with an error in varlen_attn", evidence=UPSTREAM_GPU
    )
    def _gpu_seed(r: TorchVarlenResults):
        raised = recorded_probes(r.gpu, META)["seed_repro"].get("raised")
        return bool(raised), f"raised: {raised}"

    @target(
        "H200, varlen_attn, memory poisoned: every trailing pad > 0 leaves non-finite TAIL rows in out, dq, dk and dv; "
        "no trailing rows, none; REAL rows within bound of fp64 at every point",
        evidence=UPSTREAM_GPU,
        headline=True,
    )
    def _gpu_poisoned(r: TorchVarlenResults):
        points = [p for p in _gpu_points(r, "varlen_attn", True) if "error" not in p]
        broken = [p["pad"] for p in points if p["pad"] > 0 and all(p["nonfinite"][t]["TAIL"] > 0 for t in ("out",) + GRADS)]
        clean = [p["pad"] for p in points if p["pad"] == 0 and sum(p["nonfinite"][t]["TAIL"] for t in p["nonfinite"]) == 0]
        real = all(p["real_within_bound"] for p in points)
        expected = sorted(p for p in GPU_PADS if p > 0)
        holds = sorted(broken) == expected and clean == [0] and real and len(points) == len(GPU_PADS)
        return holds, f"broken at pads {broken}; clean at {clean}; REAL within bound everywhere: {real}"

    @target(
        "H200, varlen_attn: the original report's out.sum() is NaN only when memory is poisoned; as the allocator left it, it "
        "was finite in this run",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_corrected(r: TorchVarlenResults):
        runs = recorded_probes(r.gpu, META)["corrected_repro"]
        poisoned = [k for k, v in runs.items() if "poisoned=True" in k and math.isnan(v.get("loss", 0.0))]
        as_left = [k for k, v in runs.items() if "poisoned=False" in k and math.isfinite(v.get("loss", math.nan))]
        return len(poisoned) == 2 and len(as_left) == 2, f"NaN when poisoned: {poisoned}; finite as left: {as_left}"

    @target(
        "H200, varlen_attn, fresh process, loss over real rows only: with the allocator as left and with finite blocks "
        "staged, the padding rows of d(qkv) held garbage that included NaN bit patterns, and the QKV weight gradient "
        "was NaN; the sliced (correct) run's padding rows are exactly 0",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_damage(r: TorchVarlenResults):
        runs = recorded_probes(r.gpu_damage, META)["damage"]
        holds = all(
            not d["weight_grad_finite"] and d["dqkv_tail_nonfinite"] > 0 and d["correct_tail_zero"] for d in runs.values()
        )
        return holds, "; ".join(f"{g}: non-finite TAIL d(qkv) {d['dqkv_tail_nonfinite']}" for g, d in runs.items())

    @target(
        "H200, varlen_attn as left (that point unpoisoned), 64 trailing rows: the padding rows of out, dq, dk, dv held finite, "
        "non-zero garbage and no NaN, the case a NaN check never sees; our kernel's were exactly 0",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_finite_garbage(r: TorchVarlenResults):
        ours = [p for p in _gpu_points(r, "varlen_attn", False) if p["pad"] == GPU_TRAILING and "error" not in p]
        fixed = [p for p in _gpu_points(r, "fixed", False) if p["pad"] == GPU_TRAILING and "error" not in p]
        if len(ours) != 1 or len(fixed) != 1:
            return False, f"the record has no unpoisoned point at {GPU_TRAILING} trailing rows"
        (p,), (f,) = ours, fixed
        nonfinite = sum(p["nonfinite"][t]["TAIL"] for t in p["nonfinite"])
        peak = max(p["max_abs"][t]["TAIL"] for t in p["max_abs"])
        return nonfinite == 0 and peak > 0 and f["padding_exactly_zero"], f"non-finite {nonfinite}; max |x| {peak:.3g}"

    @target(
        "H200 timing, forward+backward with a loss mask: (a) the dummy sequence is the cheapest of the upstream "
        "workarounds at 944 and at 8x2048 tokens; our kernel is slower than varlen_attn as is at 944 tokens and faster "
        "at 8x2048",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_timing(r: TorchVarlenResults):
        probes = recorded_probes(r.gpu_damage, META)
        ratios = {
            size: {t["workaround"][:3]: t["vs_as_is"] for t in probes[key]}
            for size, key in (("944", "timing"), ("8x2048", "timing_large"))
        }
        cheapest = all(min(("(a)", "(b)", "(c)"), key=v.get) == "(a)" for v in ratios.values())
        ours = ratios["944"]["(d)"] > 1 > ratios["8x2048"]["(d)"]
        return cheapest and ours, "; ".join(
            f"{size}: " + ", ".join(f"{k} {x:.2f}x" for k, x in v.items() if k != "as ") for size, v in ratios.items()
        )

    @target(
        "H200, varlen_attn, poisoned, loss mask: workarounds (a) dummy sequence, (b) slice, (c) device zeroing and "
        "(d) our kernel all leave TAIL rows exactly 0 and REAL rows within bound",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_workarounds(r: TorchVarlenResults):
        points = [
            p for p in recorded_probes(r.gpu, META)["workarounds"] if p["loss"] == "loss mask" and p["workaround"] != "as is"
        ]
        good = [p["workaround"] for p in points if _zero_and_right(p)]
        return len(good) == len(points) == 4, f"exact and within bound: {good}"

    @target(
        "H200: CUDA-graph capture works for varlen_attn as is, with (a) the dummy sequence, with (c) device zeroing and "
        "for our kernel; it fails for (b) the slice and for the proposed check (host reads)",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_capture(r: TorchVarlenResults):
        graphs = recorded_probes(r.gpu, META)["capture"]["cuda_graph"]
        host = {n for n in graphs if n.endswith("proposed check") or "(b) slice" in n}
        holds = (
            len(host) == 2 and all(not graphs[n]["ok"] for n in host) and all(graphs[n]["ok"] for n in graphs if n not in host)
        )
        return holds, "; ".join(f"{n}: {'captured' if o['ok'] else o['error'].split(':')[0]}" for n, o in graphs.items())

    @target(
        "H200: torch.compile(fullgraph=True) captures varlen_attn as is and with workarounds (a), (b) and (c); only "
        "the proposed check's data-dependent branch breaks the graph",
        evidence=UPSTREAM_GPU,
    )
    def _gpu_compile(r: TorchVarlenResults):
        compiled = recorded_probes(r.gpu, META)["capture"]["compile_fullgraph"]
        broken = [n for n, o in compiled.items() if not o["ok"]]
        return broken == ["varlen_attn + proposed check"], "; ".join(
            f"{n}: {'compiles' if o['ok'] else o['error'].split(':')[0]}" for n, o in compiled.items()
        )


register_gpu_claims(claims)
