"""Installs the way users do (issue #39): our wheel and transformers into a fresh venv, in both
orders, and the oldest transformers the swap supports. transformers 5.25 and later require Hugging
Face's `kernels`, whose import name was ours; each venv then checks that

- `pip check` is clean, and no file belongs to two distributions;
- ours installs one import name, `varlen_workbench`, and one command, `varlen-workbench`;
- from the repository root, `import transformers` works and `import kernels` is Hugging Face's, with
  its own API;
- the swap trains one step of a tiny Llama on the CPU within the bar of per-document SDPA
  (`varlen_workbench.workbench.instruments.realclient.check`, the real-client page's check).

What the venvs share, read-only: our wheel's own dependencies (torch, Triton, numpy, ...), linked
from this environment (`layer`), so that no venv downloads or unpacks torch again; and the wheels of
transformers' dependencies, downloaded once into .venv/install-test/wheels (pip then runs with
--no-index). The files that could collide (ours, transformers, Hugging Face's `kernels`) are
installed into each venv itself, by this environment's pip. Versions come from
requirements/cpu.lock, as `make setup` takes them.

The GPU machine's route, scripts/install_editable.sh, runs last: no index, every installed package
kept, in a venv whose setuptools predates the licence field, with the carried wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import lock  # noqa: E402

from varlen_workbench.workbench.site import usage  # noqa: E402

pytestmark = pytest.mark.slow  # fresh venvs, pip installs and three training steps: a minute or two; the full suite runs it

WHEELS = ROOT / ".venv" / "install-test" / "wheels"  # downloaded once (transformers and its dependencies), kept between runs
SITE = Path(sysconfig.get_paths()["purelib"])  # this environment's site-packages: the layer links into it
TESTED = usage.transformers_range()
NEWEST = f"transformers=={TESTED.newest}"
OLDEST = f"transformers=={TESTED.oldest}.*"  # the floor's newest patch release
FOLDERS = ("kernels", "workbench", "postmortems")
SETUPTOOLS = next(line for line in lock.LOCK.read_text().splitlines() if line.startswith("setuptools=="))


def _run(command: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def layer(tmp_path_factory) -> Path:
    """Links to this environment's installed copies of our wheel's own dependencies (their
    closure, as the lock pins them), and nothing else: a venv that puts this directory on its path
    sees torch and the rest installed, and installs everything else itself."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    directory = tmp_path_factory.mktemp("layer")
    for dist in lock.closure([Requirement(r) for r in project["dependencies"]]).values():
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if (SITE / top).exists() and not (directory / top).exists():
                (directory / top).symlink_to(SITE / top)
    return directory


def _download(requirement: str, constraints: Path | None = None) -> None:
    """The wheels of `requirement` and its dependencies in WHEELS: offline when they are there."""
    command = [sys.executable, "-m", "pip", "download", "-q", "-d", WHEELS, requirement]
    command += ["-c", constraints] if constraints else []
    done = subprocess.run([*command, "--no-index", "--find-links", WHEELS], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        _run(command)  # from the index, once


@pytest.fixture(scope="module")
def floor_constraints(tmp_path_factory) -> Path:
    """The lock less transformers' own family, whose pins the oldest transformers cannot take."""
    family = {"transformers", "huggingface-hub", "tokenizers", "safetensors", "kernels", "hf-xet"}
    path = tmp_path_factory.mktemp("floor") / "constraints.txt"
    lines = lock.LOCK.read_text().splitlines()
    path.write_text("\n".join(line for line in lines if lock.canonical(line.partition("==")[0]) not in family) + "\n")
    return path


@pytest.fixture(scope="module")
def wheels(floor_constraints) -> Path:
    """WHEELS holding what the venvs install: both transformers with their dependencies, and the
    lock's setuptools (torch, from the layer, requires >= 77, which pip adds to each venv; and the
    GPU route carries it)."""
    _download(NEWEST, lock.LOCK)
    _download(OLDEST, floor_constraints)
    _download(SETUPTOOLS)
    return WHEELS


def _venv(path: Path, layer: Path) -> Path:
    """A fresh venv whose path ends with the layer. It gets no pip of its own: this environment's pip
    (the same version) installs into it with --python, which saves unpacking one per venv."""
    _run([sys.executable, "-m", "venv", "--without-pip", path])
    python = path / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(purelib) / "layer.pth").write_text(f"{layer}\n")  # after the venv's own site-packages
    return python


