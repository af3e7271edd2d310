"""Shared test settings: bounded hypothesis runs so the suite fits CI's budget."""

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted

# The Triton interpreter is slow and timing on shared CI machines is noisy: no deadlines,
# few examples. `HYPOTHESIS_PROFILE=thorough` runs many more (e.g. natively on a GPU).
# Layouts come from varlen_workbench.workbench.strategies. Both profiles keep Hypothesis's replay database in
# .hypothesis/ where pytest runs (git-ignored): a failing layout is replayed first on the next
# run. Database and randomness are set explicitly because Hypothesis, when it sees a CI
# environment variable, starts from its own CI defaults (derandomized, no database).
# print_blob prints the line that reproduces a failure elsewhere, e.g. from a CI log.
_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
    derandomize=False,
    database=DirectoryBasedExampleDatabase(".hypothesis/examples"),
)
settings.register_profile("quick", max_examples=15, **_common)
settings.register_profile("thorough", max_examples=300, **_common)
settings.load_profile(__import__("os").environ.get("HYPOTHESIS_PROFILE", "quick"))


# -- post-mortem projects for the pipeline tests (registry, CLI, site, browser) -------------
# A project is a uniquely named post-mortem package in a temporary directory with notebooks/
# next to it, importable here and (through PYTHONPATH, see varlen_workbench.workbench.site.execute.kernel_env) in
# notebook kernels. Nothing is ever written to the repository's postmortems/.
import contextlib  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PLANTED_BUG = """from varlen_workbench.workbench.reference import reference_attention


def varlen_attention(q, *args, **kwargs):
    # Planted bug: a reduction over every row lets NaN padding reach every output.
    return reference_attention(q, *args, **kwargs) + 0 * q.sum()
"""
FAST_FIX = """from varlen_workbench.workbench.reference import reference_attention as varlen_attention
"""


def make_project(root: Path, name: str | None = None):
    """An empty post-mortem package under `root` (a fresh unique name unless given)."""
    from varlen_workbench.workbench.registry import Registry

    name = name or f"wbproject_{uuid.uuid4().hex[:8]}"
    if not (root / name).exists():
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text('"""Post-mortems of a test project."""\n')
        (root / "notebooks").mkdir()
    return Registry(name)


def scaffold_variant(project, postmortem_id: str, impl: str):
    """`varlen-workbench new`'s files with the studied kernel swapped for `impl` (PLANTED_BUG or
    FAST_FIX: the oracle, which needs no Triton interpreter). Not executed. Returns the
    package's study.py (where the kernel is imported) and the notebook."""
    from varlen_workbench.workbench.registry import forget_modules

    package_path, notebook_path = project.scaffold(postmortem_id, f"Variant {postmortem_id}")
    study = package_path / "study.py"
    text = study.read_text()
    assert "from varlen_workbench.kernels.varlen import varlen_attention\n" in text
    study.write_text(text.replace("from varlen_workbench.kernels.varlen import varlen_attention\n", impl))
    forget_modules(f"{project.package}.{package_path.name}")
    return study, notebook_path


def plain_notebook(path: Path, *sources: str) -> None:
    """A notebook that is not a post-mortem (no META): markdown then one code cell per source."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A plain notebook")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """An empty project, importable and made the CLI's default registry for this test."""
    from varlen_workbench.workbench import registry

    monkeypatch.syspath_prepend(str(tmp_path / "project"))
    project = make_project(tmp_path / "project")
    monkeypatch.setattr(registry, "PACKAGE", project.package)
    return project


