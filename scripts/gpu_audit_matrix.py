"""The audit matrix on a GPU, resumable: each call records the rows it finishes, the next does the rest.

    python scripts/gpu_audit_matrix.py [--rows A,B] [--force] [--deadline 545] [--jobs 4] [--workers 3]
                                       [--skip-sanitizer | --only-sanitizer]

Every row of `workbench.audit.adapters.MATRIX` whose record is not complete
(`workbench.audit.matrix.complete`: it ran, no cell is "not run", and its fuzzer tried
FUZZ_LAYOUTS layouts, or fuzzed for FUZZ_SECONDS where one layout takes over SLOW_LAYOUT s)
is audited again, every row with `--force`:

    python -m workbench.cli audit TARGET [--adapter A] --device cuda --budget 1000 --time-limit T
        --workers W --check-timeout 150 --record data/gpu/audit-<row>.json

On CUDA the audit runs each check and fuzz batch in a child process replaced after a CUDA
error, a crash or the check's time limit (`workbench.audit.isolate`), so one fault costs one
cell. Rows `--jobs` at a time, slow ones first (over SLOW_LAYOUT s a layout in their last
record, or never recorded). A slow row is audited in two calls, its checks (`--budget 0`) and
then its fuzzer alone (`--skip` every check, merged into the checks' record with its own
provenance as `fuzz_provenance`), so that FUZZ_SECONDS of fuzzing and the checks each fit in a
call. A row starts only if MIN_ROW_SECONDS are left before `--deadline`, so a call ends inside
the device's 10-minute limit. A row's record replaces the earlier one only once written whole; a path that cannot run
at all (its package missing) records why (`"ran": false`, with the command's last lines) unless
an earlier record of it ran. The record says which fuzzing budget it met (`fuzz_budget`).

Then compute-sanitizer, beside the audits: each row's forward + backward
(`scripts/audit_sanitize.py ROW`) under initcheck and memcheck, and racecheck where its kernels
accumulate with atomics (RACECHECK), with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so each tensor is its
own allocation; each log is parsed (`workbench.audit.sanitizer.parse`) and the row's runs go to
data/gpu/sanitizer-<row>.json, skipped next time once every tool's run counts. A summary comes
last, with the rows left for the next call.

Start-up, measured on the CPU (2 busy cores): a child from the fork server that has imported the
audit starts in 0.4-0.7 s; a spawned one in 6.5-10 s; the first child (the server's imports) in
8-16 s. So a replacement after a fault costs under a second, and a row's checks share one child.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workbench.audit.adapters import MATRIX  # noqa: E402
from workbench.audit.checks import CHECKS  # noqa: E402
from workbench.audit.matrix import (  # noqa: E402
    CORRECTNESS,
    FUZZ_LAYOUTS,
    FUZZ_SEARCH,
    SLOW_LAYOUT,
    cell,
    complete,
    fuzz_budget,
    ran,
)
from workbench.audit.sanitizer import NOT_APPLICABLE, ToolRun, parse, status  # noqa: E402
from workbench.records import load_records, write_record  # noqa: E402

DATA = ROOT / "data" / "gpu"
CHECK_TIMEOUT = 150  # seconds one check may take before its cell says "not run: timed out"
CHECKS_AND_SHRINK = 150  # seconds a row needs beside its fuzzing: the checks, shrinking, start-up
SHRINK_AND_START = 75  # the same for a fuzz-only run (workbench.audit.fuzz.SHRINK_SECONDS, start-up)
MIN_ROW_SECONDS = 240  # a row starts only with this much time left before the deadline
SANITIZER_TOOLS = ("initcheck", "memcheck")
# Rows whose kernels accumulate with atomics get racecheck too; a recorded determinism FAIL
# (a sum whose order varies) adds its row. Ours is the reference row, watched by every tool.
RACECHECK = {
    "ours": "the reference row",
    "torch-varlen": "FlashAttention-2's backward accumulates dq with atomic adds (Dao-AILab/flash-attention#414)",
    "sdpa-flash": "FlashAttention-2's backward accumulates dq with atomic adds (Dao-AILab/flash-attention#414)",
    "fa4": "FlashAttention-4's backward accumulates dQ in fp32 with atomic adds (dQaccum, flash_attn/cute)",
    "ours-fa4": "FlashAttention-4 behind our wrapper: its backward accumulates dQ with atomic adds",
}


def _tail(text: str, n: int = 12) -> list[str]:
    return [line for line in text.strip().splitlines() if line.strip()][-n:]


def _earlier(row: str) -> dict[str, Any] | None:
    found = load_records(f"audit-{row}.json", DATA)
    return found[0] if found else None


def _slow(row: str) -> bool:
    """Whether a row's last record took over SLOW_LAYOUT s a layout (or there is none)."""
    record = _earlier(row)
    fuzzed = record.get("fuzz") if record else None
    return not fuzzed or fuzzed["seconds"] / max(fuzzed["tried"], 1) > SLOW_LAYOUT


