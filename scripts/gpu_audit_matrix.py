"""The audit matrix on a GPU, resumable: each call records the rows it finishes, the next does the rest.

    python scripts/gpu_audit_matrix.py [--rows A,B] [--force] [--deadline 545] [--jobs 4] [--workers 3]
                                       [--check-parts 3] [--skip-sanitizer | --only-sanitizer]
    python scripts/gpu_audit_matrix.py --rows A --recheck no-real-query --check-timeout 400

Every row of `varlen_workbench.workbench.audit.adapters.MATRIX` whose record is not complete
(`varlen_workbench.workbench.audit.matrix.complete`: it ran, no cell is "not run", and its fuzzer tried
FUZZ_LAYOUTS layouts, or searched FUZZ_SEARCH s where one layout takes over SLOW_LAYOUT s)
is audited again, every row with `--force`; `--recheck` runs only the checks it names again, in the
rows named, each given `--check-timeout` s (a check past its time limit is an answer the matrix
keeps until then):

    python -m varlen_workbench.workbench.cli.main audit TARGET [--adapter A] --device cuda --budget 1000 --time-limit T
        --workers W --check-timeout 150 --record data/gpu/audit-<row>.json.new

On CUDA the audit runs each check and fuzz batch in a child process replaced after a CUDA
error, a crash or the check's time limit (`varlen_workbench.workbench.audit.isolate`), so one fault costs one
cell. Rows `--jobs` at a time, slow ones first (over SLOW_LAYOUT s a layout in their last
record, or never recorded). A slow row runs what it still needs of two phases, at once, each
in processes of its own (a run of both in one process would not fit a call):

- its checks (`--budget 0 --checks ...`): only those its record lacks or left "not run", split
  across `--check-parts` processes (a slow row's single checks take 4-156 s on the H200), each
  merged into the row's record as it ends (`check_runs`: which run gave each check, with its
  provenance, exit status and time);
- its fuzzer alone (`--skip` every check, `--time-limit` FUZZ_SEARCH s where the call has room),
  merged with its own provenance (`fuzz_provenance`).

`varlen-workbench audit --record` rewrites its record after each check and, while fuzzing, every
PROGRESS_SECONDS (marked `partial`), so a run killed at the call's deadline (with every process
it started) keeps what it finished: the next call runs only the rest, and a fuzzer's layouts
count (its failures as drawn). The fuzzer's own time is bounded (`varlen_workbench.workbench.audit.fuzz.fuzz`),
so that a fuzz-only run given FUZZ_SEARCH s ends inside the call. A row starts only if
MIN_ROW_SECONDS are left before `--deadline`, so a call ends inside the device's 10-minute
limit. A path that cannot run at all (its package missing) records why (`"ran": false`, with
the command's last lines) unless an earlier record of it ran. The record says which fuzzing
budget it met (`fuzz_budget`).

Then compute-sanitizer, beside the audits: each row's forward + backward
(`scripts/audit_sanitize.py ROW`) under initcheck and memcheck, and racecheck where its kernels
accumulate with atomics (RACECHECK), with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so each tensor is its
own allocation; each log is parsed (`varlen_workbench.workbench.audit.sanitizer.parse`) and the row's runs go to
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
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
from varlen_workbench.workbench.audit.adapters import MATRIX
from varlen_workbench.workbench.audit.checks import CHECKS
from varlen_workbench.workbench.audit.matrix import (
    CORRECTNESS,
    FUZZ_LAYOUTS,
    FUZZ_SEARCH,
    SLOW_LAYOUT,
    complete,
    fuzz_budget,
    layout_seconds,
    left_out,
    ran,
)
from varlen_workbench.workbench.audit.sanitizer import NOT_APPLICABLE, ToolRun, executable, parse, status
from varlen_workbench.workbench.records import load_records, with_fingerprint, write_json, write_record

DATA = ROOT / "data" / "gpu"
CHECK_TIMEOUT = 150  # seconds one check may take before its cell says "not run: timed out"
CHECKS_AND_SHRINK = 150  # seconds a row needs beside its fuzzing: the checks, shrinking, start-up
# The same for a fuzz-only run: the fuzzer ends within its time limit + SHRINK_SECONDS + PROBE_GRACE
# (varlen_workbench.workbench.audit.fuzz), then the command's start-up and a replaced child's.
SHRINK_AND_START = 110
MIN_ROW_SECONDS = 240  # a row starts only with this much time left before the deadline
SANITIZER_TOOLS = ("initcheck", "memcheck")
SANITIZER_TIMEOUT = 240  # seconds one tool's run may take (a run that timed out before: the rest of the call)
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
    return not fuzzed or layout_seconds(fuzzed) > SLOW_LAYOUT


def _checks_whole(record: dict[str, Any]) -> bool:
    return ran(record) and not _checks_left(record, force=False)


def _checks_left(record: dict[str, Any], force: bool) -> list[str]:
    """The checks a checks run still has to run: every matrix column's check, or (unless forced)
    those the record lacks or left "not run" (but for one past its time limit: an answer)."""
    names = [*CORRECTNESS, "input-validation"]
    return names if force or not ran(record) else [c for c in names if left_out(record, c)]


def _phases(row: str, force: bool) -> list[str]:
    """['all'] (checks and fuzzer in one run), or for a slow row what it still needs of 'checks'
    and 'fuzz', run at once in processes of their own (each merged into the record as it ends)."""
    if not _slow(row):
        return ["all"]
    record = _earlier(row) or {}
    phases = ["checks"] * (force or not _checks_whole(record)) + ["fuzz"] * (force or fuzz_budget(record) is None)
    return phases or ["fuzz"]


def _failed(record: dict[str, Any]) -> dict[str, Any]:
    failed = [c["name"] for c in record["checks"] if c["verdict"] == "FAIL"]
    failed += [f"fuzz:{f['check']}" for f in (record.get("fuzz") or {}).get("failures", [])]
    return {"failed": failed, "passed": not failed}


def _merge_fuzz(record: dict[str, Any], fuzzed: dict[str, Any]) -> dict[str, Any]:
    """The row's checks record with the fuzzer of a fuzz-only run (its provenance kept beside)."""
    merged = {**record, "fuzz": fuzzed["fuzz"], "fuzz_provenance": fuzzed["provenance"]}
    return {**merged, **_failed(merged)}


