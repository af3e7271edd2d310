"""TransformerEngine's audit FAILs taken apart, and the report's FP8 mechanism on TE's own GEMM.

    python3 scripts/te_probes.py --record $OUT/te-thd-2892-probes-h200.json [--parts variants,determinism,gemm,initcheck] [--jobs 4]

Runs, on the GPU machine with TE installed (docs/gpu-transformer-engine.md), what
postmortems/te_thd_2892/te_probes.py describes, each in a child process (TE's debug log on, so
the backend TE chose is recorded beside each result; a crash is a finding, not a lost run):

- variants     the audit row te's smallest failing fuzz layout and its variants, one child each;
- determinism  the audit's determinism check on the row te, with TE's default and with
               NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (how TE's documentation asks for determinism);
- gemm         TE's Linear under each FP8 recipe with padding rows zero, normal or large;
- initcheck    compute-sanitizer's initcheck on the row te's forward + backward, on the audit's
               layout and on the same lengths with GAP alone, TAIL alone and no padding.

The record (varlen_workbench.workbench.records, with provenance) is rewritten as each child ends, `partial` until
the last, so a call cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from varlen_workbench.postmortems.te_thd_2892.te_probes import INITCHECK_LAYOUTS, ZERO_KEY_VARIANTS
from varlen_workbench.postmortems.te_thd_2892.upstream import RESULT, _run, backend_log, child_env, outcome, printed

PARTS = ("variants", "determinism", "gemm", "initcheck")
TE_ROW = "varlen_workbench.workbench.audit.adapters.te:te_dot_product_attention"
# TE's switch for deterministic attention (its README and PR #2584): 0 refuses non-deterministic algorithms.
DETERMINISTIC = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def child(code: str, timeout: float, env: dict[str, str] | None = None) -> dict:
    """`code` (which prints RESULT + JSON last) in a child: its result, how it ended, TE's backend."""
    rc, out, err, seconds = _run([sys.executable, "-c", code], child_env(env), timeout)
    found = printed(out)
    result = {"result": found} if found is not None else {"stderr_tail": err.splitlines()[-8:]}
    return {**result, **outcome(rc), "seconds": round(seconds, 1), "backend": backend_log(err)}


def variant(name: str, device: str, timeout: float) -> dict:
    code = (
        "import json\nfrom varlen_workbench.postmortems.te_thd_2892.te_probes import ZERO_KEY_VARIANTS, run_variant\n"
        f"print({RESULT!r} + json.dumps(run_variant(ZERO_KEY_VARIANTS[{name!r}], {device!r})))\n"
    )
    return {"variant": name, "case": ZERO_KEY_VARIANTS[name].to_dict(), **child(code, timeout)}


def determinism(setting: str, device: str, timeout: float) -> dict:
    """The audit's determinism check on the row te, in a child with TE's default or DETERMINISTIC."""
    with tempfile.TemporaryDirectory() as directory:
        record = Path(directory) / "audit.json"
        argv = ["-m", "varlen_workbench.workbench.cli.main", "audit", TE_ROW, "--adapter", "te-thd", "--device", device]
        argv += ["--checks", "determinism", "--budget", "0", "--no-isolate", "--record", str(record)]
        env = DETERMINISTIC if setting == "deterministic" else {}
        rc, _, err, seconds = _run([sys.executable, *argv], child_env(env), timeout)
        checks = json.loads(record.read_text())["checks"] if record.exists() else []
    ran = {c["name"]: c for c in checks}.get("determinism", {})
    return {
        "setting": setting,
        "env": env,
        "verdict": ran.get("verdict"),
        "evidence": ran.get("evidence"),
        **outcome(rc),
        "seconds": round(seconds, 1),
        "backend": backend_log(err),
        "stderr_tail": [] if ran else err.splitlines()[-8:],
    }


def gemm(device: str, timeout: float) -> dict:
    code = (
        "import json\nfrom varlen_workbench.postmortems.te_thd_2892.te_probes import fp8_linear_table\n"
        f"print({RESULT!r} + json.dumps(fp8_linear_table({device!r})))\n"
    )
    return child(code, timeout)


def initcheck(name: str, device: str, timeout: float) -> dict:
    """compute-sanitizer's initcheck on the row te's forward + backward of INITCHECK_LAYOUTS[name]."""
    from varlen_workbench.workbench.audit.sanitizer import ToolRun, executable, parse

    exe = executable()
    if exe is None:
        return {"layout": name, **ToolRun("initcheck", None, why="compute-sanitizer is not installed").to_dict()}
    code = (
        "from varlen_workbench.postmortems.te_thd_2892.te_probes import INITCHECK_LAYOUTS, forward_backward\n"
        f"print(forward_backward(INITCHECK_LAYOUTS[{name!r}], {device!r}))\n"
    )
    with tempfile.TemporaryDirectory() as directory:
        log = Path(directory) / "initcheck.log"
        command = [exe, "--tool", "initcheck", "--report-api-errors", "no", "--print-limit", "20", "--log-file", str(log)]
        # No caching allocator: every tensor its own allocation, so a read past one is not hidden.
        rc, out, err, seconds = _run(
            [*command, sys.executable, "-c", code], child_env({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}), timeout
        )
        run = parse(log.read_text(errors="replace") if log.exists() else "", "initcheck", out + err)
    return {
        "layout": name,
        "case": INITCHECK_LAYOUTS[name].to_dict(),
        **run.to_dict(),
        **outcome(rc),
        "seconds": round(seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, help="write the results here as JSON with provenance")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS} (default: all)")
    parser.add_argument("--jobs", type=int, default=4, help="child processes at once (default 4)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a child may take (default 300)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layouts", help="initcheck only these layouts of INITCHECK_LAYOUTS (comma-separated; default: all)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"te_probes: --parts {unknown} are not parts: {list(PARTS)}", file=sys.stderr)
        return 2
    command = shlex.join(["python3", "scripts/te_probes.py", *sys.argv[1:]])
    jobs: dict[tuple[str, str], tuple] = {}
    if "variants" in parts:
        jobs |= {("variants", n): (variant, n, args.device, args.timeout) for n in ZERO_KEY_VARIANTS}
    if "determinism" in parts:
        jobs |= {("determinism", s): (determinism, s, args.device, args.timeout) for s in ("default", "deterministic")}
    if "gemm" in parts:
        jobs[("gemm", "table")] = (gemm, args.device, args.timeout)
    layouts = args.layouts.split(",") if args.layouts else list(INITCHECK_LAYOUTS)
    if set(layouts) - set(INITCHECK_LAYOUTS):
        print(
            f"te_probes: --layouts {sorted(set(layouts) - set(INITCHECK_LAYOUTS))} are not in {list(INITCHECK_LAYOUTS)}",
            file=sys.stderr,
        )
        return 2
    if "initcheck" in parts:
        jobs |= {("initcheck", n): (initcheck, n, args.device, args.timeout) for n in layouts}
    done: dict[tuple[str, str], dict] = {}

    def record(partial: bool) -> None:
        if not args.record:
            return
        from varlen_workbench.workbench.records import write_record

        payload: dict = {part: [done[key] for key in jobs if key[0] == part and key in done] for part in parts}
        write_record(args.record, {**payload, "partial": partial}, command=command)

    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(job[0], *job[1:]): key for key, job in jobs.items()}
        for future in as_completed(futures):
            key = futures[future]
            done[key] = future.result()
            said = done[key].get("verdict") or done[key].get("errors") or done[key].get("outcome")
            print(f"{key[0]:<12} {key[1]:<44} {said}", flush=True)
            record(partial=True)
    record(partial=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
