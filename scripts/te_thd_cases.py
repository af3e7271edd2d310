"""TransformerEngine on the report of NVIDIA/TransformerEngine#2892: its script and the cases it meant, each in its own process.

    python3 scripts/te_thd_cases.py --record $OUT/te-thd-2892-cases-h200.json [--jobs 4] [--only NAME,...]

Runs, on the GPU machine with TE installed (docs/gpu-transformer-engine.md), what
postmortems/te_thd_2892/upstream.py describes: the report's script as written and with each of
its slips mended in turn, then every recipe x boundaries case on the report's shapes. Each is a
child process with TE's debug log on, `--jobs` at a time; a child killed by a signal is recorded
as such ("outcome": "killed", "signal": "SIGSEGV"), with the backend its log had named. The record
(varlen_workbench.workbench.records, with provenance) holds one entry per run, rewritten as each run ends (marked
`partial` until the last), so a call cut short keeps what finished; a summary line per run is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from varlen_workbench.postmortems.te_thd_2892.upstream import REPORT, SLIPS, run_script, spawn, te_cases


def summary(run: dict) -> str:
    """One line: what ran, how it ended, what raised or what it measured, the backend."""
    name = run.get("case") or f"script, mended: {','.join(run['mended']) or 'none'}"
    ended = run["outcome"] + (f" {run.get('signal') or run.get('code', '')}" if run["outcome"] != "timed out" else "")
    backend = ", ".join(run["backend"]["selected"] or run["backend"]["running"]) or "no backend named"
    said = run.get("error") or ""
    contract = run.get("contract") or {}
    if not said and contract:
        said = f"ran {contract.get('ran')}, REAL rows within bound: {contract.get('real_within_bound')}"
        said += f", padding zero: {contract.get('padding_exactly_zero')}"
        said += f", TE's out {run.get('te_output_shapes')}"
    return f"{name:<28} {ended:<16} {backend:<36} {said}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, help="write the runs here as JSON with provenance")
    parser.add_argument("--jobs", type=int, default=4, help="child processes at once (default 4)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a child may take (default 300)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", help="only these cases (recipe:boundaries, comma-separated); no script runs")
    args = parser.parse_args()
    cases = te_cases()
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {c.name for c in cases})
        if unknown:
            print(f"te_thd_cases: --only {unknown} are not cases: {[c.name for c in cases]}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c.name in wanted]
    scripts = [] if args.only else list(range(len(SLIPS) + 1))
    command = shlex.join(["python3", "scripts/te_thd_cases.py", *sys.argv[1:]])
    done: dict[tuple[str, int | str], dict] = {}

    def record(partial: bool) -> None:
        """The runs finished so far, in table order (`partial` until the last): a call killed at
        its time limit keeps them."""
        if not args.record:
            return
        from varlen_workbench.workbench.records import write_record

        payload = {
            "report": REPORT,
            "slips": [dataclasses.asdict(s) for s in SLIPS],
            "script_runs": [done[("script", m)] for m in scripts if ("script", m) in done],
            "case_runs": [done[("case", c.name)] for c in cases if ("case", c.name) in done],
            "partial": partial,
        }
        write_record(args.record, payload, command=command)

    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_script, m, args.timeout): ("script", m) for m in scripts}
        futures |= {pool.submit(spawn, c, args.device, args.timeout): ("case", c.name) for c in cases}
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            print(summary(done[futures[future]]), flush=True)
            record(partial=True)
    record(partial=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
