"""The README's commands work as written: every `varlen-workbench` subcommand it shows exists, its
`varlen-workbench new` example is a valid id that no post-mortem has, and it says how to get the
command on PATH."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from varlen_workbench.workbench.cli import main as cli
from varlen_workbench.workbench.registry import Registry, module_name

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_subcommand_shown_exists():
    shown = set(re.findall(r"^varlen-workbench ([\w-]+)", README, flags=re.MULTILINE))
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
    examples = [
        e for e in re.findall(r"^varlen-workbench new (\S+) ", README, flags=re.MULTILINE) if e != "ID"
    ]  # ID: the placeholder
    assert examples
    committed = _committed_ids()
    assert committed  # the repository's own post-mortems are found
    for postmortem_id in examples:
        assert cli._id_problem("new", postmortem_id) is None
        assert postmortem_id not in committed, (
            f"`varlen-workbench new {postmortem_id}` would collide with an existing post-mortem"
        )


def test_readme_says_how_to_put_workbench_on_path():
    assert "source .venv/bin/activate" in README and ".venv/bin/varlen-workbench" in README


def _section(title: str) -> str:
    """The README's `## title` section, up to the next one."""
    start = README.index(f"\n## {title}\n")
    return README[start : README.index("\n## ", start + 1)]


SWAP_CHECKS = """
assert model.config._attn_implementation == "varlen_contract"
assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
# The documents stay apart: the second one's logits do not move when the first one's tokens change.
with torch.no_grad():
    other = input_ids.clone()
    other[0, :5] = (other[0, :5] + 1) % config.vocab_size
    first, second = (model(input_ids=ids, position_ids=position_ids).logits[0, 5:] for ids in (input_ids, other))
assert torch.equal(first, second) and not torch.equal(model(input_ids=other).logits[0, 5:], second)
print("swapped")
"""


def test_start_here_swap_from_a_config_runs_as_written():
    """The start-here block, verbatim, in a fresh interpreter on the CPU: a model built from the config
    runs our kernel as its attention, trains a step with finite gradients, and keeps the packed
    documents apart."""
    (block,) = re.findall(r"```python\n(.*?)```", _section("NaN gradients? Start here"), flags=re.DOTALL)
    assert "attn_implementation=varlen_workbench.kernels.hf.register()" in block
    env = {**os.environ, "WORKBENCH_DEVICE": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", block + SWAP_CHECKS], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("swapped"), run.stderr[-3000:]


def test_start_here_names_what_exists():
    section = _section("NaN gradients? Start here")
    assert "make setup" in section and re.search(r"^setup:", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert "python -m varlen_workbench.workbench.instruments.realclient" in section and callable(
        importlib.import_module("varlen_workbench.workbench.instruments.realclient").main
    )
    assert "varlen-workbench audit mypkg.attn:my_varlen_attention" in section
    # The head dims are the contract's to state: the link goes to a section it has.
    assert "[docs/contract.md](docs/contract.md#the-call), The call" in section
    assert "\n## The call\n" in (ROOT / "docs" / "contract.md").read_text()
    assert README.index("## NaN gradients? Start here") < README.index("## The two commands")


def test_the_transformers_range_and_the_install_commands_are_the_tested_ones():
    """The range is pyproject.toml's floor and the lock's pin (usage.transformers_range, the use page's
    source too); the commands that add the fix to an existing environment are the ones
    tests/test_install.py runs."""
    from varlen_workbench.workbench.site.usage import transformers_range

    tested = transformers_range()
    newest = ".".join(tested.newest.split(".")[:2])
    assert f"It is tested on transformers\n{tested.oldest} and {newest}, the ends of the range it supports" in README
    section = _section("Use the fix in your environment")
    assert "pip list --format=freeze > installed.txt\npip install /path/to/this/clone -c installed.txt" in section
    install_test = (ROOT / "tests" / "test_install.py").read_text()
    assert '"list", "--format=freeze"' in install_test and 'built_wheel, "-c", installed' in install_test
