"""CONTRIBUTING.md's worked examples, run as a contributor would run them.

Each example is a fenced block after a marker comment:

- `<!-- ci: file NAME -->`: the block is written to NAME in the section's scratch directory;
- `<!-- ci: run python -->`: the block runs in a fresh interpreter there (that directory first on
  its path, so the files above import);
- `<!-- ci: run shell -->`: each line runs in a shell there, with this environment's
  `varlen-workbench` on the PATH;
- `<!-- ci: run shell in a scratch project -->`: each `varlen-workbench` line runs in this
  process against an empty post-mortem package (the `project` fixture), not the repository's.

A section (a `## ` heading) shares one scratch directory, in order. A block the parser cannot
place fails the test rather than being skipped.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parent.parent / "CONTRIBUTING.md"
MARKER = re.compile(
    r"<!-- ci: (?P<what>file (?P<name>[\w.]+)|run python|run shell|run shell in a scratch project) -->\n```\w*\n(?P<code>.*?)```",
    re.S,
)


def examples() -> dict[str, list[tuple[str, str | None, str]]]:
    """Section title -> its examples in order: (what, file name or None, code)."""
    text = GUIDE.read_text()
    sections: dict[str, list[tuple[str, str | None, str]]] = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0]
        found = [(m["what"].split()[0] if m["name"] else m["what"], m["name"], m["code"]) for m in MARKER.finditer(section)]
        assert section.count("<!-- ci:") == len(found), f"{title}: a `<!-- ci: ... -->` marker not followed by a fenced block"
        if found:
            sections[title] = found
    return sections


def test_the_guide_has_the_three_worked_examples():
    assert set(examples()) == {"Add a backend", "Add an audit check", "Add a post-mortem"}


def _run(command: list[str], cwd: Path) -> str:
    env = os.environ | {"PYTHONPATH": str(cwd), "WORKBENCH_DEVICE": "cpu"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"{shlex.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


@pytest.mark.parametrize("section", ["Add a backend", "Add an audit check", "Add a post-mortem"])
def test_a_worked_example_runs_as_written(section, tmp_path, project, capsys):
    from varlen_workbench.workbench.cli.main import main

    for what, name, code in examples()[section]:
        if what == "file":
            (tmp_path / name).write_text(code)
        elif what == "run python":
            _run([sys.executable, "-c", code], tmp_path)
        elif what == "run shell":
            for line in filter(None, code.splitlines()):
                _run(["bash", "-c", line], tmp_path)
        else:  # in this process, against the scratch project the fixture made the CLI's registry
            for line in filter(None, code.splitlines()):
                argv = shlex.split(line)
                assert argv[0] == "varlen-workbench", line
                assert main(argv[1:]) == 0, f"{line}:\n{capsys.readouterr()}"