def _check_runs(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs a record's checks come from, each with its checks and provenance."""
    if "check_runs" in record:
        return record["check_runs"]
    own = {"checks": [c["name"] for c in record["checks"]], "provenance": record["provenance"]}
    return [{**own, "rc": record.get("rc"), "wall_seconds": record.get("wall_seconds")}]


def _merge_checks(record: dict[str, Any], part: dict[str, Any], rc: int | str, seconds: float) -> dict[str, Any]:
    """The row's record with the checks of a checks-only run (`part`, perhaps cut at its deadline:
    `partial`) in place of its own of the same names; `check_runs` says which run gave each
    check, with its provenance, exit status and time; the row's provenance is its latest run's."""
    new = [c["name"] for c in part["checks"]]
    this = {"checks": new, "provenance": part["provenance"], "rc": rc, "wall_seconds": seconds}
    this.update({"partial": part["partial"]} if part.get("partial") else {})
    if not ran(record):
        base, runs = {k: v for k, v in part.items() if k != "partial"}, []
    else:
        base = dict(record)
        if record.get("fuzz"):  # the row's provenance becomes this run's: a fuzzer's own stays beside it
            base.setdefault("fuzz_provenance", record["provenance"])
        runs = [{**run, "checks": [c for c in run["checks"] if c not in new]} for run in _check_runs(record)]
    checks = [c for c in base["checks"] if c["name"] not in new] + part["checks"]
    order = list(CHECKS)
    merged = {
        **base,
        "checks": sorted(checks, key=lambda c: order.index(c["name"])),
        "check_runs": [run for run in runs if run["checks"]] + [this],
        "target": part["target"],
        "budget": base.get("budget") if base.get("fuzz") else 0,  # no fuzzer yet: it is a run of its own
        "provenance": part["provenance"],
        "versions": part["versions"],
        "rc": rc,
        "wall_seconds": seconds,
    }
    return {**merged, **_failed(merged)}


def _command(target: str, adapter: str | None, args, phase: str, fuzz_seconds: int, checks: list[str], out: Path) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "varlen_workbench.workbench.cli.main",
        "audit",
        target,
        *(["--adapter", adapter] if adapter else []),
    ]
    command += ["--device", "cuda", "--workers", str(args.workers), "--check-timeout", str(args.check_timeout)]
    if phase == "checks":
        command += ["--budget", "0", "--checks", ",".join(checks)]
    else:
        command += ["--budget", str(FUZZ_LAYOUTS), "--time-limit", str(fuzz_seconds)]
    if phase == "fuzz":
        command += ["--skip", ",".join(CHECKS)]
    return command + ["--record", str(out.relative_to(ROOT))]


