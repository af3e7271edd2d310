"""The audit matrix on a GPU: `workbench audit` for every path, then compute-sanitizer, in ~7 minutes.

    python scripts/gpu_audit_matrix.py [--rows A,B] [--deadline 400] [--budget 1000] [--jobs 12]

For every row of `workbench.audit.adapters.MATRIX` (ours, torch varlen_attn, FlexAttention, SDPA
per backend, nested jagged SDPA, flash-dmattn Triton and Flex, flash-sparse-attn varlen):

    python -m workbench.cli audit TARGET --adapter A --device cuda --budget N --time-limit T
        --record data/gpu/audit-<row>.json

in parallel (one process each, `--jobs` at a time), each under a hard time limit, so the whole
script ends by `--deadline` seconds. A path that cannot run (its package missing, CUDA-only code
refused) writes its reason instead: data/gpu/audit-<row>.json then says `"ran": false` with the
command's last lines. Then, for each row, `scripts/audit_sanitize.py ROW` (forward + backward on
a padded layout) under `compute-sanitizer --tool initcheck` and `--tool memcheck` (and
`racecheck` for ours), with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so each tensor is its own
allocation; what each tool reported goes to data/gpu/audit-sanitizer.json. A summary table
comes last. Needs only torch and triton (and the audited packages, as wheels).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workbench.audit.adapters import MATRIX  # noqa: E402
from workbench.records import write_record  # noqa: E402

DATA = ROOT / "data" / "gpu"
# Compilation-heavy paths fuzz for less time (FlexAttention compiles per head dim, dtype and GQA).
FUZZ_SECONDS = {"flex-document": 100}
SANITIZER_TOOLS = ("initcheck", "memcheck")


def _tail(text: str, n: int = 12) -> list[str]:
    return [line for line in text.strip().splitlines() if line.strip()][-n:]


def run_audit(row: str, target: str, adapter: str, args, deadline: float) -> dict:
    record = DATA / f"audit-{row}.json"
    record.unlink(missing_ok=True)
    fuzz_s = min(FUZZ_SECONDS.get(row, 90), max(10, deadline - time.time() - 150))
    hard = max(30, int(deadline - time.time() - 5))
    command = [
        sys.executable,
        "-m",
        "workbench.cli",
        "audit",
        target,
        "--adapter",
        adapter,
        "--device",
        "cuda",
        "--budget",
        str(args.budget),
        "--time-limit",
        str(fuzz_s),
        "--record",
        str(record.relative_to(ROOT)),
    ]
    start = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # The output streams into the log as it comes, so a run killed at its time limit still shows
    # how far it got (each check logs a line when it ends).
    log = DATA / "logs" / f"audit-{row}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        try:
            rc: int | str = subprocess.run(
                command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=hard
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc == "timeout":
        with log.open("a") as sink:
            sink.write(f"\nkilled after {hard} s\n")
    out = log.read_text(errors="replace")
    seconds = round(time.time() - start, 1)
    if not record.exists():  # nothing recorded: say why, with provenance
        write_record(
            record,
            {"row": row, "target": target, "adapter": adapter, "ran": False, "rc": rc, "seconds": seconds, "output": _tail(out)},
            command=" ".join(command[2:]),
        )
    else:
        data = json.loads(record.read_text())
        data.update(row=row, ran=True, rc=rc, wall_seconds=seconds)
        record.write_text(json.dumps(data, indent=1) + "\n")
    return {"row": row, "rc": rc, "seconds": seconds}


def run_sanitizer(row: str, tool: str, timeout: int) -> dict:
    exe = shutil.which("compute-sanitizer") or next(
        (
            p
            for p in ("/usr/local/cuda/bin/compute-sanitizer", "/opt/nvidia/compute-sanitizer/compute-sanitizer")
            if Path(p).exists()
        ),
        None,
    )
    if exe is None:
        return {"tool": tool, "ran": False, "why": "compute-sanitizer is not installed on this machine"}
    log = DATA / "logs" / f"sanitizer-{row}-{tool}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [
        exe,
        "--tool",
        tool,
        "--print-limit",
        "20",
        "--log-file",
        str(log),
        sys.executable,
        "scripts/audit_sanitize.py",
        row,
    ]
    if tool == "memcheck":
        command[3:3] = ["--leak-check", "no"]
    # Prepend: the audited packages may come on PYTHONPATH (wheels installed with --target).
    env = {
        **os.environ,
        "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.time()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"tool": tool, "ran": False, "why": f"timed out after {timeout} s", "seconds": timeout}
    text = log.read_text(errors="replace") if log.exists() else ""
    summary = re.search(r"ERROR SUMMARY: (\d+) error", text) or re.search(
        r"RACECHECK SUMMARY: \d+ hazards displayed \((\d+) error", text
    )
    kinds: dict[str, int] = {}
    for line in text.splitlines():
        found = re.match(
            r"=========\s+(Uninitialized __global__ memory read|Invalid __global__ (?:read|write)|\w[\w ]+ hazard|.*?error)", line
        )
        if found and "ERROR SUMMARY" not in line:
            kinds[found.group(1)] = kinds.get(found.group(1), 0) + 1
    return {
        "tool": tool,
        "ran": done.returncode in (0, 1) and summary is not None or "not applicable" in done.stdout,
        "rc": done.returncode,
        "errors": int(summary.group(1)) if summary else None,
        "kinds": kinds,
        "first": [line for line in text.splitlines() if line.startswith("=========") and "ERROR SUMMARY" not in line][:12],
        "program": _tail(done.stdout + done.stderr, 4),
        "completed": "forward+backward in" in done.stdout,
        "seconds": round(time.time() - start, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", help="only these rows (default: every row of MATRIX)")
    parser.add_argument("--deadline", type=float, default=400, help="seconds the whole script may take (default 400)")
    parser.add_argument("--budget", type=int, default=1000, help="layouts per path (default 1000)")
    parser.add_argument("--jobs", type=int, default=14, help="audits at once (default 14: all rows)")
    parser.add_argument("--sanitizer-jobs", type=int, default=6, help="compute-sanitizer runs at once (default 6)")
    parser.add_argument("--skip-sanitizer", action="store_true")
    args = parser.parse_args()
    import torch

    # Each row's record is replaced: without a GPU every audit would fail to start, and the
    # committed H200 records would be overwritten with that failure.
    if not torch.cuda.is_available():
        print("gpu_audit_matrix: no CUDA device here; it records native audits: run it on the GPU machine.", file=sys.stderr)
        return 2
    start = time.time()
    rows = [r for r in MATRIX if not args.rows or r[0] in args.rows.split(",")]
    audit_deadline = start + args.deadline - 10
    # The sanitizer runs beside the audits, in its own processes: it mostly waits on the GPU
    # and on its own instrumentation.
    tasks = [] if args.skip_sanitizer else [(row, tool) for row, _, _ in rows for tool in _tools(row)]
    with ThreadPoolExecutor(args.jobs) as pool, ThreadPoolExecutor(args.sanitizer_jobs) as sanitizer_pool:
        pending = [(row, tool, sanitizer_pool.submit(_sanitize, row, tool, start + args.deadline - 10)) for row, tool in tasks]
        audits = list(pool.map(lambda r: run_audit(*r, args, audit_deadline), rows))
        sanitized: dict[str, dict] = {}
        for row, tool, future in pending:
            sanitized.setdefault(row, {})[tool] = future.result()
    if sanitized:
        write_record(DATA / "audit-sanitizer.json", {"rows": sanitized}, command="python scripts/gpu_audit_matrix.py")
    print_summary(audits, sanitized, time.time() - start)
    return 0


def _tools(row: str) -> tuple[str, ...]:
    return SANITIZER_TOOLS + (("racecheck",) if row == "ours" else ())


def _sanitize(row: str, tool: str, deadline: float) -> dict:
    left = int(deadline - time.time())
    if left < 30:
        return {"tool": tool, "ran": False, "why": "no time left before the script's deadline"}
    return run_sanitizer(row, tool, min(left, 240))


def print_summary(audits: list[dict], sanitized: dict, seconds: float) -> None:
    print(f"\naudit matrix on {os.uname().nodename} in {seconds:.0f} s")
    header = f"{'row':<18} {'rc':>7} {'s':>6}  {'layouts':>7}  {'validation':<17} failed / why not run"
    print(header + "\n" + "-" * len(header))
    for a in audits:
        data = json.loads((DATA / f"audit-{a['row']}.json").read_text())
        if data.get("ran") is False:
            print(f"{a['row']:<18} {a['rc']!s:>7} {a['seconds']:>6}  {'-':>7}  {'-':<17} {(data['output'] or ['?'])[-1][:90]}")
            continue
        grade = next((c["verdict"] for c in data["checks"] if c["name"] == "input-validation"), "-")
        tried = data["fuzz"]["tried"] if data.get("fuzz") else 0
        print(f"{a['row']:<18} {a['rc']!s:>7} {a['seconds']:>6}  {tried:>7}  {grade:<17} {', '.join(data['failed']) or 'none'}")
    if sanitized:
        print("\ncompute-sanitizer (errors per tool; - = not run)")
        for row, tools in sanitized.items():
            cells = [f"{t}={r['errors'] if r.get('errors') is not None else '-'}" for t, r in tools.items()]
            print(f"{row:<18} {'  '.join(cells)}")


if __name__ == "__main__":
    sys.exit(main())
