"""The README's commands work as written: every `workbench` subcommand it shows exists, its
`workbench new` example is a valid id that no post-mortem has, and it says how to get the
command on PATH."""

import re
from pathlib import Path

from workbench import cli
from workbench.registry import Registry

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_every_subcommand_shown_exists():
    shown = set(re.findall(r"^workbench (\w+)", README, flags=re.MULTILINE))
    commands = cli.build_parser()._subparsers._group_actions[0].choices  # argparse keeps them here
    assert shown and shown <= set(commands), shown - set(commands)


def test_new_example_is_a_fresh_valid_id():
    examples = [e for e in re.findall(r"^workbench new (\S+) ", README, flags=re.MULTILINE) if e != "ID"]  # ID: the placeholder
    assert examples
    for postmortem_id in examples:
        assert cli._id_problem("new", postmortem_id) is None
        assert postmortem_id not in Registry().ids(), (
            f"`workbench new {postmortem_id}` would collide with an existing post-mortem"
        )


def test_readme_says_how_to_put_workbench_on_path():
    assert "source .venv/bin/activate" in README and ".venv/bin/workbench" in README
