"""Shared test settings: bounded hypothesis runs so the suite fits CI's budget."""
# `kernels` first: without CUDA it switches Triton to the interpreter, which must happen before
# any test module imports triton.language (else tl.* stay compiled-mode functions).
import kernels  # noqa: F401
from hypothesis import HealthCheck, settings

# The Triton interpreter is slow and timing on shared CI machines is noisy: no deadlines,
# few examples. `HYPOTHESIS_PROFILE=thorough` runs many more (e.g. natively on a GPU).
settings.register_profile("ci", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(__import__("os").environ.get("HYPOTHESIS_PROFILE", "ci"))


# -- post-mortem projects for the pipeline tests (registry, CLI, site, browser) -------------
# A project is a uniquely named post-mortem package in a temporary directory with notebooks/
# next to it, importable here and (through PYTHONPATH, see workbench.site.kernel_env) in
# notebook kernels. Nothing is ever written to the repository's postmortems/.
import sys  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

PLANTED_BUG = '''from workbench import reference_attention


def varlen_attention(q, *args, **kwargs):
    # Planted bug: a reduction over every row lets NaN padding reach every output.
    return reference_attention(q, *args, **kwargs) + 0 * q.sum()
'''
FAST_FIX = '''from workbench import reference_attention as varlen_attention
'''


def make_project(root: Path, mp: pytest.MonkeyPatch):
    """An empty post-mortem package under `root`, made the CLI's default registry."""
    from workbench import registry

    name = f"wbproject_{uuid.uuid4().hex[:8]}"
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text('"""Post-mortems of a test project."""\n')
    (root / "notebooks").mkdir()
    mp.syspath_prepend(str(root))
    mp.setattr(registry, "PACKAGE", name)
    return registry.Registry(name)


def scaffold_variant(project, postmortem_id: str, impl: str):
    """`workbench new`'s files with the studied kernel swapped for `impl` (PLANTED_BUG or
    FAST_FIX: the oracle, which needs no Triton interpreter). Not executed."""
    module_path, notebook_path = project.scaffold(postmortem_id, f"Variant {postmortem_id}")
    text = module_path.read_text()
    assert "from kernels import varlen_attention\n" in text
    module_path.write_text(text.replace("from kernels import varlen_attention\n", impl))
    sys.modules.pop(f"{project.package}.{module_path.stem}", None)
    return module_path, notebook_path


@pytest.fixture
def project(tmp_path, monkeypatch):
    return make_project(tmp_path / "project", monkeypatch)


@pytest.fixture(scope="session")
def scaffolded(tmp_path_factory):
    """A project holding one untouched `workbench new` post-mortem, executed (once per worker)."""
    from workbench.cli import main

    with pytest.MonkeyPatch.context() as mp:
        project = make_project(tmp_path_factory.mktemp("scaffolded"), mp)
        assert main(["new", "scaffold-demo", "A scaffolded post-mortem"]) == 0
        yield project


def plain_notebook(path: Path, *sources: str) -> None:
    """A notebook that is not a post-mortem (no META): markdown then one code cell per source."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A plain notebook")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@pytest.fixture(scope="session")
def built_site(scaffolded, tmp_path_factory):
    """A site built by executing the scaffold, a fast variant tagged differently and a plain
    notebook (all three also committed executed): (project, site directory, pages)."""
    from workbench.site import build, execute_in_place

    module_path, notebook_path = scaffold_variant(scaffolded, "oracle-variant", FAST_FIX)
    module_path.write_text(module_path.read_text().replace('tags=("scaffold",)', 'tags=("scaffold", "oracle")'))
    plain = scaffolded.notebooks_dir / "plain-notes.ipynb"
    plain_notebook(plain, "print(6 * 7)")
    for path in (notebook_path, plain):
        execute_in_place(path, scaffolded.root)
    out = tmp_path_factory.mktemp("site") / "_build"
    pages = build(scaffolded, out, log=lambda message: None)
    return scaffolded, out, pages
