"""Packaging conventions: the CPU lock matches the environment it describes; the wheel installs
one import name of our own, `varlen_workbench`, over the repository's folders, with the licence as
an SPDX expression, the py.typed markers and the templates; and no name of ours is anyone else's.
"""

import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import lock  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAMESPACE = "varlen_workbench"
FOLDERS = ("kernels", "workbench", "postmortems")  # varlen_workbench.<folder>, each a folder of the repository
SCRIPT = "varlen-workbench"

# The import names and console scripts of distributions a user of this project plausibly has beside
# it, and of those that own the names we had before: read by hand on 2026-12-07 from the wheels
# (`pip download --no-deps NAME==VERSION`, then top_level.txt or RECORD, and entry_points.txt).
# None may be ours. `pip index versions varlen-workbench`: no such distribution on PyPI that day.
CHECKED = {
    "kernels 0.19.1": ({"kernels"}, {"kernels"}),  # Hugging Face's Hub-kernel loader; transformers 5.25 requires it
    "kernels 0.18.3": ({"kernels"}, {"kernels"}),
    "transformers 5.25.0": ({"transformers"}, {"transformers"}),
    "transformers 4.51.3": ({"transformers"}, {"transformers-cli"}),
    "workbench 0.8.506": (
        {"workbench"},
        {"bedrock_verify", "bosco", "cloud_watch", "df_store", "endpoint_test", "ensemble_sim", "glue_launcher"}
        | {"lambda_test", "ml_pipeline_batch", "ml_pipeline_launcher", "ml_pipeline_sqs", "redis_tunnel"}
        | {"training_test", "workbench", "workbench_config"},
    ),
    "accelerate 1.16.0": (
        {"accelerate"},
        {"accelerate", "accelerate-config", "accelerate-estimate-memory"} | {"accelerate-launch", "accelerate-merge-weights"},
    ),
    "datasets 5.2.0": ({"datasets"}, {"datasets-cli"}),
    "peft 0.22.0": ({"peft"}, set()),
    "trl 1.16.0": ({"trl"}, {"trl"}),
    "liger-kernel 0.8.5": ({"liger_kernel"}, set()),
    "flash-attn-4 4.0.0b36": ({"flash_attn"}, set()),
    "transformer-engine 2.20.2": ({"transformer_engine"}, set()),
}


@pytest.mark.skipif(not torch.__version__.endswith("+cpu"), reason="the lock describes the CPU environment")
def test_cpu_lock_matches_this_environment():
    """Fails when a dependency changed (or was upgraded by hand) without `scripts/lock.py`."""
    expected = lock.render()
    assert lock.LOCK.read_text() == expected, "requirements/cpu.lock is stale: run `.venv/bin/python scripts/lock.py`"


def test_lock_pins_every_requirement_within_its_range():
    pins = {}
    for line in lock.LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[lock.canonical(name)] = version
    for requirement in lock.project_requirements():
        name = lock.canonical(requirement.name)
        assert name in pins, f"{requirement} is not pinned in requirements/cpu.lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {requirement}"
    assert pins["torch"].endswith("+cpu"), "the lock's torch must be the CPU build"
    assert "download.pytorch.org/whl/cpu" in lock.LOCK.read_text(), "the lock names where the CPU torch comes from"


def test_the_package_list_is_the_folders():
    """An editable install finds a subpackage missing from the list; a wheel leaves it out."""
    settings = PYPROJECT["tool"]["setuptools"]
    assert settings["package-dir"] == {f"{NAMESPACE}.{folder}": folder for folder in FOLDERS}
    # each top folder, and every folder of Python modules under one (templates/ holds none)
    on_disk = {f"{NAMESPACE}.{folder}" for folder in FOLDERS} | {
        ".".join((NAMESPACE, *path.relative_to(ROOT).parts))
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*")
        if path.is_dir() and path.name != "__pycache__" and any(path.glob("*.py"))
    }
    listed = set(settings["packages"])
    assert listed == on_disk, (
        f"pyproject.toml's [tool.setuptools] packages: add {sorted(on_disk - listed)}, drop {sorted(listed - on_disk)}"
    )


def test_no_top_folder_is_a_regular_package():
    """From the repository root (`python -m pytest` puts it first on sys.path), a folder with an
    __init__.py would be `import kernels` itself; without one it loses to an installed package."""
    assert [f"{folder}/__init__.py" for folder in FOLDERS if (ROOT / folder / "__init__.py").exists()] == []


