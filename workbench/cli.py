"""The `workbench` command line.

    workbench info                      versions, device, interpreter mode
    workbench list                      post-mortems with status and last built verdict
    workbench repro ID [--device D] [--record FILE]
                                        run a post-mortem's claims without Jupyter
    workbench build [--no-execute]      build the static site into site/_build
    workbench new ID "TITLE"            scaffold postmortems/<module>.py + notebooks/ID.ipynb
    workbench execute NAME...           re-execute notebooks in place, to commit their outputs
    workbench lab                       JupyterLab on notebooks/
    workbench audit MODULE:FUNCTION [--adapter A] [--device D] [--budget N] [--notebook PATH] [--record FILE]
                                        check any varlen attention against the padding contract
    workbench bench [--quick] [--shapes T..] [--record FILE]
                                        time our kernel against torch's attention choices (CUDA)

Exit status: 0 success, 1 a claim does not hold or the build failed, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from workbench.tables import fixed_width

EXIT_FAILED, EXIT_USAGE = 1, 2


def _info(args: argparse.Namespace) -> int:
    """Prints the platform the workbench runs on: what every recorded result is stamped with."""
    from workbench.provenance import provenance

    for key, value in provenance().items():
        print(f"{key:>12}: {value}")
    return 0


def _list(args: argparse.Namespace) -> int:
    """The verdict column is the one recorded by the last site build (running every post-mortem
    would take minutes); `workbench repro ID` checks one now."""
    from workbench.registry import Registry, read_manifest

    registry = Registry()
    site = Path(args.site) if args.site else registry.root / "site" / "_build"
    built = {row["id"]: row["verdict"] for row in read_manifest(site).get("postmortems", [])}
    rows = [("id", "title", "status", "verdict (last site build)")]
    for pm in registry.postmortems():
        rows.append((pm.id, pm.meta.title, pm.meta.upstream_status, built.get(pm.id, "not built")))
    if len(rows) == 1:
        print(f'no post-mortems in {registry.package_dir}; `workbench new ID "TITLE"` starts one.')
        return 0
    print(fixed_width(rows))
    return 0


def _repro(args: argparse.Namespace) -> int:
    import torch

    from kernels import DEVICE

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"workbench repro: --device cuda but torch {torch.__version__} sees no CUDA device; use --device cpu.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.device and args.device != DEVICE:
        # `kernels` chose native vs interpreted Triton when it was imported: rerun under the other choice.
        env = {**os.environ, "WORKBENCH_DEVICE": args.device}
        record = ["--record", args.record] if args.record else []
        return subprocess.call([sys.executable, "-m", "workbench.cli", "repro", args.id, *record], env=env)
    from workbench.postmortem import claims_table, overall_verdict
    from workbench.records import write_record
    from workbench.registry import Registry

    pm = Registry().get(args.id)
    print(f"{pm.id}: {pm.meta.title}", flush=True)
    results = pm.reproduce(device=args.device)
    verdicts = pm.claims.check(results)
    print(claims_table(verdicts))
    print(overall_verdict(verdicts))
    if args.record:
        # A post-mortem's `gpu_probes(device)` adds what only a run of the upstream code there shows.
        probes = getattr(pm.module, "gpu_probes", None)
        payload = {
            "id": pm.id,
            "title": pm.meta.title,
            "verdict": overall_verdict(verdicts),
            "claims": [v.to_dict() for v in verdicts],
            "results": results,
            "probes": probes(args.device or DEVICE) if probes else {},
        }
        write_record(args.record, payload)
        print(f"recorded to {args.record}")
    return 0 if all(v.holds for v in verdicts) else EXIT_FAILED


def _build(args: argparse.Namespace) -> int:
    from workbench.site import build

    build(out=Path(args.out) if args.out else None, execute_notebooks=not args.no_execute, jobs=args.jobs)
    return 0


def _new(args: argparse.Namespace) -> int:
    from workbench.registry import Registry
    from workbench.site import execute_in_place

    registry = Registry()
    module_path, notebook_path = registry.scaffold(args.id, args.title)
    print(f"wrote {module_path}\nwrote {notebook_path}\nexecuting it (it is committed with its outputs)...", flush=True)
    execute_in_place(notebook_path, registry.root)
    print(
        f"done. Next: edit {module_path.name} (META, CASES, reproduce, claims), then `workbench lab` to write the "
        f"notebook; `workbench repro {args.id}` checks the claims, `make test` runs nbval over the notebook."
    )
    return 0


def _execute(args: argparse.Namespace) -> int:
    from workbench.registry import Registry
    from workbench.site import execute_in_place

    registry = Registry()
    for name in args.notebooks:
        path = Path(name) if name.endswith(".ipynb") else registry.notebooks_dir / f"{name}.ipynb"
        if not path.exists():
            print(
                f"workbench execute: {path} does not exist; give a notebook path or a name under {registry.notebooks_dir}.",
                file=sys.stderr,
            )
            return EXIT_USAGE
        print(f"executing {path}", flush=True)
        execute_in_place(path, registry.root)
    return 0


def _lab(args: argparse.Namespace) -> int:
    from workbench.registry import Registry

    notebooks = Registry().notebooks_dir
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={notebooks}", *args.jupyter_args]
    return subprocess.call(command)


def _bench(args: argparse.Namespace) -> int:
    from workbench.bench import main as bench_main

    return bench_main(args.bench_args)


def _audit(args: argparse.Namespace) -> int:
    from workbench.audit import run_command

    return run_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="Post-mortem workbench for silent numerical bugs in packed (varlen/THD) attention.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = commands.add_parser("info", help="versions, device and interpreter mode of this machine")
    info.set_defaults(func=_info)

    listing = commands.add_parser("list", help="post-mortems with status and the verdict of the last site build")
    listing.add_argument("--site", help="built site to read verdicts from (default: site/_build)")
    listing.set_defaults(func=_list)

    repro = commands.add_parser("repro", help="run a post-mortem's reproduction and claims without Jupyter")
    repro.add_argument("id", help="post-mortem id, e.g. torch-varlen-176793 (see `workbench list`)")
    repro.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA when available, else the Triton interpreter")
    repro.add_argument("--record", metavar="FILE", help="write verdicts and results with provenance as JSON")
    repro.set_defaults(func=_repro)

    build = commands.add_parser("build", help="execute every notebook and build the static site (site/_build)")
    build.add_argument("--no-execute", action="store_true", help="render the committed outputs instead of executing (fast)")
    build.add_argument("--out", help="output directory (default: site/_build)")
    build.add_argument("--jobs", type=int, help="notebooks executed in parallel (default: one per CPU core)")
    build.set_defaults(func=_build)

    new = commands.add_parser("new", help="scaffold a post-mortem module and its notebook, executed")
    new.add_argument("id", help="lowercase letters, digits and '-', e.g. flash-dmattn-121")
    new.add_argument("title", help="one line, in quotes")
    new.set_defaults(func=_new)

    execute = commands.add_parser("execute", help="re-execute notebooks in place (as the site does), to commit them with outputs")
    execute.add_argument("notebooks", nargs="+", metavar="NAME", help="post-mortem id / notebook name, or a path to an .ipynb")
    execute.set_defaults(func=_execute)

    lab = commands.add_parser("lab", help="open JupyterLab on notebooks/ (other arguments go to jupyter lab, e.g. --no-browser)")
    lab.set_defaults(func=_lab)

    audit = commands.add_parser(
        "audit", help="check any varlen attention against the padding contract: checks, bad inputs, fuzzer"
    )
    audit.add_argument("target", help="MODULE:FUNCTION, e.g. kernels:varlen_attention or torch.nn.attention.varlen:varlen_attn")
    audit.add_argument(
        "--adapter",
        help="how to call it: ours, contract, torch-varlen, flash-attn, te-thd, bshd or a registered one (default: guessed)",
    )
    audit.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import first (e.g. the module registering your adapter)",
    )
    audit.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA when available, else the Triton interpreter")
    audit.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="dtype of the checks' cases (default: float32 on CPU, float16 on CUDA)",
    )
    audit.add_argument(
        "--budget", type=int, metavar="N", help="layouts the fuzzer tries (default: 20 on CPU, 1000 on CUDA; 0: none)"
    )
    audit.add_argument("--seed", type=int, default=0, help="fuzzer seed (default 0)")
    audit.add_argument("--time-limit", type=float, metavar="S", help="stop fuzzing after S seconds")
    audit.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="fuzz in N processes (natively: compilation and Python are the bottleneck)",
    )
    audit.add_argument("--checks", metavar="A,B", help="run only these checks (default: all)")
    audit.add_argument("--skip", metavar="A,B", help="run every check but these")
    audit.add_argument("--notebook", metavar="PATH", help="write a post-mortem notebook of the failing cases, executed")
    audit.add_argument("--record", metavar="FILE", help="write the report with provenance as JSON")
    audit.set_defaults(func=_audit)

    bench = commands.add_parser(
        "bench",
        help="time our kernel against torch varlen_attn, SDPA and FlexAttention (CUDA; --help for options)",
        add_help=False,
    )
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from workbench.registry import RegistryError
    from workbench.site import BuildError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "lab":
        args.jupyter_args = extra
    elif args.command == "bench":
        args.bench_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except RegistryError as exc:
        print(f"workbench {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BuildError as exc:
        print(f"workbench {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
