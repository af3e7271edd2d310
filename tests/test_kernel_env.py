"""Executing a notebook prints nothing of the kernel's own: no transport warning per notebook."""

import subprocess
import sys
from pathlib import Path

import pytest

# The GPU machines carry no Jupyter packages (the lab extra): there this file is skipped.
nbformat = pytest.importorskip("nbformat", reason="the Jupyter packages (the lab extra) are not installed")

from varlen_workbench.workbench.site.execute import KERNEL_PROFILE, kernel_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # starts a Jupyter kernel: ~10 s
def test_executing_a_notebook_prints_no_kernel_warning(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import os\nprint(os.environ['IPYTHONDIR'])")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "n.ipynb")
    code = f"from pathlib import Path\nfrom varlen_workbench.workbench.site.execute import execute_in_place\nexecute_in_place(Path('n.ipynb'), Path({str(ROOT)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "without encryption" not in done.stderr and "WARNING" not in done.stderr, done.stderr
    (output,) = nbformat.read(tmp_path / "n.ipynb", as_version=4).cells[0].outputs
    ipython_dir = Path(output.text.strip())
    assert (ipython_dir / "profile_default" / "ipython_kernel_config.py").read_text() == KERNEL_PROFILE


def test_kernel_env_keeps_the_callers_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = kernel_env(tmp_path, static=True)
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path.resolve()), "/somewhere"]
    assert env["WORKBENCH_STATIC"] == "1" and Path(env["IPYTHONDIR"]).is_dir()
