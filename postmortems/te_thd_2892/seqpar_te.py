"""TransformerEngine under sequence parallelism: the report's second claim run on TE itself (two GPUs, NCCL).

The report says that with sequence_parallel=True a column-parallel Linear sizes its all-gather
by cu_seqlens_q: with cu_seqlens_q != cu_seqlens_q_padded the gathered tensor would have the
unpadded size, and the layers after it, which expect the padded size, would break. TE 2.20.2's
Linear is never given cu_seqlens (module/linear.py, layernorm_linear.py and distributed.py of the
release never mention it): `gather_along_first_dim` (distributed.py) sizes its output as the local
tensor's rows times the group's size. This module runs the question on TE.

The block, one attention layer built from TE's modules as Megatron-Core builds it, on each rank:

    qkv   te.Linear(hidden, 3 x hidden, parallel_mode="column", sequence_parallel=True, tp_group, tp_size)
    attn  te.DotProductAttention(heads, head_dim, qkv_format="thd", attn_mask_type="padding_causal",
          tp_group, ...): this rank's heads, given cu_seqlens_q/kv (real), cu_seqlens_q/kv_padded
          (padded) and max_seqlen_q/kv, as TE documents them
    proj  te.Linear(hidden, hidden, parallel_mode="row", sequence_parallel=True, tp_group, tp_size)

Each of the `TP` ranks holds its contiguous 1/TP share of the packed rows (the padded layout:
544 / 2 = 272 on the report's shapes). The weights are split as TE and Megatron-Core shard them:
the column-parallel qkv by out_features (laid out [q k v] per head, so a rank's rows are its heads'
q, k and v), the row-parallel proj by in_features. Hooks record the rows each layer saw: the
column-parallel Linear's output (its gathered rows), attention's and the row-parallel Linear's
input. The ranks' output, input gradient and weight gradients, reassembled, are judged against the
block in fp64 with the FlashAttention-style bound (`varlen_workbench.workbench.bounds.error_check`), the same block
on one process (tp_size 1, the whole weights) giving the baseline error: REAL rows for the output
and the input gradient, every entry of the weight gradients (padding rows are zero in x and in
dY, a loss over REAL tokens).

`SP_CASES`: GEMMs in BF16 and under DelayedScaling (attention stays BF16: TE 2.20.2 refuses FP8
THD attention below cuDNN 9.23, data/gpu/te-thd-2892-cases-*.json), boundaries `different` (real
and padded) and `equal` (VERL's: the padded tensor passed as both). `run_config` runs one as TP + 1
child processes (the ranks, over NCCL on GPU or gloo on CPU, and the one-process block), each with
a timeout, so that a crash or a hang is a finding (`upstream.outcome`), with TE's debug log.
scripts/te_seqpar.py runs them all and records the result.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from varlen_workbench.postmortems.te_thd_2892.te_probes import GEMM_STEPS, packed_activations
from varlen_workbench.postmortems.te_thd_2892.upstream import (
    RECIPES,
    REPORT_CASE,
    RESULT,
    TeCase,
    _error,
    _run,
    backend_log,
    child_env,
    outcome,
    printed,
    raised,
)
from varlen_workbench.workbench.bounds import error_check
from varlen_workbench.workbench.instruments.seqpar import _free_port, shard
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.reference import reference_attention

TP = 2
SP_BOUNDARIES = ("different", "equal")
SP_CASES = tuple(TeCase(r, b) for r in RECIPES if r.name in ("bf16", "delayed") for b in SP_BOUNDARIES)
# NVLink multicast off in every child: the device machines require it, and two ranks gain nothing from it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# What the hooks record, per step: rows out of the column-parallel Linear (its gathered input's rows),
# into attention (q), into and out of the row-parallel Linear.
OBSERVED = ("qkv_out_rows", "attention_rows", "proj_in_rows", "proj_out_rows")
# The tensors judged: the block's output and input gradient on REAL rows, the weight gradients whole.
JUDGED = ("out", "dx", "dw_qkv", "dw_proj")
REFERENCE = "reference"  # the child running the block on one process
STAGE = "TE_SEQPAR_STAGE "  # a child's stderr line as it enters a stage: a child killed on timeout still says where it was


class Stage:
    """Where a child is, kept for its result and said on stderr for the parent (`reached`)."""

    def __init__(self) -> None:
        self.now = "import"

    def enter(self, now: str) -> None:
        self.now = now
        print(STAGE + now, file=sys.stderr, flush=True)


def reached(stderr: str) -> str | None:
    """The last stage a child entered, from its stderr."""
    stages = [line[len(STAGE) :] for line in stderr.splitlines() if line.startswith(STAGE)]
    return stages[-1] if stages else None


def sp_case(name: str, case: Case = REPORT_CASE) -> TeCase:
    """The configuration of SP_CASES called `name` ('bf16:different'), on `case`'s layout."""
    found = {c.name: c for c in SP_CASES}
    if name not in found:
        raise ValueError(f"{name!r} is not a sequence-parallel configuration: {list(found)}")
    return TeCase(found[name].recipe, found[name].boundaries, case)