PROBE = """
import importlib, json, sys
print(json.dumps({name: getattr(importlib.import_module(name), "__file__", None) for name in sys.argv[1:]}))
"""


def _import_from_root(names, env=None) -> dict:
    """`import NAME` for each name in a fresh interpreter run as `python -m` from the repository root,
    which puts the root first on sys.path as `python -m pytest` does."""
    probe_dir = Path(env["PROBE_DIR"]) if env else None
    command = [sys.executable, "-m", "wb_probe_imports", *names] if probe_dir else [sys.executable, "-c", PROBE, *names]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return __import__("json").loads(done.stdout.strip().splitlines()[-1])


def test_installed_packages_of_our_old_names_win_from_the_repository_root(tmp_path):
    """Regular packages named kernels, workbench and postmortems (Hugging Face's, PyPI's, anyone's),
    installed after the root on sys.path: `import NAME` from the root gets them, never our folder."""
    for name in FOLDERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHOSE = 'installed {name}'\n")
    (tmp_path / "wb_probe_imports.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PROBE_DIR": str(tmp_path)}
    found = _import_from_root(FOLDERS, env)
    assert found == {name: str(tmp_path / name / "__init__.py") for name in FOLDERS}


@pytest.mark.skipif(
    "kernels" not in importlib.metadata.packages_distributions().get("kernels", []),
    reason="Hugging Face's kernels is not installed here",
)
def test_hugging_faces_kernels_is_import_kernels_from_the_repository_root():
    found = _import_from_root(["kernels"])
    assert not Path(found["kernels"]).is_relative_to(ROOT / "kernels"), found
    assert Path(found["kernels"]).parent == Path(importlib.metadata.distribution("kernels").locate_file("kernels"))


def test_our_names_are_no_one_elses():
    """Our one import name and one command, against the checked wheels and every distribution here."""
    scripts = set(PYPROJECT["project"]["scripts"])
    assert scripts == {SCRIPT}
    for dist, (imports, commands) in CHECKED.items():
        assert NAMESPACE not in imports and not scripts & commands, dist
        assert not imports & {NAMESPACE}
    ours = PYPROJECT["project"]["name"]
    for dist in importlib.metadata.distributions():
        if lock.canonical(dist.metadata["Name"]) == lock.canonical(ours):
            continue
        top = {Path(f).parts[0].removesuffix(".py") for f in dist.files or [] if not str(f).startswith("..")}
        commands = {e.name for e in dist.entry_points if e.group == "console_scripts"}
        assert NAMESPACE not in top and SCRIPT not in commands, f"{dist.metadata['Name']} ships {NAMESPACE} or {SCRIPT}"


@pytest.mark.slow  # builds a wheel from a copy of the sources in a child process; the full suite runs it
def test_wheel_metadata(built_wheel):
    with zipfile.ZipFile(built_wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rpartition("/")[0]
        meta = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        top_level = archive.read(f"{info}/top_level.txt").decode().split()
    assert "License-Expression: Apache-2.0" in meta.splitlines()
    assert {f"{NAMESPACE}/workbench/py.typed", f"{NAMESPACE}/kernels/py.typed"} <= names
    assert {
        f"{NAMESPACE}/workbench/cli/templates/notebook.tmpl",
        f"{NAMESPACE}/workbench/cli/templates/postmortem/study.py.tmpl",
    } <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert 'Requires-Dist: pytest-timeout>=2.3; extra == "test"' in meta
    # One import name, no __init__.py of its own (a namespace), and one command.
    assert {n.split("/")[0] for n in names} == {NAMESPACE, info} and top_level == [NAMESPACE]
    assert f"{NAMESPACE}/__init__.py" not in names and f"{NAMESPACE}/kernels/varlen/__init__.py" in names
    assert re.findall(r"^(\S+) = ", entry_points, flags=re.MULTILINE) == [SCRIPT]


def test_every_gpu_runbook_command_installs_the_clone_first():
    """The GPU machine imports varlen_workbench only once this copy is installed, and a call may find a
    fresh machine: each command of the runbook that runs our code installs it first."""
    runbook = (ROOT / "docs" / "gpu-transformer-engine.md").read_text()
    commands = [line for block in re.findall(r"```sh\n(.*?)```", runbook, flags=re.DOTALL) for line in block.splitlines()]
    ours = [line for line in commands if re.search(r"python3 (scripts/|-m varlen_workbench)", line)]
    assert ours and all("bash scripts/install_editable.sh &&" in line.partition("python3 ")[0] for line in ours), ours
