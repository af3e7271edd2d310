"""The `workbench` command line.

    workbench info                      versions, device, interpreter mode
    workbench list                      post-mortems with status and last built verdict
    workbench repro ID [--device D] [--record FILE]
                                        run a post-mortem's claims without Jupyter
    workbench build [--no-execute]      build the static site into site/_build
    workbench new ID "TITLE"            scaffold postmortems/<module>/ + notebooks/ID.ipynb
    workbench execute NAME...           re-execute notebooks in place, to commit their outputs
    workbench lab [ARGS...]             JupyterLab on notebooks/ (--allow-root as root; lab --help)
    workbench audit MODULE:FUNCTION [--adapter A] [--device D] [--head-dim D] [--budget N] [--campaign] [--notebook PATH]
                    [--record FILE]
                                        check any varlen attention against the padding contract
    workbench bench [--quick] [--shapes T..] [--record FILE]
                                        time our kernel against torch's attention choices (CUDA)

Exit status: 0 success, 1 a claim does not hold or the build failed, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from workbench.adapter_example import REGISTER_EXAMPLE
from workbench.tables import fixed_width

EXIT_FAILED, EXIT_USAGE = 1, 2


def _info(args: argparse.Namespace) -> int:
    """Prints the platform the workbench runs on: what every recorded result is stamped with."""
    from workbench.provenance import provenance

    for key, value in provenance().items():
        print(f"{key:>12}: {value}")
    return 0


def _meta_from_source(path: Path) -> dict[str, str] | None:
    """`id`, `title` and `upstream_status` of the `META = Meta(...)` in a post-mortem's source
    (the package `path`, whose cases.py holds META, or a one-file module `path`.py), read without
    importing it (a post-mortem imports torch, Triton and matplotlib: seconds). None when they
    are not plain string literals there; the caller then imports the module."""
    import ast

    source = path / "cases.py" if path.is_dir() else path.with_suffix(".py")
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"), str(source))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "META" for t in node.targets)
            and isinstance(node.value, ast.Call)
        ):
            found = {
                kw.arg: kw.value.value
                for kw in node.value.keywords
                if kw.arg and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)
            }
            wanted = ("id", "title", "upstream_status")
            return {k: found[k] for k in wanted} if all(k in found for k in wanted) else None
    return None


def _list(args: argparse.Namespace) -> int:
    """The verdict column is the one recorded by the last site build (running every post-mortem
    would take minutes); `workbench repro ID` checks one now. Modules are read, not imported,
    so the listing is immediate; `repro` imports and validates one."""
    from workbench.registry import Registry, module_name, read_manifest

    registry = Registry()
    site = Path(args.site) if args.site else registry.root / "site" / "_build"
    built = {row["id"]: row["verdict"] for row in read_manifest(site).get("postmortems", [])}
    rows = [("id", "status", "verdict (last build)", "title")]
    for postmortem_id in registry.ids():
        meta = _meta_from_source(registry.package_dir / module_name(postmortem_id))
        if meta is None or meta["id"] != postmortem_id:
            pm = registry.get(postmortem_id)  # imports and validates: its error names the fix
            meta = {"id": pm.id, "title": pm.meta.title, "upstream_status": pm.meta.upstream_status}
        rows.append((meta["id"], meta["upstream_status"], built.get(meta["id"], "not built"), meta["title"]))
    if len(rows) == 1:
        print(f'no post-mortems in {registry.package_dir}; `workbench new ID "TITLE"` starts one.')
        return 0
    lines = fixed_width(rows).splitlines()
    width = None if args.wide else shutil.get_terminal_size().columns
    if width is not None:  # a title cut to the terminal ends in "..."; --wide prints it whole
        lines = [line if len(line) <= width else line[: max(width - 3, 0)] + "..." for line in lines]
    print("\n".join(lines))
    return 0


ID_RULE = re.compile(r"[a-z][a-z0-9-]*")


def _id_problem(command: str, postmortem_id: str, known: list[str] | None = None) -> str | None:
    """Why `postmortem_id` is not a valid id (None when it is), with the id to use instead: a
    module name (`te_thd_2892`) gets its hyphenated id, capitals their lowercase."""
    if ID_RULE.fullmatch(postmortem_id):
        return None
    suggestion = re.sub(r"[^a-z0-9]+", "-", postmortem_id.lower()).strip("-")
    kind = "a module name; ids use '-' where module names use '_'" if "_" in postmortem_id else "not an id"
    problem = (
        f"workbench {command}: {postmortem_id!r} is {kind}. An id is lowercase letters, digits and '-', "
        "starting with a letter (it names the notebook and the page)"
    )
    if ID_RULE.fullmatch(suggestion) and (known is None or suggestion in known):
        return f"{problem}; use {suggestion!r}."
    return problem + (f"; known ids: {', '.join(known)}." if known else ".")


class _Progress:
    """What `repro` is doing, on stderr while the post-mortem runs: each layout it packs (the
    registered CASES by number) and, after `quiet` seconds without news, a line saying it is
    still running. Needs nothing of the post-mortem module: it observes `workbench.pack`."""

    def __init__(self, cases: list, quiet: float = 5.0) -> None:
        import threading

        self.cases, self.quiet = cases, quiet
        self.seen: set = set()
        self.start = self.last = time.perf_counter()
        self.lock, self.done = threading.Lock(), threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True)

    def say(self, message: str) -> None:
        with self.lock:
            self.last = time.perf_counter()
            print(f"  {self.last - self.start:6.1f}s  {message}", file=sys.stderr, flush=True)

    def packed(self, case) -> None:
        if case in self.seen:
            return
        self.seen.add(case)
        where = f"case {self.cases.index(case) + 1}/{len(self.cases)}" if case in self.cases else f"layout {len(self.seen)}"
        self.say(f"{where}: {case.label()}")

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            if time.perf_counter() - self.last >= self.quiet:
                self.say(f"still reproducing ({len(self.seen)} layouts so far)")

    def __enter__(self) -> _Progress:
        import contextlib

        from workbench.layout import observing_packs

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(observing_packs(self.packed))
        self.ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.ticker.join()
        self._stack.close()


def _repro(args: argparse.Namespace) -> int:
    problem = _id_problem("repro", args.id)
    if problem:
        from workbench.registry import Registry

        print(_id_problem("repro", args.id, Registry().ids()), file=sys.stderr)
        return EXIT_USAGE
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

    started = time.perf_counter()
    pm = Registry().get(args.id)
    print(f"{pm.id}: {pm.meta.title}", flush=True)
    mode = "Triton interpreter" if DEVICE == "cpu" else "native Triton"
    print(
        f"  imported postmortems.{pm.name} in {time.perf_counter() - started:.1f}s; reproducing "
        f"{len(pm.module.CASES)} case(s) on {args.device or DEVICE} ({mode})",
        file=sys.stderr,
        flush=True,
    )
    with _Progress(list(pm.module.CASES)) as progress:
        results = pm.reproduce(device=args.device)
        progress.say(f"reproduced ({len(progress.seen)} layouts); checking {len(pm.claims)} claims")
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
    return 0 if not any(v.failed for v in verdicts) else EXIT_FAILED


def _build(args: argparse.Namespace) -> int:
    from workbench.site import build

    build(out=Path(args.out) if args.out else None, execute_notebooks=not args.no_execute, jobs=args.jobs)
    return 0


def _new(args: argparse.Namespace) -> int:
    problem = _id_problem("new", args.id)
    if problem:
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    from workbench.execute import execute_in_place
    from workbench.registry import Registry

    registry = Registry()
    package_path, notebook_path = registry.scaffold(args.id, args.title)
    print(f"wrote {package_path}/\nwrote {notebook_path}\nexecuting it (it is committed with its outputs)...", flush=True)
    execute_in_place(notebook_path, registry.root)
    print(
        f"done. Next: edit {package_path.name}/ (META and CASES in cases.py, reproduce in study.py, claims.py), then `workbench lab` to write the "
        f"notebook; `workbench repro {args.id}` checks the claims, `make test` runs nbval over the notebook."
    )
    return 0


def _execute(args: argparse.Namespace) -> int:
    from workbench.execute import execute_in_place
    from workbench.registry import Registry

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


LAB_HELP = """\
Opens JupyterLab on notebooks/, with this Python (so the workbench and the post-mortems
import). Other arguments go to `jupyter lab`, e.g. --no-browser --port 8899. Run as root (as
in most containers), it adds --allow-root, which JupyterLab otherwise demands.

