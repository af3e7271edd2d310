"""TransformerEngine's sequence-parallel block on two ranks: the report's all-gather claim on TE itself.

    python3 scripts/te_seqpar.py --device cuda --record $OUT/te-thd-2892-seqpar-h100.json [--only bf16:different] [--timeout 240]

On a GPU machine with two GPUs and TE installed (docs/gpu-transformer-engine.md), runs what
postmortems/te_thd_2892/seqpar_te.py describes, one configuration at a time (BF16 and DelayedScaling
GEMMs, the boundaries different and equal): two ranks over NCCL, one GPU each, and the same block
on one process, each a child process with --timeout seconds, so that a crash or a hang is recorded
with how the child ended and the stage it had reached. `--device cpu` runs the same over gloo
(the tests run it through the TE stand-in, tests/data/fake_te).

The record (varlen_workbench.workbench.records, with provenance) is rewritten as each configuration ends, `partial`
until the last, so a call cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from varlen_workbench.postmortems.te_thd_2892.seqpar_te import MULTICAST_OFF, SP_CASES, TP, run_config, sp_case, summary
from varlen_workbench.postmortems.te_thd_2892.upstream import REPORT_CASE
from varlen_workbench.workbench.layout import Case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, help="write the results here as JSON with provenance")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: NCCL, one GPU a rank; cpu: gloo")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a configuration's processes may take (default 300)")
    names = [c.name for c in SP_CASES]
    parser.add_argument("--only", help=f"comma-separated, of {names} (default: all)")
    parser.add_argument(
        "--case", help="the layout as JSON of varlen_workbench.workbench.layout.Case's fields (default: the report's)"
    )
    args = parser.parse_args()
    only = args.only.split(",") if args.only else names
    unknown = sorted(set(only) - set(names))
    if unknown:
        print(f"te_seqpar: --only {unknown} are not configurations: {names}", file=sys.stderr)
        return 2
    try:
        case = Case(**json.loads(args.case)) if args.case else REPORT_CASE
    except (TypeError, ValueError) as exc:
        print(
            f"te_seqpar: --case {args.case!r} is not a Case as JSON ({exc}); e.g. {json.dumps(REPORT_CASE.to_dict())}",
            file=sys.stderr,
        )
        return 2
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < TP:
            print(f"te_seqpar: --device cuda needs {TP} GPUs, this machine has {torch.cuda.device_count()}", file=sys.stderr)
            return 2
    command = shlex.join(["python3", "scripts/te_seqpar.py", *sys.argv[1:]])
    runs: list[dict] = []

    def record(partial: bool) -> None:
        if not args.record:
            return
        from varlen_workbench.workbench.records import write_record

        config = {"device": args.device, "tp": TP, "case": case.to_dict(), "env": MULTICAST_OFF, "timeout": args.timeout}
        write_record(args.record, {"config": config, "runs": runs, "partial": partial}, command=command)

    for name in only:
        runs.append(run_config(sp_case(name, case), args.device, args.timeout))
        print(summary(runs[-1]), flush=True)
        record(partial=True)
    record(partial=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
