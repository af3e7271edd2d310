"""The README's commands work as written: every `workbench` subcommand it shows exists, its
`workbench new` example is a valid id that no post-mortem has, and it says how to get the
command on PATH."""

import re
import subprocess
from pathlib import Path

import pytest

from workbench import cli
from workbench.registry import Registry, module_name

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_subcommand_shown_exists():
    shown = set(re.findall(r"^workbench (\w+)", README, flags=re.MULTILINE))
    commands = cli.build_parser()._subparsers._group_actions[0].choices  # argparse keeps them here
    assert shown and shown <= set(commands), shown - set(commands)


def _committed_ids() -> set[str]:
    """Ids of the post-mortems git tracks: a newcomer who ran the README's example has an
    uncommitted scaffold of that id, which is the example working, not a collision."""
    run = subprocess.run(["git", "-C", str(ROOT), "ls-files", "postmortems"], capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        pytest.skip("not a git checkout: no committed post-mortems to compare with")
    names = {Path(line).relative_to("postmortems").parts[0].removesuffix(".py") for line in run.stdout.splitlines()}
    return {i for i in Registry().ids() if module_name(i) in names}


def test_new_example_is_a_valid_id_no_committed_postmortem_has():
    examples = [e for e in re.findall(r"^workbench new (\S+) ", README, flags=re.MULTILINE) if e != "ID"]  # ID: the placeholder
    assert examples
    committed = _committed_ids()
    assert committed  # the repository's own post-mortems are found
    for postmortem_id in examples:
        assert cli._id_problem("new", postmortem_id) is None
        assert postmortem_id not in committed, f"`workbench new {postmortem_id}` would collide with an existing post-mortem"


def test_readme_says_how_to_put_workbench_on_path():
    assert "source .venv/bin/activate" in README and ".venv/bin/workbench" in README
