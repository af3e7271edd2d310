"""`varlen-workbench audit`: the command line of `varlen_workbench.workbench.audit.audit`.

`add_parser` declares the subcommand; its help names the checks, adapters, dtypes and defaults
from `varlen_workbench.workbench.audit_catalog`, read without importing the audit (torch), so that
`varlen-workbench --help` stays immediate. `run` audits in this process, on the device asked for.
"""

from __future__ import annotations

import argparse
import os
import sys

from varlen_workbench.workbench.adapter_example import REGISTER_EXAMPLE
from varlen_workbench.workbench.audit_catalog import (
    ADAPTERS,
    BACKEND_ADAPTER_PREFIX,
    CASE_DTYPES,
    CHECKS,
    DEFAULT_BUDGET,
    DEFAULT_DTYPE,
    DEFAULT_HEAD_DIM,
    per_device,
)
from varlen_workbench.workbench.cli import EXIT_FAILED, EXIT_USAGE

HELP = f"""\
Checks any varlen attention against the padding contract: REAL rows against the fp64 oracle,
GAP and TAIL rows exactly 0 under NaN-poisoned memory, empty and fully masked sequences, GQA,
windows, determinism, the lse where it returns one; fuzzes random layouts; grades input
validation apart. The verdict table prints last.

A varlen function needs no adapter: its call is read off its parameter names (cu_seqlens_q or
cu_q, max_seqlen_q or max_q, scale or softmax_scale, causal or is_causal, window_size,
cu_seqlens_*_padded, seqused_*, return_lse), e.g. f(q, k, v, cu_q, cu_k, max_q, max_k,
causal=False, scale=None), or self-attention's one set of boundaries, self_attn(q, k, v,
cu_seqlens, max_seqlen, causal=False, softmax_scale=None). What it has no parameter for is n/a
in the report, with the reason. Anything else takes an adapter; registering one:

{REGISTER_EXAMPLE}
"""


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Declares `audit` among `commands` (the subparsers of `varlen-workbench`)."""
    audit = commands.add_parser(
        "audit",
        help="check any varlen attention against the padding contract: checks, bad inputs, fuzzer",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    audit.add_argument(
        "target",
        help="MODULE:FUNCTION, e.g. varlen_workbench.kernels.varlen:varlen_attention or torch.nn.attention.varlen:varlen_attn",
    )
    audit.add_argument(
        "--adapter",
        help="how to call it (default: read off a varlen function's parameter names, or guessed): one of "
        f"{', '.join(ADAPTERS)}, {BACKEND_ADAPTER_PREFIX}BACKEND (our varlen_attention pinned to one backend), "
        "or a registered one",
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
    audit.add_argument("--dtype", choices=CASE_DTYPES, help=f"dtype of the checks' cases (default: {per_device(DEFAULT_DTYPE)})")
    audit.add_argument(
        "--head-dim",
        metavar="D|D_QK,D_V",
        help="head dim of the checks' cases and the fuzzer's layouts, e.g. 96, or 192,128 for q/k and v apart "
        f"(default: {per_device(DEFAULT_HEAD_DIM)} for the checks; the fuzzer draws its profile's own)",
    )
    audit.add_argument(
        "--budget", type=int, metavar="N", help=f"layouts the fuzzer tries (default: {per_device(DEFAULT_BUDGET)}; 0: none)"
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
    audit.add_argument("--checks", metavar="A,B", help=f"run only these checks (default: all), of {', '.join(CHECKS)}")
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
    return audit


def parse_head_dims(text: str) -> tuple[int, int | None]:
    """`--head-dim`'s value: "96" -> (96, None), "192,128" -> (192, 128) (q and k's, v's)."""
    parts = text.split(",")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--head-dim {text!r}: pass D (e.g. 96) or D_QK,D_V (e.g. 192,128: q and k's, then v's).")
    dims = [int(p) for p in parts]
    return dims[0], (dims[1] if len(dims) == 2 else None)


def run(args: argparse.Namespace) -> int:
    """Exit 0 all applicable checks hold, 1 something fails, 2 bad usage (or nothing could run
    here, e.g. CUDA-only code on a CPU). The whole audit runs in this process on `--device`: the
    device is passed to everything it runs, whatever the default device is."""
    import torch

    from varlen_workbench.workbench.audit import AuditReport, audit
    from varlen_workbench.workbench.audit.spelling import command_line
    from varlen_workbench.workbench.records import with_fingerprint, write_json
    from varlen_workbench.workbench.usercode import UserModuleError, import_user_module

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"varlen-workbench audit: --device cuda but torch {torch.__version__} sees no CUDA device; use --device cpu.",
            file=sys.stderr,
        )
        return EXIT_USAGE

    def write(report: AuditReport) -> None:
        """The record at --record, whole or not at all: a run killed mid-write keeps the last one."""
        write_json(args.record, with_fingerprint(args.record, report.to_dict()))

    if os.getcwd() not in sys.path:  # like `python -m`: the user's modules in the working directory import
        sys.path.insert(0, os.getcwd())
    try:
        with command_line():  # its errors and n/a reasons name --flags, not keywords
            for module in args.imports:
                try:
                    import_user_module(module)
                except UserModuleError as exc:
                    raise ValueError(f"--import {module}: {exc}") from exc
            head_dim, head_dim_v = parse_head_dims(args.head_dim) if args.head_dim else (None, None)
            report = audit(
                args.target,
                args.adapter,
                device=args.device,
                dtype=args.dtype,
                head_dim=head_dim,
                head_dim_v=head_dim_v,
                budget=args.budget,
                seed=args.seed,
                time_limit=args.time_limit,
                workers=args.workers,
                isolate=args.isolate,
                check_timeout=args.check_timeout,
                checks=args.checks.split(",") if args.checks else None,
                skip=args.skip.split(",") if args.skip else (),
                log=lambda line: print(line, file=sys.stderr, flush=True),
                checkpoint=write if args.record else None,
            )
    except (ValueError, ImportError) as exc:
        print(f"varlen-workbench audit: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(report.render(campaign=args.campaign))
    if args.record:
        write(report)
        print(f"recorded to {args.record}")
    if args.notebook:
        from varlen_workbench.workbench.errors import BuildError

        try:
            print(f"wrote {report.write_notebook(args.notebook)} (executed)")
        except (ValueError, BuildError) as exc:
            print(f"varlen-workbench audit: notebook not written: {exc}", file=sys.stderr)
            return EXIT_FAILED
    if not report.ran:
        return EXIT_USAGE
    return 0 if report.passed else EXIT_FAILED
