"""The `varlen-workbench` command line's parser: every subcommand, its arguments and help, with
no handler attached (`main.HANDLERS` runs them), so that code which only reads a command line
(the symptom routes' one-line tests, `varlen_workbench.workbench.symptoms`) imports no command."""

from __future__ import annotations

import argparse

from varlen_workbench.workbench.cli import audit_command

LAB_HELP = """\
Opens JupyterLab on notebooks/, with this Python (so the workbench and the post-mortems
import). Other arguments go to `jupyter lab`, e.g. --no-browser --port 8899. Run as root (as
in most containers), it adds --allow-root, which JupyterLab otherwise demands.

Lab is where you write a notebook; `varlen-workbench execute ID` is what you commit. A notebook
run in Lab carries live explorer widgets, their state and your session's execution counts:
after editing, run `varlen-workbench execute ID` (explorers static, cells in order) before `git add`.
`make test` fails on a committed notebook that was saved from a Lab run, and says so.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="varlen-workbench",
        description="Post-mortem workbench for silent numerical bugs in packed (varlen/THD) attention.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    commands.add_parser("info", help="versions, device and interpreter mode of this machine")

    listing = commands.add_parser("list", help="post-mortems with status and the verdict of the last site build")
    listing.add_argument("--site", help="built site to read verdicts from (default: site/_build)")
    listing.add_argument("--wide", action="store_true", help="print titles whole (default: cut to the terminal's width)")

    repro = commands.add_parser("repro", help="run a post-mortem's reproduction and claims without Jupyter")
    repro.add_argument("id", help="post-mortem id, e.g. torch-varlen-176793 (see `varlen-workbench list`)")
    repro.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA when available, else the Triton interpreter")
    repro.add_argument("--record", metavar="FILE", help="write verdicts and results with provenance as JSON")

    build = commands.add_parser("build", help="execute every notebook and build the static site (site/_build)")
    build.add_argument("--no-execute", action="store_true", help="render the committed outputs instead of executing (fast)")
    build.add_argument("--out", help="output directory (default: site/_build)")
    build.add_argument("--jobs", type=int, help="notebooks executed in parallel (default: one per CPU core)")

    new = commands.add_parser("new", help="scaffold a post-mortem module and its notebook, executed")
    new.add_argument("id", help="lowercase letters, digits and '-', e.g. flash-dmattn-121")
    new.add_argument("title", help="one line, in quotes")

    execute = commands.add_parser("execute", help="re-execute notebooks in place (as the site does), to commit them with outputs")
    execute.add_argument("notebooks", nargs="+", metavar="NAME", help="post-mortem id / notebook name, or a path to an .ipynb")

    commands.add_parser(
        "lab",
        help="open JupyterLab on notebooks/ (other arguments go to jupyter lab, e.g. --no-browser)",
        description=LAB_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="varlen-workbench lab [-h] [JUPYTER_LAB_ARGUMENT ...]",
    )

    audit_command.add_parser(commands)

    commands.add_parser(
        "bench",
        help="time our kernel against torch varlen_attn, SDPA and FlexAttention (CUDA; --help for options)",
        add_help=False,
    )

    gpu = commands.add_parser(
        "gpu-records",
        help="every committed GPU record, whether the code it measured changed since, and the calls that remake the stale ones",
    )
    gpu.add_argument(
        "--backfill",
        action="store_true",
        help="first fingerprint, from git history, the code each record without a fingerprint measured (data/gpu/fingerprints.json)",
    )
    return parser
