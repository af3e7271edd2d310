"""The perplexity claim of NVIDIA/TransformerEngine#2892 at small scale, through TransformerEngine's own attention (GPU).

    python3 scripts/te_thd_training.py --record $OUT/te-thd-2892-training-h200.json [--dim 128] [--steps 60]

The report: VERL pads packed sequences for FP8 alignment and passes cu_seqlens = cu_seqlens_padded;
training perplexity went from 3.7 to 3055 with FP8, to 6.6 with the padding alone in BF16. Here
the post-mortem's toy (postmortems/te_thd_2892/training.py: a 2-layer model on packed synthetic
sequences, each padded to a multiple of 16 rows) trains with its attention through TE's
DotProductAttention on the GPU (`on_device`: the rest of the model stays on the CPU in float32),
the boundaries kept apart and made identical (`boundary_runs`), causal (next-token) and
bidirectional (masked tokens, `train_bidirectional`), in BF16 and in FP8 attention
(DelayedScaling(fp8_dpa=True)); beside them the same runs through the replica (`dense_attention`,
CPU, float32). TE's module is built for each call, as the audit matrix builds it
(varlen_workbench.workbench.audit.adapters.te): calls stay independent, and DelayedScaling runs every call at its
initial scale (no amax history), which a model keeping its modules would refine over steps. The
FP8 here is attention's only: the toy's linear layers stay torch's, in float32.

Recorded per run (varlen_workbench.workbench.records, with provenance): the loss and the global gradient norm at
every step, the held-out loss and perplexity (judged with the correct boundaries), its time; a
run that raises is recorded with the error, and the others still run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from varlen_workbench.postmortems.te_thd_2892.cases import BIDIRECTIONAL_STEPS, TRAIN_STEPS
from varlen_workbench.postmortems.te_thd_2892.training import boundary_runs, global_grad_norms, on_device, train_bidirectional
from varlen_workbench.workbench.instruments.tinylm import dense_attention

BOUNDARIES = {"correct": "separate", "workaround": "identical"}  # the toy's run names -> what attention is given


def te_attention(recipe, device: str = "cuda"):
    """TE's DotProductAttention behind the contract's call, on `device` in BF16, under `recipe` (None: no FP8)."""
    from varlen_workbench.workbench.audit import adapt
    from varlen_workbench.workbench.audit.adapters.te import with_recipe

    return on_device(adapt(with_recipe(recipe), "te-thd", device), device, torch.bfloat16)


def _runs(attention_name: str, objective: str, train_runs, attention) -> list[dict]:
    """`train_runs(attention)` (both boundaries) as records; an error is recorded, not raised."""
    began = time.perf_counter()
    try:
        runs = train_runs(attention)
    except Exception as exc:
        return [{"attention": attention_name, "objective": objective, "error": f"{type(exc).__name__}: {exc}"}]
    seconds = round(time.perf_counter() - began, 1)
    records = []
    for name, (run, monitor) in runs.items():
        records.append(
            {
                "attention": attention_name,
                "objective": objective,
                "boundaries": BOUNDARIES[name],
                "losses": run.losses,
                "grad_norms": global_grad_norms(monitor) if monitor is not None else None,
                "final_loss": run.final_loss,
                "eval_loss": run.eval_loss,
                "eval_perplexity": run.eval_perplexity,
                "seconds_both_runs": seconds,
            }
        )
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, help="write the runs here as JSON with provenance")
    parser.add_argument("--dim", type=int, default=128, help="model width; 2 heads of dim / 2 (default 128: head dim 64)")
    parser.add_argument("--steps", type=int, default=TRAIN_STEPS, help=f"causal training steps (default {TRAIN_STEPS})")
    parser.add_argument("--bidirectional-steps", type=int, default=BIDIRECTIONAL_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("replica", "te-bf16", "te-fp8"), help="only this attention")
    args = parser.parse_args()
    from varlen_workbench.workbench.audit.adapters.te import fp8_delayed_recipe

    attentions = {
        "replica": lambda: dense_attention,
        "te-bf16": lambda: te_attention(None),
        "te-fp8": lambda: te_attention(fp8_delayed_recipe()),
    }
    config = {
        "dim": args.dim,
        "heads": 2,
        "steps": args.steps,
        "bidirectional_steps": args.bidirectional_steps,
        "seed": args.seed,
    }
    command = shlex.join(["python3", "scripts/te_thd_training.py", *sys.argv[1:]])
    records: list[dict] = []
    for name, make in attentions.items():
        if args.only and name != args.only:
            continue
        attention = make()
        for objective, train_runs in (
            ("causal", lambda a: boundary_runs(a, args.steps, args.seed, dim=args.dim)),
            (
                "bidirectional",
                lambda a: train_bidirectional(args.bidirectional_steps, args.seed, attention=a, dim=args.dim, monitor=True),
            ),
        ):
            runs = _runs(name, objective, train_runs, attention)
            for r in runs:
                print(_line(r), flush=True)
            records += runs
            if args.record:  # rewritten after each pair of runs: a call cut short keeps them
                from varlen_workbench.workbench.records import write_record

                write_record(args.record, {"config": config, "runs": records}, command=command)
    return 0


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['attention']:<8} {r['objective']:<13} ERROR {r['error']}"
    return (
        f"{r['attention']:<8} {r['objective']:<13} {r['boundaries']:<9} final loss {r['final_loss']:.4f}  "
        f"held-out ppl {r['eval_perplexity']:.3f}  last grad norm {(r['grad_norms'] or [float('nan')])[-1]:.3g}"
    )


if __name__ == "__main__":
    sys.exit(main())
