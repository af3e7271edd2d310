"""The tiny training run and the gradient norms, the results, and reproduce()."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.replicas.torch_varlen import replica_varlen_attn, stale_memory
from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.torch_varlen_176793.cases import META, STUDY
from varlen_workbench.postmortems.torch_varlen_176793.mechanism import corrected_repro, record_at, run_sweep, seed_input_problems
from varlen_workbench.postmortems.torch_varlen_176793.window import WindowFinding, window_finding
from varlen_workbench.postmortems.torch_varlen_176793.workarounds import (
    CheckAssessment,
    assess_proposed_check,
    qkv_damage,
    swap_in_keywords,
    workaround_checks,
)
from varlen_workbench.workbench.instruments.health import GradientHealth
from varlen_workbench.workbench.instruments.nantrace import trace_nans
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.instruments.tinylm import LMConfig, SyntheticTask, TinyLM, train
from varlen_workbench.workbench.postmortem import (
    Results,
    latest_gpu_record,
    table,
)
from varlen_workbench.workbench.sweeps import SweepResult

# Three sequences packed back to back in a buffer with trailing rows: a static token budget.
TRAIN_SEQLENS = ((12, 7, 10), (9, 14, 6))

TRAIN_CONFIG = LMConfig(vocab=24, dim=32, heads=2, layers=1, seed=0)

# The gradient-norm explorer: trailing rows of the token budget (the first value is what the
# explorer opens on: one that shows the bug), steps trained per run.
NORM_PADS = (16, 0, 3, 48)

NORM_STEPS = 6


def token_budget_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, **padded_layout):
    """The replica as a varlen_attn user with a padded token budget calls it: real boundaries
    only. TinyLM describes the rows after the last real token as padding of the last sequence
    (`cu_seqlens_*_padded`); a torch-style call sees them as rows beyond cu_seqlens[-1]."""
    return replica_varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=causal)


TRAIN_ATTENTION = {"replica": token_budget_attention, "fixed": varlen_attention_triton}


def budget_batches(pad: int, steps: int, seed: int = 0):
    """`steps` training batches (TRAIN_SEQLENS in turn) with `pad` trailing rows, and an eval batch."""
    task = SyntheticTask(vocab=TRAIN_CONFIG.vocab, seed=seed)

    def batch(seqlens):
        return task.batch(seqlens, tail_align=sum(seqlens) + pad) if pad else task.batch(seqlens)

    return [batch(TRAIN_SEQLENS[i % len(TRAIN_SEQLENS)]) for i in range(steps)], batch((11, 16))


@dataclass
class TrainingStudy:
    runs: dict[str, Any]  # impl -> tinylm.TrainingRun (losses per step)
    monitors: dict[str, GradientHealth]  # impl -> the gradient health monitor of that run
    culprit: Any  # nantrace.Culprit of the replica's first step (None if nothing went non-finite)


def training(steps: int = 2) -> TrainingStudy:
    """The tiny packed LM trained with the replica and with the fixed kernel, memory poisoned
    (NaN). CPU only: `varlen_workbench.workbench.instruments.tinylm` builds its model and batches on the CPU."""
    batches, eval_batch = budget_batches(pad=3, steps=steps)
    runs, monitors = {}, {}
    with poisoned_memory():
        for name in ("replica", "fixed"):
            runs[name], monitors[name] = train(
                name, batches, eval_batch, config=TRAIN_CONFIG, attention=TRAIN_ATTENTION[name], monitor_factory=GradientHealth
            )
            monitors[name].close()
        model = TinyLM(TRAIN_CONFIG, TRAIN_ATTENTION["replica"])
        with trace_nans(model) as trace:
            model.loss(batches[0]).backward()
    return TrainingStudy(runs, monitors, trace.culprit)


def gradient_norms(pads: tuple[int, ...] = NORM_PADS, steps: int = NORM_STEPS) -> dict[int, dict[str, GradientHealth]]:
    """Per trailing pad, the gradient health monitors of the tiny LM trained with the replica
    and with the fixed kernel on the same batches, the replica's unwritten rows holding finite
    stale values (`stale_memory()`): nothing turns NaN, the norms just grow. CPU only."""
    studies = {}
    for pad in pads:
        batches, eval_batch = budget_batches(pad, steps)
        monitors = {}
        for label, name in (("varlen_attn replica", "replica"), ("fixed kernel", "fixed")):
            with stale_memory(scale=1.0, seed=pad):
                _, monitors[label] = train(
                    name,
                    batches,
                    eval_batch,
                    config=TRAIN_CONFIG,
                    attention=TRAIN_ATTENTION[name],
                    monitor_factory=GradientHealth,
                )
            monitors[label].close()
        studies[pad] = monitors
    return studies


QKV = "blocks.0.qkv.weight"


def norm_inflation(monitors: dict[str, GradientHealth], param: str = QKV) -> float:
    """Largest ratio, over steps, of the replica's gradient norm of `param` to the fixed kernel's."""
    buggy, fixed = monitors["varlen_attn replica"].norms(param), monitors["fixed kernel"].norms(param)
    return max(b / f for b, f in zip(buggy, fixed))


NORM_PARAMS = ("blocks.0.qkv.weight", "blocks.0.proj.weight", "blocks.0.mlp.0.weight", "embed.weight")


def gradient_norm_explorer(studies: dict[int, dict[str, GradientHealth]]):
    """A slider over trailing rows: per-parameter gradient norms over training, replica beside fixed."""
    from varlen_workbench.workbench.instruments.explorer import explore
    from varlen_workbench.workbench.plots import plot_health

    def frame(trailing_rows: int):
        title = f"{trailing_rows} trailing rows, stale finite memory"
        return plot_health(studies[trailing_rows], params=list(NORM_PARAMS), title=title)

    return explore(frame, trailing_rows=sorted(studies))  # slider values in order


@dataclass
class TorchVarlenResults(Results):
    seed: dict[str, Any]  # seed_input_problems()
    corrected: dict[str, dict[str, Any]]  # corrected_repro with the replica: "poisoned" and "stale"
    sweep: SweepResult  # run_sweep()
    workarounds: list[dict[str, Any]]  # workaround_checks(replica) on STUDY, poisoned
    damage: dict[str, Any]  # qkv_damage(replica), stale finite memory
    check: CheckAssessment
    training: TrainingStudy | None  # None where the Triton kernels are compiled (a GPU machine)
    norms: dict[int, dict[str, GradientHealth]] | None  # gradient_norms(); None on a GPU machine
    gpu: dict[str, Any] | None  # latest_gpu_record(META, "points"): torch's own varlen_attn on a GPU
    gpu_damage: dict[str, Any] | None = None  # latest_gpu_record(META, "damage"): the QKV damage and workaround timings
    window: WindowFinding | None = None  # window_finding(): the fuzzer's REAL-row failure in the audit matrix's record
    keywords: dict[str, str] = dataclasses.field(default_factory=dict)  # swap_in_keywords(): our varlen_attn's later keywords

    def at(self, impl: str, seqlens_q: tuple[int, ...] = STUDY.seqlens_q, tail_q: int = STUDY.tail_q):
        return record_at(self.sweep, impl, seqlens_q, tail_q)

    def summary(self) -> dict[str, Any]:
        """What a record keeps: counts and verdicts, not monitors or tensors."""
        return {
            "seed": self.seed,
            "corrected": self.corrected,
            "sweep": [{k: v for k, v in p.items() if k != "record"} for p in self.sweep],
            "workarounds": self.workarounds,
            "damage": self.damage,
            "check": dataclasses.asdict(self.check),
        }


def reproduce(device: str | torch.device | None = None) -> TorchVarlenResults:
    small = dict(seqlens=STUDY.seqlens_q, heads=STUDY.heads, head_dim=STUDY.head_dim, dtype=STUDY.torch_dtype, device=device)
    on_cpu = torch.device(default_device() if device is None else device).type == "cpu"  # where the tiny LM trains
    corrected = {}
    with poisoned_memory():
        corrected["poisoned"] = corrected_repro(replica_varlen_attn, **small)
    with stale_memory():
        corrected["stale"] = corrected_repro(replica_varlen_attn, **small)
    return TorchVarlenResults(
        seed=seed_input_problems(),
        corrected=corrected,
        sweep=run_sweep(device),
        workarounds=workaround_checks(replica_varlen_attn, STUDY, device),
        damage=qkv_damage(replica_varlen_attn, device=device),
        check=assess_proposed_check(device),
        training=training() if on_cpu else None,
        norms=gradient_norms() if on_cpu else None,
        gpu=latest_gpu_record(META, "points"),
        gpu_damage=latest_gpu_record(META, "damage"),
        window=window_finding(),
        keywords=swap_in_keywords(),
    )


def workaround_evidence(results: TorchVarlenResults, prefix: str):
    """One workaround (name starting with `prefix`): the replica on this machine, and torch's
    varlen_attn from the GPU record when there is one, with its time relative to varlen_attn as is:
    one median ratio per GPU run that timed it (its fastest call and its number of calls where the
    run recorded them), so two runs' different answers are both on the page."""

    def tail(p):
        if "error" in p:
            return p["error"][:60]
        if p["tail_nonfinite"]:
            return f"{p['tail_nonfinite']} non-finite"
        return "exactly 0" if p["tail_zero"] else f"finite, max |x| {p['tail_max_abs']:.3g}"

    sources: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]] = [
        ("replica (CPU, interpreter)", results.workarounds, [], [])
    ]
    if results.gpu:
        timed = [r["probes"] for r in (results.gpu_damage, results.gpu) if r is not None]
        small = [{t["workaround"]: t for t in probes["timing"]} for probes in timed if probes.get("timing")]
        large = [{t["workaround"]: t for t in probes["timing_large"]} for probes in timed if probes.get("timing_large")]
        where = f"varlen_attn ({results.gpu['provenance'].get('device', 'GPU')})"
        sources.append((where, results.gpu["probes"]["workarounds"], small, large))

    def ratio(runs: list[dict[str, Any]], name: str) -> str:
        return "; ".join(_ratio(run[name], run["as is"]) for run in runs if name in run) or "not timed"

    rows = []
    for where, points, small, large in sources:
        for p in points:
            if p["workaround"].startswith(prefix):
                within = "" if "error" in p else ("yes" if p["real_within_bound"] else "NO")
                name = p["workaround"]
                rows.append((where, p["loss"], tail(p), within, ratio(small, name), ratio(large, name)))
    header = ("run", "loss reads", "TAIL rows of out, dq, dk, dv (poisoned)", "REAL rows within bound")
    return table(
        header + ("time vs as is, 944 tokens", "time vs as is, 8x2048 tokens"),
        rows,
        title="time: forward+backward, median ratio to varlen_attn as is, one per H200 run that timed it "
        "(with the fastest call's ratio and the number of calls where the run recorded them)",
    )


def _ratio(timing: dict[str, Any], as_is: dict[str, Any]) -> str:
    """'1.16x', or '1.16x (fastest 1.10x, 20 calls)' from a run that recorded them; a run's error as it said it."""
    if "vs_as_is" not in timing:
        return timing.get("error", "missing")[:40]
    said = f"{timing['vs_as_is']:.2f}x"
    if "min_ms" in timing and "min_ms" in as_is:
        said += f" (fastest {timing['min_ms'] / as_is['min_ms']:.2f}x, {timing['iters']} calls)"
    return said
