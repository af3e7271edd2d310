"""Packaging conventions: the CPU lock matches the environment it describes, and the wheel
carries the licence as an SPDX expression, the py.typed markers and the templates."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import lock  # noqa: E402


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


@pytest.mark.slow  # builds a wheel from a copy of the sources in a child process; the full suite runs it
def test_wheel_metadata(tmp_path):
    # Built from a copy: an in-tree build leaves build/ and an .egg-info beside the sources.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for package in ("workbench", "kernels", "postmortems"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode and "No module named" in done.stderr:
        pytest.skip(f"cannot build without isolation here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        meta = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta.splitlines()
    assert {"workbench/py.typed", "kernels/py.typed"} <= names
    assert any(n.startswith("workbench/templates/") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert 'Requires-Dist: pytest-timeout>=2.3; extra == "test"' in meta