def make_job(te_case: TeCase, seed: int = 0) -> dict[str, Any]:
    """The inputs every child loads: x (padded layout, BF16, padding rows 0), the block's whole
    weights, dY (0 on padding rows), the boundaries and which of them attention is given."""
    if te_case.boundaries not in SP_BOUNDARIES:
        raise ValueError(f"boundaries = {te_case.boundaries!r}: the sequence-parallel run takes {SP_BOUNDARIES}.")
    case = te_case.case
    hidden = case.heads * case.head_dim
    x, real = packed_activations(case, "zeros", hidden, seed)
    shard(x, 0, TP)  # raises, naming the fix, when the rows do not split evenly over the ranks
    batch = pack(case.with_(heads=1, head_dim=8), "cpu", requires_grad=False)
    generator = torch.Generator().manual_seed(seed + 1)
    w_qkv = torch.randn(3 * hidden, hidden, generator=generator) / hidden**0.5
    w_proj = torch.randn(hidden, hidden, generator=generator) / hidden**0.5
    dy = torch.where(real[:, None], torch.randn(x.shape, generator=generator), 0.0)
    return {
        "case": te_case.to_json(),
        "x": x,
        "real": real,
        "w_qkv": w_qkv.to(torch.bfloat16),
        "w_proj": w_proj.to(torch.bfloat16),
        "dy": dy.to(torch.bfloat16),
        "cu_seqlens": batch.cu_seqlens_q,
        "cu_seqlens_padded": batch.cu_seqlens_q_padded,
        "max_seqlen": max(case.real_lengths("q")),
        "max_seqlen_padded": max(case.padded_lengths("q")),
        "tp": TP,
        "steps": GEMM_STEPS,  # DelayedScaling scales a step by the amax history of the steps before it
    }


def attention_kwargs(job: dict[str, Any], device) -> dict[str, Any]:
    """The boundaries as attention is given them: real and padded (`different`), or the padded
    tensor passed as both (`equal`, VERL's workaround: one object, as VERL passes it)."""
    padded = job["cu_seqlens_padded"].to(device)
    equal = TeCase.from_json(job["case"]).boundaries == "equal"
    real = padded if equal else job["cu_seqlens"].to(device)
    longest = job["max_seqlen_padded" if equal else "max_seqlen"]
    return {
        "cu_seqlens_q": real,
        "cu_seqlens_kv": real,
        "cu_seqlens_q_padded": padded,
        "cu_seqlens_kv_padded": padded,
        "max_seqlen_q": longest,
        "max_seqlen_kv": longest,
    }


# -- in a child ---------------------------------------------------------------------------------


