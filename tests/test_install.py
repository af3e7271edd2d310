"""Installs the way users do (issue #39): the GPU machine's route, scripts/install_editable.sh,
into a venv whose setuptools predates the licence field, with the carried wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import lock  # noqa: E402

pytestmark = pytest.mark.slow  # fresh venvs and pip installs: seconds to a minute; the full suite runs it

WHEELS = ROOT / ".venv" / "install-test" / "wheels"  # downloaded once, kept between runs
FOLDERS = ("kernels", "workbench", "postmortems")


def _run(command: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _wheels(requirement: str, constraints: Path | None) -> None:
    """The wheels of `requirement` and its dependencies in WHEELS: offline when they are there."""
    command = [sys.executable, "-m", "pip", "download", "-q", "-d", WHEELS, requirement]
    command += ["-c", constraints] if constraints else []
    done = subprocess.run([*command, "--no-index", "--find-links", WHEELS], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        _run(command)  # from the index, once


def test_the_gpu_images_route_with_an_older_setuptools(tmp_path):
    """scripts/install_editable.sh, as the GPU machine runs it (no index, every installed package kept),
    in a venv whose setuptools predates the licence field (ensurepip's): the carried wheel builds it."""
    python = tmp_path / "venv" / "bin" / "python"
    _run([sys.executable, "-m", "venv", tmp_path / "venv"])
    old = _run([python, "-c", "import setuptools; print(setuptools.__version__)"]).stdout.strip()
    if int(old.split(".")[0]) >= 77:
        pytest.skip(f"this Python's venv comes with setuptools {old}: nothing to carry")
    pinned = next(line for line in lock.LOCK.read_text().splitlines() if line.startswith("setuptools=="))
    _wheels(pinned, None)
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
    shutil.copy(next(WHEELS.glob(f"setuptools-{pinned.partition('==')[2]}-*.whl")), carried)
    env = {**os.environ, "PYTHON": str(python)}
    refused = subprocess.run(
        ["bash", clone / "scripts" / "install_editable.sh"], capture_output=True, text=True, env=env, timeout=300
    )
    assert refused.returncode == 1 and f"setuptools {old} here, and the build needs >= 77" in refused.stderr, refused.stderr
    done = _run(["bash", clone / "scripts" / "install_editable.sh"], env=env | {"SETUPTOOLS_WHEELS": str(carried)})
    assert "installed: varlen_workbench.workbench from " + str(clone) in done.stdout, done.stdout
    assert _run([python, "-c", "import setuptools; print(setuptools.__version__)"]).stdout.strip() == old  # the image's stays
    help_text = _run([python, "-m", "varlen_workbench.workbench.cli", "--help"], cwd=tmp_path).stdout
    assert help_text.startswith("usage: varlen-workbench ")