@contextlib.contextmanager
def _once_per_run(tmp_path_factory, name: str):
    """Yields (directory, first): a directory shared by every xdist worker of this run, and
    whether this worker must fill it; the others wait on a lock meanwhile, then reuse it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield tmp_path_factory.mktemp(name), True
        return
    from filelock import FileLock  # a dependency of torch

    base = tmp_path_factory.getbasetemp().parent  # this run's directory, above the workers' own
    with FileLock(str(base / f"{name}.lock")):
        directory, done = base / name, base / f"{name}.done"
        first = not done.exists()
        if first:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
        yield directory, first
        done.touch()


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """(project, site directory), made once per test run: the untouched scaffold of `workbench
    new` (executed by it), a fast variant tagged differently and a plain notebook, all committed
    executed, and the site built by executing them afresh. Read-only for the tests."""
    from varlen_workbench.workbench import registry
    from varlen_workbench.workbench.cli.main import main
    from varlen_workbench.workbench.site.build import build
    from varlen_workbench.workbench.site.execute import execute_in_place

    with _once_per_run(tmp_path_factory, "built-site") as (directory, first), pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(directory))
        project = make_project(directory, "wbproject_scaffolded")
        if first:
            mp.setattr(registry, "PACKAGE", project.package)  # `varlen-workbench new` scaffolds into it
            assert main(["new", "scaffold-demo", "A scaffolded post-mortem"]) == 0
            study_path, notebook_path = scaffold_variant(project, "oracle-variant", FAST_FIX)
            cases_path = study_path.parent / "cases.py"
            cases_path.write_text(cases_path.read_text().replace('tags=("scaffold",)', 'tags=("scaffold", "oracle")'))
            plain = project.notebooks_dir / "plain-notes.ipynb"
            plain_notebook(plain, "print(6 * 7)")
            for path in (notebook_path, plain):
                execute_in_place(path, project.root)
            build(project, directory / "site" / "_build", log=lambda message: None)
    # The path stays importable for the session; PACKAGE is back to the repository's.
    sys.path.insert(0, str(directory))
    yield project, directory / "site" / "_build"
    sys.path.remove(str(directory))


@pytest.fixture(scope="session")
def published_site(tmp_path_factory) -> Path:
    """The repository's own site, rendered once per test run from the committed notebooks
    (`varlen-workbench build --no-execute`, seconds): the pages readers get. Read-only for the tests.
    WORKBENCH_PUBLISHED_SITE names a site built beforehand instead (a GPU machine without Jupyter
    runs the paste blocks from a site built elsewhere)."""
    if os.environ.get("WORKBENCH_PUBLISHED_SITE"):
        return Path(os.environ["WORKBENCH_PUBLISHED_SITE"]).resolve()
    from varlen_workbench.workbench.site.build import build

    with _once_per_run(tmp_path_factory, "published-site") as (directory, first):
        if first:
            build(out=directory / "_build", execute_notebooks=False, log=lambda message: None)
    return directory / "_build"


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> Path:
    """Our wheel, built once per test run from a copy of the sources (an in-tree build leaves
    build/ and an .egg-info beside them) with this environment's setuptools. Read-only."""
    with _once_per_run(tmp_path_factory, "built-wheel") as (directory, first):
        if first:
            source = directory / "source"
            source.mkdir()
            for name in ("pyproject.toml", "README.md", "LICENSE"):
                shutil.copy(REPO / name, source / name)
            for folder in ("workbench", "kernels", "postmortems"):
                shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
            command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(directory)]
            done = subprocess.run([*command, str(source)], capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
    (wheel,) = directory.glob("*.whl")
    return wheel


@pytest.fixture(scope="session")
def scaffolded(built_site):
    """The project holding the untouched `varlen-workbench new` post-mortem 'scaffold-demo'."""
    return built_site[0]


# -- options ---------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption(
        "--snippet-record",
        metavar="FILE",
        help="test_snippets: write each paste block run (sha256 of its text, verdict) with provenance to FILE",
    )


# -- markers ---------------------------------------------------------------------------------
def gpu_skip_reason() -> str | None:
    """Why `gpu` tests cannot run here (None when they can): they need the default device to be
    CUDA, with the kernels compiled there, not interpreted."""
    import torch

    if not torch.cuda.is_available():
        return f"gpu: torch {torch.__version__} sees no CUDA device"
    if default_device().type != "cuda":
        return "gpu: the default device is the CPU here (WORKBENCH_DEVICE=cpu)"
    if interpreted("cuda"):
        return "gpu: the kernels run through the Triton interpreter on CUDA here (TRITON_INTERPRET=1 before triton's import)"
    return None


# Session fixtures that build a site: every notebook executed (a minute on 2 cores), or every page
# rendered from the committed notebooks (~10 s of one worker). A test needing one reads pages,
# not code in the edit loop: it is slow, and the full suite runs it.
SITE_FIXTURES = {"built_site", "scaffolded", "published_site"}


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    """Tests that need a built site are marked `slow` (`make test-fast` skips them); tests
    marked `gpu` skip themselves where there is no native CUDA: no test needs its own skipif."""
    for item in items:
        if SITE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    reason = gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
