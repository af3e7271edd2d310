"""The markers mean what pyproject.toml says: `gpu` tests skip themselves without native CUDA,
`make test-fast` deselects `slow`, and every test has a timeout."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import gpu_skip_reason

ROOT = Path(__file__).resolve().parent.parent


def run_pytest(tmp_path, source: str, *args: str, conftest: bool = True) -> str:
    """Runs pytest on one test file (beside a copy of our conftest); returns its report."""
    if conftest:
        (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(source))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            # nbval's import (nbformat's schema checkers) costs a child pytest seconds of CPU; no notebook here
            "-p",
            "no:nbval",
            "-rs",
            "-c",
            str(ROOT / "pyproject.toml"),
            *args,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    return done.stdout + done.stderr


SAMPLE = """
    import pytest

    @pytest.mark.gpu
    def test_on_gpu():
        pass

    @pytest.mark.slow
    def test_slow():
        pass

    def test_plain():
        pass
"""


def test_gpu_tests_skip_themselves_and_the_fast_loop_deselects_slow(tmp_path):
    report = run_pytest(tmp_path, SAMPLE, "-m", "not slow")
    reason = gpu_skip_reason()
    if reason is None:
        assert "2 passed, 1 deselected" in report, report
    else:
        assert "1 passed, 1 skipped, 1 deselected" in report, report
        assert reason in report
    makefile = (ROOT / "Makefile").read_text()
    fast = makefile[makefile.index("\ntest-fast:") :].split("\n\n")[0]
    assert '-m "not slow' in fast


@pytest.mark.slow  # a child pytest that must hang until its timeout: ~4 s
def test_a_hung_test_times_out(tmp_path):
    report = run_pytest(tmp_path, "import time\n\ndef test_hangs():\n    time.sleep(60)\n", "--timeout", "2", conftest=False)
    assert "1 failed" in report and "Timeout" in report, report


def test_every_test_has_a_timeout():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 60 <= int(options["timeout"]) <= 900
    pytest.importorskip("pytest_timeout")