def _pip(python: Path, *args) -> str:
    return _run([sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check", *args]).stdout


def _install(python: Path, *args) -> None:
    # --no-compile: byte-compiling transformers' 4,000 files is most of an install's time, and no check needs it
    _pip(python, "install", "-q", "--no-compile", "--no-index", "--find-links", WHEELS, *args)


CHECK = """
import importlib.metadata as metadata, json, sys
from pathlib import Path
import transformers
from transformers import AutoModelForCausalLM  # what failed when our `kernels` shadowed theirs
from transformers.utils import import_utils
probe = getattr(import_utils, "is_kernels_available", None)  # transformers' verdict on Hub kernels, where it asks
found = {"transformers": transformers.__version__, "hub_available": probe() if probe else None}
try:
    import kernels
except ImportError:
    found["kernels"] = None
else:
    if kernels.__file__ is None:  # without Hugging Face's, the root's kernels/ as an empty namespace: no code runs
        found["kernels"] = "namespace"
    else:
        from kernels import get_kernel, kernelize  # Hugging Face's own API
        found["kernels"] = kernels.__file__
import dataclasses
from varlen_workbench.workbench.instruments import realclient as rc
size = dataclasses.replace(rc.SIZES["cpu"], layers=2)  # the second layer finds the first one's metadata
report = rc.check(size, "cpu", [rc.OURS], memories=("as is",))
run = report.run(rc.OURS.name)
found |= {"ours": run.status, "detail": run.detail, "meets_bar": report.meets_bar(run)}
owners, shared = {}, []
for dist in metadata.distributions(path=[sys.argv[1]]):
    for file in dist.files or []:
        where = str(file)
        if where in owners and not where.endswith(".pyc"):
            shared.append(f"{where}: {owners[where]} and {dist.metadata['Name']}")
        owners[where] = dist.metadata["Name"]
(ours,) = [d for d in metadata.distributions(path=[sys.argv[1]]) if d.metadata["Name"] == "varlen-postmortem-workbench"]
found["shared"] = shared
found["our_tops"] = sorted({Path(str(f)).parts[0] for f in ours.files if not str(f).startswith("..") and ".dist-info" not in str(f)})
found["our_scripts"] = sorted(e.name for e in ours.entry_points if e.group == "console_scripts")
print("FOUND " + json.dumps(found))
"""


def _check(python: Path) -> dict:
    """pip check, then CHECK from the repository root (first on sys.path, as `python -m pytest` puts it)."""
    assert "No broken requirements found" in _pip(python, "check")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")} | {"WORKBENCH_DEVICE": "cpu"}
    done = _run([python, "-c", CHECK, purelib], cwd=ROOT, env=env)
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("FOUND "))[len("FOUND ") :])
    assert found["ours"] == "ran" and found["meets_bar"], found
    assert found["shared"] == [] and found["our_tops"] == ["varlen_workbench"] and found["our_scripts"] == ["varlen-workbench"], (
        found
    )
    if found["kernels"] not in (None, "namespace"):
        assert Path(found["kernels"]).is_relative_to(purelib) and found["hub_available"], found
    return found


def test_ours_then_transformers(tmp_path, layer, built_wheel, wheels):
    """A fresh venv: this repository, then transformers (which brings Hugging Face's `kernels`)."""
    python = _venv(tmp_path / "venv", layer)
    _install(python, "-c", lock.LOCK, built_wheel)
    _install(python, "-c", lock.LOCK, NEWEST)
    found = _check(python)
    assert found["transformers"] == TESTED.newest and found["kernels"] is not None, found


def test_transformers_then_ours_keeping_what_is_installed(tmp_path, layer, built_wheel, wheels):
    """A venv that has transformers (with Hugging Face's `kernels`) and torch: the README's way to add
    the fix, with what is installed as constraints, changes none of them."""
    python = _venv(tmp_path / "venv", layer)
    _install(python, "-c", lock.LOCK, NEWEST)
    installed = tmp_path / "installed.txt"
    installed.write_text(_pip(python, "list", "--format=freeze"))
    _install(python, built_wheel, "-c", installed)
    before = dict(line.split("==") for line in installed.read_text().split())
    after = dict(line.split("==") for line in _pip(python, "list", "--format=freeze").split())
    assert {name: after[name] for name in before} == before, "adding the fix changed an installed package"
    found = _check(python)
    assert found["transformers"] == TESTED.newest and found["kernels"] is not None, found


def test_the_oldest_transformers_the_swap_supports(tmp_path, layer, built_wheel, wheels, floor_constraints):
    """pyproject.toml's floor, before transformers required Hugging Face's `kernels`."""
    python = _venv(tmp_path / "venv", layer)
    _install(python, "-c", floor_constraints, built_wheel)
    _install(python, "-c", floor_constraints, OLDEST)
    found = _check(python)
    assert found["transformers"].startswith(f"{TESTED.oldest}.") and found["kernels"] in (None, "namespace"), found
    assert not found["hub_available"], found


def test_the_gpu_images_route_with_an_older_setuptools(tmp_path, wheels):
    """scripts/install_editable.sh, as the GPU machine runs it (no index, every installed package kept),
    in a venv whose setuptools predates the licence field (ensurepip's): the carried wheel builds it."""
    python = tmp_path / "venv" / "bin" / "python"
    _run([sys.executable, "-m", "venv", tmp_path / "venv"])
    old = _run([python, "-c", "import setuptools; print(setuptools.__version__)"]).stdout.strip()
    if int(old.split(".")[0]) >= 77:
        pytest.skip(f"this Python's venv comes with setuptools {old}: nothing to carry")
    clone = tmp_path / "clone"
    for name in ("pyproject.toml", "README.md", "LICENSE", "scripts/install_editable.sh", *FOLDERS):
        source, target = ROOT / name, clone / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, target)
    carried = tmp_path / "carried"
    carried.mkdir()
    shutil.copy(next(wheels.glob(f"setuptools-{SETUPTOOLS.partition('==')[2]}-*.whl")), carried)
    env = {**os.environ, "PYTHON": str(python)}
    refused = subprocess.run(
        ["bash", clone / "scripts" / "install_editable.sh"], capture_output=True, text=True, env=env, timeout=300
    )
    assert refused.returncode == 1 and f"setuptools {old} here, and the build needs >= 77" in refused.stderr, refused.stderr
    done = _run(["bash", clone / "scripts" / "install_editable.sh"], env=env | {"SETUPTOOLS_WHEELS": str(carried)})
    assert "installed: varlen_workbench.workbench from " + str(clone) in done.stdout, done.stdout
    assert _run([python, "-c", "import setuptools; print(setuptools.__version__)"]).stdout.strip() == old  # the image's stays
    help_text = _run([python, "-m", "varlen_workbench.workbench.cli.main", "--help"], cwd=tmp_path).stdout
    assert help_text.startswith("usage: varlen-workbench ")