def _checks_whole(record: dict[str, Any]) -> bool:
    return ran(record) and not any(cell(record, c)[0] == "not run" for c in CORRECTNESS)


def _phase(row: str, force: bool) -> str:
    """'all' (checks and fuzzer in one run), or for a slow row 'checks' then 'fuzz', in calls of their own."""
    if not _slow(row):
        return "all"
    return "fuzz" if not force and _checks_whole(_earlier(row) or {}) else "checks"


def _merge_fuzz(record: dict[str, Any], fuzzed: dict[str, Any]) -> dict[str, Any]:
    """The row's checks record with the fuzzer of a fuzz-only run (its provenance kept beside)."""
    failed = [c["name"] for c in record["checks"] if c["verdict"] == "FAIL"]
    failed += [f"fuzz:{f['check']}" for f in fuzzed["fuzz"]["failures"]]
    return {**record, "fuzz": fuzzed["fuzz"], "fuzz_provenance": fuzzed["provenance"], "failed": failed, "passed": not failed}


def run_audit(row: str, target: str, adapter: str | None, args, deadline: float) -> dict[str, Any]:
    left = deadline - time.time()
    if left < MIN_ROW_SECONDS:
        return {"row": row, "rc": "left for the next call", "seconds": 0}
    phase = _phase(row, args.force)
    # A fuzz-only run needs no time for checks, only for start-up and shrinking.
    fuzz_seconds = int(min(FUZZ_SEARCH, left - (SHRINK_AND_START if phase == "fuzz" else CHECKS_AND_SHRINK)))
    record, fresh = DATA / f"audit-{row}.json", DATA / f"audit-{row}.json.new"
    fresh.unlink(missing_ok=True)
    command = [sys.executable, "-m", "workbench.cli", "audit", target, *(["--adapter", adapter] if adapter else [])]
    command += ["--device", "cuda", "--workers", str(args.workers), "--check-timeout", str(CHECK_TIMEOUT)]
    if phase == "checks":
        command += ["--budget", "0"]
    else:
        command += ["--budget", str(FUZZ_LAYOUTS), "--time-limit", str(fuzz_seconds)]
    if phase == "fuzz":
        command += ["--skip", ",".join(CHECKS)]
    command += ["--record", str(fresh.relative_to(ROOT))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # The output streams into the log as it comes, so a run killed at its time limit still shows
    # how far it got (each check logs a line when it ends).
    log = DATA / "logs" / f"audit-{row}{'' if phase == 'all' else '-' + phase}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start, hard = time.time(), max(30, int(deadline - time.time() - 5))
    with log.open("w") as sink:
        try:
            rc: int | str = subprocess.run(
                command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=hard
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
            sink.write(f"\nkilled after {hard} s\n")
    seconds = round(time.time() - start, 1)
    if fresh.exists():
        data = json.loads(fresh.read_text())
        fresh.unlink()
        if phase == "fuzz":  # the checks' run keeps its rc and time (a run of no check exits 2)
            data = {**_merge_fuzz(_earlier(row) or {}, data), "fuzz_rc": rc, "fuzz_wall_seconds": seconds}
        else:
            data.update(rc=rc, wall_seconds=seconds)
        data.update(row=row, ran=True)
        if phase != "checks":
            data["fuzz_time_limit"] = fuzz_seconds
            data["fuzz_budget"] = fuzz_budget(data) or "short of both budgets"
        record.write_text(json.dumps(data, indent=1) + "\n")
    elif not (_earlier(row) or {}).get("checks"):  # nothing recorded, ever: say why, with provenance
        output = _tail(log.read_text(errors="replace"))
        payload = {"row": row, "target": target, "adapter": adapter, "ran": False, "rc": rc, "seconds": seconds, "output": output}
        write_record(record, payload, command=" ".join(command[2:]))
    return {"row": row, "rc": f"{phase}: {rc}", "seconds": seconds}


def _compute_sanitizer() -> str | None:
    candidates = ("/usr/local/cuda/bin/compute-sanitizer", "/opt/nvidia/compute-sanitizer/compute-sanitizer")
    return shutil.which("compute-sanitizer") or next((p for p in candidates if Path(p).exists()), None)


def run_sanitizer(row: str, tool: str, timeout: int) -> ToolRun:
    exe = _compute_sanitizer()
    if exe is None:
        return ToolRun(tool, None, why="compute-sanitizer is not installed on this machine")
    log = DATA / "logs" / f"sanitizer-{row}-{tool}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    options = ["--leak-check", "no"] if tool == "memcheck" else []
    command = [exe, "--tool", tool, *options, "--report-api-errors", "no", "--print-limit", "20", "--log-file", str(log)]
    command += [sys.executable, "scripts/audit_sanitize.py", row]
    # Prepend: the audited packages may come on PYTHONPATH (wheels installed with --target).
    env = {
        **os.environ,
        "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ToolRun(tool, None, why=f"timed out after {timeout} s")
    if done.returncode == 3:  # audit_sanitize.py: the row cannot express the watched layout
        return ToolRun(tool, None, why=_tail(done.stdout, 1)[0] if done.stdout.strip() else NOT_APPLICABLE)
    return parse(log.read_text(errors="replace") if log.exists() else "", tool, done.stdout + done.stderr)


def tools(row: str) -> tuple[str, ...]:
    record = _earlier(row) or {}
    raced = row in RACECHECK or any(c["name"] == "determinism" and c["verdict"] == "FAIL" for c in record.get("checks", []))
    return SANITIZER_TOOLS + (("racecheck",) if raced else ())


def _counted(run: dict[str, Any]) -> bool:
    """A run that needs no repeat: its count stands, or the row cannot express the layout."""
    return status(run)[0] is not None or NOT_APPLICABLE in run.get("why", "")


def sanitize_row(row: str, deadline: float, force: bool) -> dict[str, dict[str, Any]]:
    """Runs each tool the row still needs, and records the row's runs (earlier counted ones kept)."""
    path = DATA / f"sanitizer-{row}.json"
    earlier: dict[str, dict[str, Any]] = {} if force else next(iter(r["tools"] for r in load_records(path.name, DATA)), {})
    runs = {tool: run for tool, run in earlier.items() if _counted(run)}
    for tool in tools(row):
        if tool in runs:
            continue
        left = int(deadline - time.time())
        if left < 30:
            break
        runs[tool] = run_sanitizer(row, tool, min(left, 240)).to_dict()
    if runs != earlier:
        write_record(path, {"row": row, "tools": runs}, command=f"python scripts/gpu_audit_matrix.py --rows {row}")
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", help="only these rows (default: every row of MATRIX)")
    parser.add_argument("--force", action="store_true", help="record rows again even where the record is complete")
    parser.add_argument("--deadline", type=float, default=545, help="seconds the whole script may take (default 545)")
    parser.add_argument("--jobs", type=int, default=4, help="rows audited at once (default 4)")
    parser.add_argument("--workers", type=int, default=3, help="fuzzing processes per row (default 3)")
    parser.add_argument("--sanitizer-jobs", type=int, default=3, help="rows under compute-sanitizer at once (default 3)")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--skip-sanitizer", action="store_true")
    choice.add_argument("--only-sanitizer", action="store_true")
    args = parser.parse_args()
    import torch

    # Without a GPU every audit would fail to start, and the committed H200 records would be
    # replaced by that failure.
    if not torch.cuda.is_available():
        print("gpu_audit_matrix: no CUDA device here; it records native audits: run it on the GPU machine.", file=sys.stderr)
        return 2
    unknown = sorted(set(args.rows.split(",")) - {row for row, _, _ in MATRIX}) if args.rows else []
    if unknown:
        print(f"gpu_audit_matrix: --rows {unknown} are not rows of MATRIX: {[row for row, _, _ in MATRIX]}", file=sys.stderr)
        return 2
    start = time.time()
    deadline = start + args.deadline - 10
    rows = [r for r in MATRIX if not args.rows or r[0] in args.rows.split(",")]
    todo = [] if args.only_sanitizer else [r for r in rows if args.force or not complete(_earlier(r[0]) or {})]
    todo.sort(key=lambda r: not _slow(r[0]))  # slow rows first: they need their whole fuzzing time
    sanitized = [] if args.skip_sanitizer else [row for row, _, _ in rows]
    # compute-sanitizer runs beside the audits, in its own processes: it mostly waits on the GPU
    # and on its own instrumentation.
    with ThreadPoolExecutor(args.jobs) as pool, ThreadPoolExecutor(args.sanitizer_jobs) as sanitizer_pool:
        pending = {row: sanitizer_pool.submit(sanitize_row, row, deadline, args.force) for row in sanitized}
        audits = list(pool.map(lambda r: run_audit(r[0], r[1], r[2], args, deadline), todo))
        runs = {row: future.result() for row, future in pending.items()}
    print_summary(rows, audits, runs, time.time() - start)
    return 0


def print_summary(rows, audits: list[dict[str, Any]], runs: dict[str, dict[str, Any]], seconds: float) -> None:
    print(f"\naudit matrix on {os.uname().nodename} in {seconds:.0f} s")
    header = f"{'row':<20} {'this call':>22}  {'layouts':>7}  {'fuzz budget':<24} {'sanitizer':<28} failed"
    print(header + "\n" + "-" * len(header))
    this_call = {a["row"]: f"{a['rc']} in {a['seconds']} s" for a in audits}
    left = []
    for row, _, _ in rows:
        record = _earlier(row) or {}
        if not complete(record):
            left.append(row)
        counts = ",".join(
            f"{tool}={status(run)[0] if status(run)[0] is not None else '-'}" for tool, run in runs.get(row, {}).items()
        )
        if record.get("ran") is False or "checks" not in record:
            print(
                f"{row:<20} {this_call.get(row, 'skipped'):>22}  {'-':>7}  {'-':<24} {counts:<28} {(record.get('output') or ['?'])[-1][:60]}"
            )
            continue
        tried = record["fuzz"]["tried"] if record.get("fuzz") else 0
        print(
            f"{row:<20} {this_call.get(row, 'complete, skipped'):>22}  {tried:>7}  "
            f"{fuzz_budget(record) or 'short':<24} {counts:<28} {', '.join(record['failed']) or 'none'}"
        )
    print("\nrows left for the next call: " + (", ".join(left) if left else "none"))


if __name__ == "__main__":
    sys.exit(main())