class TeBlock(torch.nn.Module):
    """qkv (column-parallel) -> DotProductAttention on this rank's heads (THD) -> proj (row-parallel),
    from TE's modules `te`; sequence-parallel when tp_size > 1 (TE turns it off at tp_size 1)."""

    def __init__(self, te, case: Case, tp_group, tp_size: int, device) -> None:
        super().__init__()
        hidden, self.head_dim = case.heads * case.head_dim, case.head_dim
        parallel = {"sequence_parallel": tp_size > 1, "tp_group": tp_group, "tp_size": tp_size}
        weights = {"bias": False, "params_dtype": torch.bfloat16, "device": device}
        self.qkv = te.Linear(hidden, 3 * hidden, parallel_mode="column", **parallel, **weights)
        self.attention = te.DotProductAttention(
            case.heads, case.head_dim, qkv_format="thd", attn_mask_type="padding_causal", **parallel
        )
        self.proj = te.Linear(hidden, hidden, parallel_mode="row", **parallel, **weights)

    def forward(self, x: torch.Tensor, attention: dict[str, Any]) -> torch.Tensor:
        qkv = self.qkv(x)
        # Contiguous q, k, v (TE's thd_thd_thd layout): views of qkv would lean on TE's deprecated pointer detection.
        q, k, v = (t.contiguous() for t in qkv.view(qkv.shape[0], -1, 3, self.head_dim).unbind(2))
        out = self.attention(q, k, v, qkv_format="thd", attn_mask_type="padding_causal", **attention)
        return self.proj(out)


def _watch(block: TeBlock, seen: dict[str, list[int]]) -> None:
    """Hooks appending, per forward, the rows each layer of `block` gave or got."""
    block.qkv.register_forward_hook(lambda m, args, out: seen["qkv_out_rows"].append(out.shape[0]))
    block.attention.register_forward_pre_hook(lambda m, args: seen["attention_rows"].append(args[0].shape[0]))
    block.proj.register_forward_pre_hook(lambda m, args: seen["proj_in_rows"].append(args[0].shape[0]))
    block.proj.register_forward_hook(lambda m, args, out: seen["proj_out_rows"].append(out.shape[0]))


def _steps(te, job, recipe, device, group, rank: int, seen, stage: Stage) -> dict[str, torch.Tensor]:
    """The block's steps on this process's rows (all of them at tp_size 1): its last output and gradients."""
    tp = 1 if group is None else job["tp"]
    block = TeBlock(te, TeCase.from_json(job["case"]).case, group, tp, device)
    with torch.no_grad():  # this rank's shards: qkv by out_features, proj by in_features
        block.qkv.weight.copy_(job["w_qkv"].chunk(tp, 0)[rank])
        block.proj.weight.copy_(job["w_proj"].chunk(tp, 1)[rank])
    _watch(block, seen)
    x, dy = (shard(job[name], rank, tp).to(device) for name in ("x", "dy"))
    attention = attention_kwargs(job, device)
    for step in range(job["steps"]):
        block.zero_grad(set_to_none=True)
        leaf = x.detach().clone().requires_grad_()
        stage.enter(f"forward, step {step}")
        # Amax reduced over the tensor-parallel group, as Megatron-Core sets it.
        with te.autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=group):
            y = block(leaf, attention)
        stage.enter(f"backward, step {step}")
        y.backward(dy)
    assert leaf.grad is not None and block.qkv.weight.grad is not None and block.proj.weight.grad is not None
    grads = (leaf.grad, block.qkv.weight.grad, block.proj.weight.grad)
    return {name: t.detach().cpu() for name, t in zip(JUDGED, (y, *grads))}


