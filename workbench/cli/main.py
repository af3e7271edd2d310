"""The `workbench` command line.

    varlen-workbench info                      versions, device, interpreter mode
    varlen-workbench list                      post-mortems with status and last built verdict
    varlen-workbench repro ID [--device D] [--record FILE]
                                        run a post-mortem's claims without Jupyter
    varlen-workbench build [--no-execute]      build the static site into site/_build
    varlen-workbench new ID "TITLE"            scaffold postmortems/<module>/ + notebooks/ID.ipynb
    varlen-workbench execute NAME...           re-execute notebooks in place, to commit their outputs
    varlen-workbench lab [ARGS...]             JupyterLab on notebooks/ (--allow-root as root; lab --help)
    varlen-workbench audit MODULE:FUNCTION [OPTIONS]
                                        check any varlen attention against the padding contract
    varlen-workbench bench [--quick] [--shapes T..] [--record FILE]
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
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from varlen_workbench.workbench.cli import EXIT_FAILED, EXIT_USAGE, audit_command
from varlen_workbench.workbench.cli.parser import build_parser
from varlen_workbench.workbench.tables import fixed_width


def _info(args: argparse.Namespace) -> int:
    """Prints the platform the workbench runs on: what every recorded result is stamped with."""
    from varlen_workbench.workbench.provenance import provenance

    for key, value in provenance().items():
        print(f"{key:>12}: {value}")
    return 0


def _title_from_source(path: Path) -> str | None:
    """The `title` of the `META = Meta(...)` in a post-mortem's source (the package `path`, whose
    cases.py holds META, or a one-file module `path`.py), read without importing it (a post-mortem
    imports torch, Triton and matplotlib: seconds). None when it is no plain string literal there;
    the caller then imports the module."""
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
            for kw in node.value.keywords:
                if kw.arg == "title" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    return kw.value.value
    return None


def _list(args: argparse.Namespace) -> int:
    """The verdict column is the one recorded by the last site build (running every post-mortem
    would take minutes); `varlen-workbench repro ID` checks one now. Modules are read, not imported,
    and the upstream status comes from data/upstream-status.toml, so the listing is immediate;
    `repro` imports and validates one."""
    from varlen_workbench.workbench.registry import Registry, module_name, read_manifest
    from varlen_workbench.workbench.upstream_status import statuses

    registry = Registry()
    site = Path(args.site) if args.site else registry.root / "site" / "_build"
    built = {row["id"]: row["verdict"] for row in read_manifest(site).get("postmortems", [])}
    upstream = statuses(registry.root)
    rows = [("id", "upstream", "verdict (last build)", "title")]
    for postmortem_id in registry.ids():
        title = _title_from_source(registry.package_dir / module_name(postmortem_id))
        if title is None or postmortem_id not in upstream:
            pm = registry.get(postmortem_id)  # imports and validates: its error names the fix
            title, status = pm.meta.title, pm.status
        else:
            status = upstream[postmortem_id]
        rows.append((postmortem_id, status.label, built.get(postmortem_id, "not built"), title))
    if len(rows) == 1:
        print(f'no post-mortems in {registry.package_dir}; `varlen-workbench new ID "TITLE"` starts one.')
        return 0
    print(_listing(rows, None if args.wide else shutil.get_terminal_size().columns))
    return 0


TITLE_MIN = 60  # a title column narrower than this shows too little of most titles: they go under their rows
TITLE_LINES = 2  # lines a title under its row may take before it is cut


def _listing(rows: Sequence[tuple[str, ...]], width: int | None) -> str:
    """`list`'s table for a terminal `width` columns wide (None: titles whole). Where the title
    column has TITLE_MIN columns, one line per post-mortem with its title cut at a word; where it
    has fewer, each title goes under its row, indented, on up to TITLE_LINES lines."""
    lines = fixed_width(rows).splitlines()
    if width is None:
        return "\n".join(lines)
    start = len(lines[0]) - len(rows[0][-1])  # the title column's first character
    if width - start >= TITLE_MIN:
        titles = [rows[0][-1], "", *(row[-1] for row in rows[1:])]  # the rule line has none
        return "\n".join(
            line if len(line) <= width else line[:start] + textwrap.shorten(title, width - start, placeholder="...")
            for line, title in zip(lines, titles)
        )
    # id and status first: a row too long for the terminal loses the end of its verdict
    short = [
        line if len(line) <= width else line[: width - 3] + "..." for line in fixed_width([row[:-1] for row in rows]).splitlines()
    ]
    out = short[:2]
    for line, (*_, title) in zip(short[2:], rows[1:]):
        out += [
            line,
            *textwrap.wrap(
                title, width, initial_indent="    ", subsequent_indent="    ", max_lines=TITLE_LINES, placeholder="..."
            ),
        ]
    return "\n".join(out)


ID_RULE = re.compile(r"[a-z][a-z0-9-]*")


def _id_problem(command: str, postmortem_id: str, known: list[str] | None = None) -> str | None:
    """Why `postmortem_id` is not a valid id (None when it is), with the id to use instead: a
    module name (`te_thd_2892`) gets its hyphenated id, capitals their lowercase."""
    if ID_RULE.fullmatch(postmortem_id):
        return None
    suggestion = re.sub(r"[^a-z0-9]+", "-", postmortem_id.lower()).strip("-")
    kind = "a module name; ids use '-' where module names use '_'" if "_" in postmortem_id else "not an id"
    problem = (
        f"varlen-workbench {command}: {postmortem_id!r} is {kind}. An id is lowercase letters, digits and '-', "
        "starting with a letter (it names the notebook and the page)"
    )
    if ID_RULE.fullmatch(suggestion) and (known is None or suggestion in known):
        return f"{problem}; use {suggestion!r}."
    return problem + (f"; known ids: {', '.join(known)}." if known else ".")


class _Progress:
    """What `repro` is doing, on stderr while the post-mortem runs: each layout it packs (the
    registered CASES by number), each claim it checks, and, after `quiet` seconds without news, a
    line saying which of them is still running and for how long. Lines are cut to the terminal's
    `width`. Needs nothing of the post-mortem module: it observes `varlen_workbench.workbench.layout.pack`."""

    def __init__(self, cases: list, quiet: float = 5.0, width: int | None = None) -> None:
        import threading

        self.cases, self.quiet = cases, quiet
        self.width = width or shutil.get_terminal_size().columns
        self.seen: set = set()
        self.start = self.last = self.since = time.perf_counter()
        self.running = "the post-mortem's reproduce()"  # what runs now, named by the still-running line
        self.lock, self.done = threading.Lock(), threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True)

    def say(self, message: str) -> None:
        with self.lock:
            self.last = time.perf_counter()
            prefix = f"  {self.last - self.start:6.1f}s  "
            room = max(self.width - len(prefix), 20)
            print(prefix + textwrap.shorten(message, room, placeholder="..."), file=sys.stderr, flush=True)

    def now(self, what: str) -> None:
        """`what` starts: said now, and named while it runs."""
        self.running, self.since = what, time.perf_counter()
        self.say(what)

    def packed(self, case) -> None:
        if case in self.seen:
            return
        self.seen.add(case)
        where = f"case {self.cases.index(case) + 1}/{len(self.cases)}" if case in self.cases else f"layout {len(self.seen)}"
        self.now(f"{where}: {case.label()}")

    def claim(self, index: int, statement: str, count: int) -> None:
        self.now(f"claim {index + 1}/{count}: {statement}")

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            if time.perf_counter() - self.last >= self.quiet:
                running = time.perf_counter() - self.since
                self.say(f"still running ({running:.0f} s; {len(self.seen)} layouts so far) {self.running}")

    def __enter__(self) -> _Progress:
        import contextlib

        from varlen_workbench.workbench.layout import observing_packs

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(observing_packs(self.packed))
        self.ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.ticker.join()
        self._stack.close()


EVIDENCE_LINES = 3  # lines of a claim's evidence `repro` prints; --record keeps it whole


def claim_lines(verdicts: list, width: int) -> tuple[list[str], bool]:
    """The claims for a terminal `width` columns wide: verdict, evidence level and the claim on a
    line (the claim wrapped in its column), the evidence under it on up to EVIDENCE_LINES lines;
    and whether some evidence was cut."""
    verdict_width = max(len(v.verdict) for v in verdicts)
    level_width = max(len(v.level.short) for v in verdicts)
    indent = " " * (verdict_width + level_width + 4)
    room = max(width - len(indent), 20)
    lines, cut = [], False
    for v in verdicts:
        claim = textwrap.wrap(v.claim, room) or [""]
        lines.append(f"{v.verdict:<{verdict_width}}  {v.level.short:<{level_width}}  {claim[0]}")
        lines += [indent + more for more in claim[1:]]
        evidence = f"evidence: {v.evidence}"
        cut = cut or len(textwrap.wrap(evidence, room)) > EVIDENCE_LINES
        lines += [indent + line for line in textwrap.wrap(evidence, room, max_lines=EVIDENCE_LINES, placeholder=" ...")]
    return lines, cut


def _repro(args: argparse.Namespace) -> int:
    problem = _id_problem("repro", args.id)
    if problem:
        from varlen_workbench.workbench.registry import Registry

        print(_id_problem("repro", args.id, Registry().ids()), file=sys.stderr)
        return EXIT_USAGE
    import torch

    from varlen_workbench.kernels._compat import default_device
    from varlen_workbench.kernels.runtime import interpreted

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"varlen-workbench repro: --device cuda but torch {torch.__version__} sees no CUDA device; use --device cpu.",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.device and args.device != default_device().type:
        # The default device (WORKBENCH_DEVICE) is read once, at import, and the post-mortem's helpers and
        # its upstream imports follow it: rerun with it set, so that the whole run is on one device.
        env = {**os.environ, "WORKBENCH_DEVICE": args.device}
        record = ["--record", args.record] if args.record else []
        return subprocess.call([sys.executable, "-m", "varlen_workbench.workbench.cli.main", "repro", args.id, *record], env=env)
    from varlen_workbench.workbench.postmortem import overall_verdict
    from varlen_workbench.workbench.records import write_record
    from varlen_workbench.workbench.registry import Registry

    started = time.perf_counter()
    pm = Registry().get(args.id)
    width = shutil.get_terminal_size().columns
    print(textwrap.fill(f"{pm.id}: {pm.meta.title}", width, subsequent_indent="  "), flush=True)
    mode = "Triton interpreter" if interpreted(default_device()) else "native Triton"
    imported = (
        f"imported postmortems.{pm.name} in {time.perf_counter() - started:.1f}s; reproducing "
        f"{len(pm.module.CASES)} case(s) on {args.device or default_device().type} ({mode})"
    )
    print(textwrap.fill(imported, width, initial_indent="  ", subsequent_indent="    "), file=sys.stderr, flush=True)
    with _Progress(list(pm.module.CASES), width=width) as progress:
        results = pm.reproduce(device=args.device)
        progress.say(f"reproduced ({len(progress.seen)} layouts); checking {len(pm.claims)} claims")
        verdicts = pm.claims.check(results, starting=lambda i, statement: progress.claim(i, statement, len(pm.claims)))
    lines, cut = claim_lines(verdicts, width)
    print("\n".join(lines))
    if cut:
        print(f"(evidence cut to {EVIDENCE_LINES} lines; --record FILE keeps it whole)")
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
            "probes": probes(args.device or default_device().type) if probes else {},
        }
        write_record(args.record, payload)
        print(f"recorded to {args.record}")
    return 0 if not any(v.failed for v in verdicts) else EXIT_FAILED


def _build(args: argparse.Namespace) -> int:
    from varlen_workbench.workbench.site.build import build

    build(out=Path(args.out) if args.out else None, execute_notebooks=not args.no_execute, jobs=args.jobs)
    return 0


def _new(args: argparse.Namespace) -> int:
    problem = _id_problem("new", args.id)
    if problem:
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    from varlen_workbench.workbench.registry import Registry
    from varlen_workbench.workbench.site.execute import execute_in_place

    registry = Registry()
    package_path, notebook_path = registry.scaffold(args.id, args.title)
    print(f"wrote {package_path}/\nwrote {notebook_path}\nexecuting it (it is committed with its outputs)...", flush=True)
    execute_in_place(notebook_path, registry.root)
    print(
        f"done. Next: edit {package_path.name}/ (META and CASES in cases.py, reproduce in study.py, claims.py), then `varlen-workbench lab` to write the "
        f"notebook; `varlen-workbench repro {args.id}` checks the claims, `make test` runs nbval over the notebook."
    )
    return 0


def _execute(args: argparse.Namespace) -> int:
    from varlen_workbench.workbench.registry import Registry
    from varlen_workbench.workbench.site.execute import execute_in_place

    registry = Registry()
    for name in args.notebooks:
        path = Path(name) if name.endswith(".ipynb") else registry.notebooks_dir / f"{name}.ipynb"
        if not path.exists():
            print(
                f"varlen-workbench execute: {path} does not exist; give a notebook path or a name under {registry.notebooks_dir}.",
                file=sys.stderr,
            )
            return EXIT_USAGE
        print(f"executing {path}", flush=True)
        execute_in_place(path, registry.root)
    return 0


def _lab(args: argparse.Namespace) -> int:
    from varlen_workbench.workbench.registry import Registry

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
    print(f"JupyterLab on {notebooks}. Before committing a notebook you ran here: varlen-workbench execute ID", file=sys.stderr)
    return run_forwarding_signals(command)


PR_SET_PDEATHSIG = 1  # prctl(2): the signal the kernel sends a process when its parent dies


def _dies_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` after which the kernel sends the child SIGTERM when this process dies, however
    it dies (kill -9 included, which no handler of ours sees); None where there is no such signal
    (outside Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls it
    parent = os.getpid()

    def tie() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before the tie was made
            os.kill(os.getpid(), signal.SIGTERM)

    return tie


def run_forwarding_signals(command: list[str]) -> int:
    """Runs `command` and returns its exit status; SIGTERM, SIGINT and SIGHUP sent to this process
    are passed on to it, so that stopping `varlen-workbench lab` by its PID or Ctrl-C stops JupyterLab
    too (it then shuts its kernels down itself) instead of leaving it running as an orphan. On
    Linux the child also gets SIGTERM when this process dies unannounced (kill -9)."""
    child = subprocess.Popen(command, preexec_fn=_dies_with_parent())
    forwarded = [signal.SIGTERM, signal.SIGINT, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    previous = {sig: signal.signal(sig, lambda sig, frame: child.send_signal(sig)) for sig in forwarded}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _bench(args: argparse.Namespace) -> int:
    from varlen_workbench.workbench.bench.kernels import main as bench_main

    return bench_main(args.bench_args)


def _gpu_records(args: argparse.Namespace) -> int:
    from varlen_workbench.workbench.gpu_records import plan as gpu_plan
    from varlen_workbench.workbench.records import load_records

    if args.backfill:
        gpu_plan.backfill(load_records("*.json"))
    print(gpu_plan.report())
    return 0  # stale records are a plan, not a failure


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "info": _info,
    "list": _list,
    "repro": _repro,
    "build": _build,
    "new": _new,
    "execute": _execute,
    "lab": _lab,
    "bench": _bench,
    "gpu-records": _gpu_records,
    "audit": audit_command.run,
}


def main(argv: list[str] | None = None) -> int:
    from varlen_workbench.workbench.errors import BuildError, RegistryError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "lab":
        args.jupyter_args = extra
    elif args.command == "bench":
        args.bench_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return HANDLERS[args.command](args)
    except RegistryError as exc:
        print(f"varlen-workbench {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BuildError as exc:
        print(f"varlen-workbench {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