def _run(command: list[str], log: Path, hard: int) -> tuple[int | str, float]:
    """Runs an audit command into `log`, killed with every process it started after `hard` s."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    # The output streams into the log as it comes, so a run killed at its time limit still shows
    # how far it got (each check logs a line when it ends, the fuzzer every PROGRESS_SECONDS).
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = process.wait(timeout=hard)
        except subprocess.TimeoutExpired:
            _kill(process)
            rc = "timeout"
            sink.write(f"\nkilled after {hard} s\n")
    return rc, round(time.time() - start, 1)


def _kill(process: subprocess.Popen) -> None:
    """Ends `process` and every process it started (its session): audit children, the program a
    sanitizer watches, which would otherwise hold the GPU for the rest of the call."""
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()


def _parts(checks: list[str], n: int) -> list[list[str]]:
    """`checks` dealt round-robin into at most `n` parts (input-validation runs last in its part anyway)."""
    return [part for part in (checks[i::n] for i in range(max(n, 1))) if part]


def run_audit(row: str, target: str, adapter: str | None, args, deadline: float) -> dict[str, Any]:
    left = deadline - time.time()
    if left < MIN_ROW_SECONDS:
        return {"row": row, "rc": "left for the next call", "seconds": 0}
    phases = ["checks"] if args.recheck else _phases(row, args.force)
    # A fuzz-only run needs no time for checks, only for start-up and shrinking.
    fuzz_seconds = int(min(FUZZ_SEARCH, left - (CHECKS_AND_SHRINK if phases == ["all"] else SHRINK_AND_START)))
    hard = int(deadline - time.time() - 5)
    # A slow row's checks run in parts, beside its fuzzer: each part and the fuzzer in a process
    # and log of its own, each merged into the row's record as it ends, whole or (killed at the
    # deadline) with what it finished.
    wanted = args.recheck or _checks_left(_earlier(row) or {}, args.force)
    parts = _parts(wanted, args.check_parts) if "checks" in phases else []
    # A recheck's logs stand beside the row's checks logs, which stay the evidence of its other checks.
    stem = "-recheck" if args.recheck else "-checks"
    runs = [("checks", checks, f"{stem}-{i + 1}" if len(parts) > 1 else stem) for i, checks in enumerate(parts)]
    runs += [(phase, [], "" if phase == "all" else "-fuzz") for phase in phases if phase != "checks"]
    if (
        parts and not args.recheck
    ):  # the logs of a checks run are this run's parts alone (varlen_workbench.workbench.audit.summary reads the latest)
        for stale in (DATA / "logs").glob(f"audit-{row}-checks*.log"):
            stale.unlink()
    lock = threading.Lock()
    recorded: list[str] = []

    def one(phase: str, checks: list[str], suffix: str) -> tuple[int | str, float, Path]:
        fresh = DATA / f"audit-{row}{suffix}.json.new"
        fresh.unlink(missing_ok=True)
        log = DATA / "logs" / f"audit-{row}{suffix}.log"
        rc, seconds = _run(_command(target, adapter, args, phase, fuzz_seconds, checks, fresh), log, hard)
        if not fresh.exists():
            return rc, seconds, log
        data = json.loads(fresh.read_text())
        fresh.unlink()
        partial = data.get("partial") or (data.get("fuzz") or {}).get("partial")
        with lock:
            earlier = {} if args.force and not recorded else _earlier(row) or {}
            if phase == "checks":
                data = _merge_checks(earlier, data, rc, seconds)
            elif phase == "fuzz":  # the checks' runs keep their rc and time (a run of no check exits 2)
                data = {**_merge_fuzz(earlier, data), "fuzz_rc": rc, "fuzz_wall_seconds": seconds} if ran(earlier) else data
            else:
                data.update(rc=rc, wall_seconds=seconds)
            data.update(row=row, ran=True)
            if data.get("fuzz"):
                data["fuzz_budget"] = fuzz_budget(data) or "short of both budgets"
            # Whole or not at all: the sanitizer's threads read the row's record meanwhile.
            write_json(DATA / f"audit-{row}.json", with_fingerprint(DATA / f"audit-{row}.json", data))
            recorded.append(suffix)
        if rc == "timeout":  # the log's last line then says what the record kept
            with log.open("a") as sink:
                sink.write(f"recorded what it finished before the kill ({partial or 'its whole run'})\n")
        return rc, seconds, log

    with ThreadPoolExecutor(len(runs)) as pool:
        done = list(pool.map(lambda run: one(*run), runs))
    rc = ",".join(str(r) for r, _, _ in done) if len(done) > 1 else done[0][0]
    seconds = max(s for _, s, _ in done)
    if not recorded and not (_earlier(row) or {}).get("checks"):  # nothing recorded, ever: say why, with provenance
        output = _tail(done[0][2].read_text(errors="replace"))
        payload = {"row": row, "target": target, "adapter": adapter, "ran": False, "rc": rc, "seconds": seconds, "output": output}
        command = _command(target, adapter, args, runs[0][0], fuzz_seconds, runs[0][1], DATA / f"audit-{row}.json.new")
        write_record(DATA / f"audit-{row}.json", payload, command=" ".join(command[2:]))
    return {"row": row, "rc": f"{'+'.join(phases)}: {rc}", "seconds": seconds}


def run_sanitizer(row: str, tool: str, timeout: int) -> ToolRun:
    exe = executable()
    if exe is None:
        return ToolRun(tool, None, why="compute-sanitizer is not installed on this machine")
    log = DATA / "logs" / f"sanitizer-{row}-{tool}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    options = ["--leak-check", "no"] if tool == "memcheck" else []
    command = [exe, "--tool", tool, *options, "--report-api-errors", "no", "--print-limit", "20", "--log-file", str(log)]
    command += [sys.executable, "scripts/audit_sanitize.py", row]
    # PYTHONPATH as it is: the audited packages may come on it (wheels installed with --target).
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(process)
        # What it printed before the kill stays: reports, but no summary, so no count.
        printed = parse(log.read_text(errors="replace"), tool) if log.exists() else ToolRun(tool, None)
        return ToolRun(tool, None, printed.kinds, printed.first, why=f"timed out after {timeout} s")
    if process.returncode == 3:  # audit_sanitize.py: the row cannot express the watched layout
        return ToolRun(tool, None, why=_tail(output, 1)[0] if output.strip() else NOT_APPLICABLE)
    return parse(log.read_text(errors="replace") if log.exists() else "", tool, output)


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
        # A tool that ran past its time limit before gets the rest of the call (sdpa-nested's
        # initcheck passed 240 s on the H200, where its memcheck took 6 s).
        slow = "timed out" in earlier.get(tool, {}).get("why", "")
        runs[tool] = run_sanitizer(row, tool, left if slow else min(left, SANITIZER_TIMEOUT)).to_dict()
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
    parser.add_argument(
        "--check-parts", type=int, default=3, help="processes a slow row's checks are split across, at once (default 3)"
    )
    parser.add_argument("--sanitizer-jobs", type=int, default=3, help="rows under compute-sanitizer at once (default 3)")
    parser.add_argument(
        "--recheck", type=lambda names: names.split(","), default=[], help="only these checks again, in the --rows given"
    )
    parser.add_argument(
        "--check-timeout", type=int, default=CHECK_TIMEOUT, help=f"seconds one check may take (default {CHECK_TIMEOUT})"
    )
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
    if args.recheck and (not args.rows or set(args.recheck) - {*CORRECTNESS, "input-validation"}):
        print(
            f"gpu_audit_matrix: --recheck {args.recheck} needs --rows, and names checks of {[*CORRECTNESS, 'input-validation']}",
            file=sys.stderr,
        )
        return 2
    start = time.time()
    deadline = start + args.deadline - 10
    rows = [r for r in MATRIX if not args.rows or r[0] in args.rows.split(",")]
    redo = args.force or args.recheck
    todo = [] if args.only_sanitizer else [r for r in rows if redo or not complete(_earlier(r[0]) or {})]
    todo.sort(key=lambda r: not _slow(r[0]))  # slow rows first: they need their whole fuzzing time
    sanitized = [] if args.skip_sanitizer or args.recheck else [row for row, _, _ in rows]
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