def _versions(te, device: str) -> dict[str, str]:
    found = {n: importlib.metadata.version(n) for n in ("transformer-engine", "torch")}
    found["cudnn"] = ".".join(str(x) for x in te.get_cudnn_version())
    if device == "cuda":
        found["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    return found


def run_block(workdir: Path, who: str, device: str) -> dict[str, Any]:
    """In a child: the block as `who` runs it ('reference': one process; '0', '1': a rank of the
    group), its tensors saved to workdir/<who>.pt; returns the rows it saw, versions, any error."""
    import torch.distributed as dist

    from varlen_workbench.workbench.audit.adapters.te import _recipes, _te
    from varlen_workbench.workbench.instruments.seqpar import process_group

    job = torch.load(workdir / "job.pt", weights_only=False)
    seen: dict[str, list[int]] = {name: [] for name in OBSERVED}
    result: dict[str, Any] = {"who": who, "observed": seen, "env": {name: os.environ.get(name) for name in MULTICAST_OFF}}
    stage = Stage()
    try:
        stage.enter("import")
        te = _te()
        result["versions"] = _versions(te, device)
        stage.enter("recipe")
        recipe = TeCase.from_json(job["case"]).recipe.build(_recipes())
        if who == REFERENCE:
            tensors = _steps(te, job, recipe, torch.device(device), None, 0, seen, stage)
        else:
            stage.enter("process group")
            backend = "nccl" if device == "cuda" else "gloo"
            with process_group(int(who), job["tp"], job["port"], backend, job["timeout"], device) as where:
                group = dist.new_group(list(range(job["tp"])))
                tensors = _steps(te, job, recipe, where, group, int(who), seen, stage)
        stage.enter("saved")
        torch.save(tensors, workdir / f"{who}.pt")
    except Exception as exc:  # recorded with the stage it reached: a finding, not a lost run
        result.update(stage=stage.now, error=_error(exc), traceback=traceback.format_exc().splitlines()[-6:])
    result["observed"] = {name: list(dict.fromkeys(rows)) for name, rows in seen.items()}
    return result


def child(workdir: str, who: str, device: str) -> None:
    """A child's entry point (`run_config`): run the block as `who`, print the result after RESULT."""
    import json

    print(RESULT + json.dumps(run_block(Path(workdir), who, device)), flush=True)


# -- in the parent ------------------------------------------------------------------------------


def _child(workdir: Path, who: str, device: str, timeout: float, env: dict[str, str] | None) -> dict[str, Any]:
    code = "import sys\nfrom varlen_workbench.postmortems.te_thd_2892.seqpar_te import child\nchild(*sys.argv[1:])\n"
    rc, out, err, seconds = _run(
        [sys.executable, "-c", code, str(workdir), who, device], child_env({**MULTICAST_OFF, **(env or {})}), timeout
    )
    return {
        **(printed(out) or {"who": who, **raised(err)}),
        **outcome(rc),
        "reached": reached(err),
        "seconds": round(seconds, 1),
        "backend": backend_log(err),
        "stderr_tail": [line for line in err.splitlines() if not line.startswith(STAGE)][-8:],
    }


def oracle(job: dict[str, Any], dtype: torch.dtype = torch.float64, device="cpu") -> dict[str, torch.Tensor]:
    """The block computed in `dtype` (fp64: the oracle): output, input gradient, weight gradients."""
    case = TeCase.from_json(job["case"]).case
    x, w_qkv, w_proj = (job[n].to(device, dtype).requires_grad_() for n in ("x", "w_qkv", "w_proj"))
    qkv = x @ w_qkv.T
    q, k, v = (t.contiguous() for t in qkv.view(qkv.shape[0], -1, 3, case.head_dim).unbind(2))
    boundaries = attention_kwargs(job, device)
    out = reference_attention(
        q,
        k,
        v,
        boundaries["cu_seqlens_q"],
        boundaries["cu_seqlens_kv"],
        boundaries["max_seqlen_q"],
        boundaries["max_seqlen_kv"],
        cu_seqlens_q_padded=boundaries["cu_seqlens_q_padded"],
        cu_seqlens_k_padded=boundaries["cu_seqlens_kv_padded"],
        causal=True,
        compute_dtype=dtype,
    )
    y = out.flatten(1) @ w_proj.T
    y.backward(job["dy"].to(device, dtype))
    grads = (x.grad, w_qkv.grad, w_proj.grad)
    return {name: t.detach().cpu() for name, t in zip(JUDGED, (y, *grads))}


def assemble(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ranks' tensors as one process holds them: rows concatenated (out, dx), qkv's weight
    gradient by out_features, proj's by in_features."""
    dims = {"out": 0, "dx": 0, "dw_qkv": 0, "dw_proj": 1}
    return {name: torch.cat([s[name] for s in shards], dims[name]) for name in JUDGED}


def judge(job: dict[str, Any], value: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor], exact) -> dict[str, Any]:
    """Each of JUDGED in `value` (the ranks') against `exact` (fp64), within the FlashAttention-style
    bound of `baseline`'s (one process) error: REAL rows of out and dx, all of the weight gradients."""
    case = TeCase.from_json(job["case"]).case
    rows = job["real"]
    # The dots each tensor sums: features for out and dx, packed rows for the weight gradients.
    dots = {"out": case.heads * case.head_dim, "dx": case.heads * case.head_dim, "dw_qkv": len(rows), "dw_proj": len(rows)}
    found: dict[str, Any] = {}
    for name in JUDGED:
        if value[name].shape != exact[name].shape:
            found[name] = {"error": f"shape {list(value[name].shape)}, one process's {list(exact[name].shape)}"}
            continue
        pick = (lambda t: t[rows]) if name in ("out", "dx") else (lambda t: t)
        check = error_check(
            name,
            pick(value[name]),
            pick(exact[name]),
            pick(baseline[name]),
            torch.bfloat16,
            keys=job["max_seqlen_padded"],
            queries=job["max_seqlen_padded"],
            head_dim=dots[name],
        )
        found[name] = {
            "real_error": check.error,
            "baseline": check.baseline,
            "bound": check.bound,
            "within": check.within,
            "vs_one_process": float((value[name].double() - baseline[name].double()).abs().max()),
        }
    return found


def run_config(te_case: TeCase, device: str = "cuda", timeout: float = 300, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`te_case` as TP ranks and the one-process block, each a child process with `timeout`
    seconds: how each ended, the rows each layer saw, and the ranks' tensors judged."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device = {device!r} must be 'cuda' (NCCL, one GPU a rank) or 'cpu' (gloo).")
    job = make_job(te_case)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="te-seqpar-") as directory:
        workdir = Path(directory)
        torch.save({**job, "port": _free_port(), "timeout": timeout}, workdir / "job.pt")
        whos = [REFERENCE, *(str(r) for r in range(TP))]
        with ThreadPoolExecutor(len(whos)) as pool:
            ended = dict(zip(whos, pool.map(lambda who: _child(workdir, who, device, timeout, env), whos)))
        tensors = {who: torch.load(workdir / f"{who}.pt") for who in whos if (workdir / f"{who}.pt").exists()}
    layout, real = int(job["cu_seqlens_padded"][-1]), int(job["cu_seqlens"][-1])
    ranks = [ended[str(r)] for r in range(TP)]
    result: dict[str, Any] = {
        "case": te_case.name,
        "recipe": te_case.recipe.describe(),
        "boundaries": te_case.boundaries,
        "layout_rows": layout,
        "real_rows": real,
        "shard_rows": layout // TP,
        # The column-parallel Linear's output rows on each rank: the rows its all-gather produced.
        "gathered_rows": [rank.get("observed", {}).get("qkv_out_rows") for rank in ranks],
        "padded_downstream": all(
            rank.get("observed", {}).get(name) == [layout] for rank in ranks for name in ("attention_rows", "proj_in_rows")
        ),
        "ranks": ranks,
        "reference": ended[REFERENCE],
        "tensors": None,
        "real_within_bound": False,
    }
    if len(tensors) == len(whos):
        exact = oracle(job, device="cuda" if device == "cuda" else "cpu")
        judged = judge(job, assemble([tensors[str(r)] for r in range(TP)]), tensors[REFERENCE], exact)
        result["tensors"] = judged
        result["real_within_bound"] = all(t.get("within", False) for t in judged.values())
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def summary(run: dict[str, Any]) -> str:
    """One line: the configuration, how the ranks ended, the rows gathered, the verdict."""
    ends = ", ".join(
        f"{r['outcome']} {r.get('signal') or r.get('code') or ''}".strip() for r in [*run["ranks"], run["reference"]]
    )
    error = next((r["error"] for r in [*run["ranks"], run["reference"]] if r.get("error")), "")
    verdict = "REAL rows within the bound" if run["real_within_bound"] else "NOT within the bound"
    return f"{run['case']:<18} ranks, one process: {ends}; gathered {run['gathered_rows']} of {run['layout_rows']}; {verdict} {error}"