Lab is where you write a notebook; `workbench execute ID` is what you commit. A notebook
run in Lab carries live explorer widgets, their state and your session's execution counts:
after editing, run `workbench execute ID` (explorers static, cells in order) before `git add`.
`make test` fails on a committed notebook that was saved from a Lab run, and says so.
"""


AUDIT_HELP = f"""\
Checks any varlen attention against the padding contract: REAL rows against the fp64 oracle,
GAP and TAIL rows exactly 0 under NaN-poisoned memory, empty and fully masked sequences, GQA,
windows, determinism; fuzzes random layouts; grades input validation apart. The verdict table
prints last.

A varlen function needs no adapter: its call is read off its parameter names (cu_seqlens_q or
cu_q, max_seqlen_q or max_q, softmax_scale or scale, causal or is_causal, window_size,
cu_seqlens_*_padded, seqused_*), e.g. f(q, k, v, cu_q, cu_k, max_q, max_k, causal=False,
scale=None). What it has no parameter for is n/a in the report, with the reason. Anything
else takes an adapter; registering one:

{REGISTER_EXAMPLE}
"""


def _lab(args: argparse.Namespace) -> int:
    from workbench.registry import Registry

    notebooks = Registry().notebooks_dir
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in args.jupyter_args
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={notebooks}",
        *(["--allow-root"] if as_root else []),
        *args.jupyter_args,
    ]
    print(f"JupyterLab on {notebooks}. Before committing a notebook you ran here: workbench execute ID", file=sys.stderr)
    return run_forwarding_signals(command)


def run_forwarding_signals(command: list[str]) -> int:
    """Runs `command` and returns its exit status; SIGTERM, SIGINT and SIGHUP sent to this process
    are passed on to it, so that stopping `workbench lab` by its PID stops JupyterLab too (it
    then shuts its kernels down itself) instead of leaving it running as an orphan."""
    child = subprocess.Popen(command)
    forwarded = [signal.SIGTERM, signal.SIGINT, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    previous = {sig: signal.signal(sig, lambda sig, frame: child.send_signal(sig)) for sig in forwarded}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    listing.add_argument("--wide", action="store_true", help="print titles whole (default: cut to the terminal's width)")
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

    lab = commands.add_parser(
        "lab",
        help="open JupyterLab on notebooks/ (other arguments go to jupyter lab, e.g. --no-browser)",
        description=LAB_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="workbench lab [-h] [JUPYTER_LAB_ARGUMENT ...]",
    )
    lab.set_defaults(func=_lab)

    audit = commands.add_parser(
        "audit",
        help="check any varlen attention against the padding contract: checks, bad inputs, fuzzer",
        description=AUDIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    audit.add_argument("target", help="MODULE:FUNCTION, e.g. kernels:varlen_attention or torch.nn.attention.varlen:varlen_attn")
    audit.add_argument(
        "--adapter",
        help="how to call it (default: read off a varlen function's parameter names, or guessed): "
        "e.g. sdpa-math, sdpa-efficient, sdpa-cudnn, sdpa-nested, bshd, dmattn-nobias, te-thd, or a registered one",
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
        "--head-dim",
        metavar="D|D_QK,D_V",
        help="head dim of the checks' cases and the fuzzer's layouts, e.g. 96, or 192,128 for q/k and v apart "
        "(default: 32 on CPU, 64 on CUDA; the fuzzer draws 16 and 32, or 64 and 128)",
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
    audit.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        help="each check and fuzz batch in a child process replaced after a CUDA error, crash or timeout, so one "
        "fault costs one cell (default: on CUDA)",
    )
    audit.add_argument("--check-timeout", type=float, metavar="S", help="with --isolate: a check past S seconds is not run")
    audit.add_argument("--checks", metavar="A,B", help="run only these checks (default: all)")
    audit.add_argument("--skip", metavar="A,B", help="run every check but these")
    audit.add_argument(
        "--campaign", action="store_true", help="also print each malformed call of the bad-input campaign (the record keeps them)"
    )
    audit.add_argument("--notebook", metavar="PATH", help="write a post-mortem notebook of the failing cases, executed")
    audit.add_argument(
        "--record",
        metavar="FILE",
        help="write the report with provenance as JSON (after each check too, marked partial until the end)",
    )
    audit.set_defaults(func=_audit)

    bench = commands.add_parser(
        "bench",
        help="time our kernel against torch varlen_attn, SDPA and FlexAttention (CUDA; --help for options)",
        add_help=False,
    )
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from workbench.errors import BuildError, RegistryError

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
