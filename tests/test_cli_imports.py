"""What the command line imports: the GPU image has torch and Triton but no Jupyter packages,
and the quick commands (`--help`, `list`) must not pay for torch at all.

Each test runs the real commands in a fresh interpreter, since this one has imported
everything already.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAST_FIX, scaffold_variant

ROOT = Path(__file__).resolve().parent.parent

# Top-level packages that exist only for Jupyter: none may be imported by audit, bench or repro.
JUPYTER = ("nbformat", "nbclient", "nbconvert", "IPython", "ipywidgets", "ipykernel", "jupyter")

RUNNER = """
import importlib.abc, json, sys

JUPYTER = {jupyter!r}


def jupyter_only(name):
    top = name.partition(".")[0]
    return top in JUPYTER or top.startswith("jupyter")


class Blocker(importlib.abc.MetaPathFinder):
    # Makes this interpreter a machine without the Jupyter packages.
    def find_spec(self, name, path=None, target=None):
        if jupyter_only(name):
            raise ImportError(f"{{name}} is blocked: the GPU image has no Jupyter packages")
        return None


if {block!r}:
    sys.meta_path.insert(0, Blocker())

from varlen_workbench.workbench import registry

from varlen_workbench.workbench.cli import main as cli
registry.PACKAGE = {package!r}
report = []
for argv in {commands!r}:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # --help
        rc = exc.code
    loaded = sorted(m for m in sys.modules if jupyter_only(m))
    report.append({{"argv": argv, "rc": rc, "jupyter": loaded, "torch": "torch" in sys.modules}})
print("REPORT " + json.dumps(report))
"""


def run_commands(project, commands, *, block):
    """Runs `workbench` commands one after the other in a fresh interpreter (importing
    `project`'s post-mortems); returns, per command, its exit status, the Jupyter modules
    loaded so far and whether torch was."""
    code = RUNNER.format(jupyter=JUPYTER, block=block, package=project.package, commands=commands)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(project.root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=project.root, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return json.loads(lines[-1][len("REPORT ") :])


# The commands a GPU machine runs: a post-mortem's claims, an audit of one check, the benchmark's
# entry point (its --help: on a GPU the benchmark itself would run for minutes).
GPU_COMMANDS = [
    ["repro", "fast-fix"],
    [
        "audit",
        "varlen_workbench.workbench.reference:reference_attention",
        "--adapter",
        "contract",
        "--budget",
        "0",
        "--checks",
        "gap-rows",
    ],
    ["bench", "--help"],
]


# Blocked is the GPU image; installed (a fresh interpreter running the same commands again) runs in the full suite.
@pytest.mark.parametrize(
    "block", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["jupyter-blocked", "jupyter-installed"]
)
def test_audit_bench_repro_need_no_jupyter_package(project, block):
    scaffold_variant(project, "fast-fix", FAST_FIX)
    report = run_commands(project, GPU_COMMANDS, block=block)
    assert [r["rc"] for r in report] == [0, 0, 0], report
    # Installed or not, none is imported: the GPU image lacks them, and here they would cost time.
    assert [r["jupyter"] for r in report] == [[], [], []], report


def test_help_and_list_import_neither_torch_nor_jupyter(project):
    """`varlen-workbench --help` and `list` answer at once: `list` reads each post-mortem's META from
    its source instead of importing the module (torch, Triton, matplotlib: seconds)."""
    scaffold_variant(project, "fast-fix", FAST_FIX)
    report = run_commands(project, [["--help"], ["list"]], block=True)
    assert [r["rc"] for r in report] == [0, 0]
    assert [r["torch"] for r in report] == [False, False], "torch imported by --help or list"


@pytest.mark.slow  # a fresh interpreter (torch, Triton, the project compiled): seconds; the full suite runs it
def test_info_needs_no_jupyter_package(project):
    (info,) = run_commands(project, [["info"]], block=True)
    assert info["rc"] == 0 and info["jupyter"] == []


def test_python_dash_m_workbench():
    done = subprocess.run(
        [sys.executable, "-m", "varlen_workbench.workbench", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: varlen-workbench ")
    for command in ("info", "list", "repro", "audit", "bench", "new", "lab"):
        assert command in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU exit path of `varlen-workbench bench`")
def test_bench_on_cpu_is_one_line_and_exit_2(capsys):
    from varlen_workbench.workbench.cli import main as cli

    assert cli.main(["bench", "--quick"]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("varlen-workbench bench: torch ") and "sees no CUDA device" in line


def test_instruments_resolve_lazily_and_unknown_names_raise():
    """`from varlen_workbench.workbench import instruments as wb`: every name is its module's own."""
    import importlib

    from varlen_workbench.workbench import instruments

    assert set(instruments.__all__) == set(instruments._EXPORTS) <= set(dir(instruments))
    for name, module in instruments._EXPORTS.items():  # every lazy name resolves to what its module defines
        assert getattr(instruments, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        instruments.no_such_name  # noqa: B018
