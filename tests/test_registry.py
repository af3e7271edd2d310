"""The registry: id <-> module mapping, module and notebook shape checks, recorded verdicts, and
committed notebooks that show the current code (source listings re-rendered and compared)."""

import ast
import importlib
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

from varlen_workbench.workbench.cli.scaffold import python_string, render_package
from varlen_workbench.workbench.postmortem import METADATA_KEY, OURS, Claims, ClaimVerdict, claims_table
from varlen_workbench.workbench.registry import (
    HEADER_TAG,
    PACKAGE,
    PostMortem,
    Registry,
    RegistryError,
    check_notebook,
    module_name,
    postmortem_id,
    recorded_verdicts,
    validate_module,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "pm_id, name",
    [("torch-varlen-176793", "torch_varlen_176793"), ("te-thd-2892", "te_thd_2892"), ("flash-dmattn-121", "flash_dmattn_121")],
)
def test_ids_map_to_module_names_and_back(pm_id, name):
    assert module_name(pm_id) == name
    assert postmortem_id(name) == pm_id


@pytest.mark.parametrize("bad", ["", "1-starts-with-digit", "has space", "class", "-leading", "dot.ted", "naïve"])
def test_ids_that_cannot_name_a_module_are_refused(bad):
    with pytest.raises(RegistryError, match="does not map to a Python module name"):
        module_name(bad)


def test_the_scaffold_is_a_valid_postmortem_with_a_conforming_notebook(project):
    package_path, notebook_path = project.scaffold("my-bug-1", 'A "quoted" $title')
    assert project.ids() == ["my-bug-1"]
    pm = project.get("my-bug-1")
    assert pm.name == "my_bug_1" and pm.notebook == notebook_path
    assert pm.meta.title == 'A "quoted" $title'
    assert len(pm.claims) == 2
    check_notebook(pm)
    nb = nbformat.read(notebook_path, as_version=4)
    nbformat.validate(nb)
    assert nb.cells[0].metadata["tags"] == [HEADER_TAG]
    assert [c.id for c in nb.cells] == [f"cell-{i}" for i in range(len(nb.cells))]
    for cell in nb.cells:  # every code cell is valid Python
        if cell.cell_type == "code":
            ast.parse(cell.source)
    # It shows what every post-mortem shows, through the toolkit: one table, one figure, the
    # upstream status from the status file, the GPU records; and every claim carries its evidence level.
    source = "\n".join(c.source for c in nb.cells)
    shows = (
        "pm.results_table(results)",
        "pm.error_figure(results)",
        "pm.META.upstream_markdown(pm.STATUS)",
        "gpu_records(pm.META)",
    )
    for shown in shows:
        assert shown in source, shown
    # Each figure cell says what its figure shows (the site's alt text).
    figures = [
        c for c in nb.cells if c.cell_type == "code" and ("figure(" in c.source or "explore(" in c.source or "norms(" in c.source)
    ]
    assert figures and all(len(c.metadata.get("wb-alt", "").split()) > 8 for c in figures)
    # Its upstream status is an entry of the project's status file, added as "not checked".
    assert (
        pm.status.status == "not checked"
        and (project.root / "data" / "upstream-status.toml").read_text().count("[my-bug-1]") == 1
    )
    assert sorted(p.name for p in package_path.glob("*.py")) == ["__init__.py", "cases.py", "claims.py", "figures.py", "study.py"]
    module = "\n".join(p.read_text() for p in package_path.glob("*.py"))
    assert "table(" in module and "figure(" in module and module.count("evidence=") == len(pm.claims)
    assert all(level == OURS for level in pm.claims.levels)


@pytest.mark.parametrize(
    "title",
    ["plain", 'A "quoted" $title', "it's", "both ' and \" quotes", 'back\\slash "and" \'more\' "quotes"', "tab\there", "ünïcode"],
)
def test_python_string_is_what_ruff_format_writes(title):
    literal = python_string(title)
    assert ast.literal_eval(literal) == title
    assert literal[0] == ("'" if title.count('"') > title.count("'") else '"')


def test_scaffold_passes_lint(tmp_path):
    """A fresh scaffold, in a copy of the project's lint settings, passes `ruff check` and `ruff format --check`."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    package = tmp_path / "postmortems" / "my_kernel_nan_dk"
    package.mkdir(parents=True)
    for name, text in render_package("my-kernel-nan-dk", "my_kernel_nan_dk", 'it\'s a "quoted" $title', PACKAGE).items():
        (package / name).write_text(text)
    ruff = [sys.executable, "-m", "ruff"]
    for command in (["check", "--no-cache", "."], ["format", "--no-cache", "--check", "--diff", "."]):
        run = subprocess.run(ruff + command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr


def test_scaffold_refuses_to_overwrite_and_bad_input(project):
    project.scaffold("my-bug", "Title")
    with pytest.raises(RegistryError, match="already exists"):
        project.scaffold("my-bug", "Title")
    with pytest.raises(RegistryError, match="one non-empty line"):
        project.scaffold("other-bug", "  ")
    with pytest.raises(RegistryError, match="does not map"):
        project.scaffold("Other bug", "Title")
    assert project.ids() == ["my-bug"]


def test_unknown_id_lists_the_known_ones(project):
    project.scaffold("known-bug", "Title")
    with pytest.raises(RegistryError, match=r"no post-mortem 'unknown-bug'.*known: known-bug"):
        project.get("unknown-bug")


def _module_copy(pm: PostMortem, **changes) -> types.ModuleType:
    module = types.ModuleType(pm.module.__name__)
    module.__dict__.update({k: v for k, v in vars(pm.module).items() if not k.startswith("__")})
    for key, value in changes.items():
        if value is None:
            delattr(module, key)
        else:
            setattr(module, key, value)
    return module


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"META": None}, "META must be a varlen_workbench.workbench.postmortem.Meta"),
        ({"CASES": ()}, "CASES must be a non-empty tuple"),
        ({"CASES": ("not a case",)}, "CASES must be a non-empty tuple"),
        ({"reproduce": lambda: {}}, r"define reproduce\(device=None\)"),
        ({"claims": Claims()}, "at least one registered claim"),
        ({"claims": None}, "claims must be a varlen_workbench.workbench.postmortem.Claims"),
    ],
)
def test_malformed_modules_are_named_with_the_fix(project, changes, message):
    project.scaffold("shape-bug", "Title")
    module = _module_copy(project.get("shape-bug"), **changes)
    with pytest.raises(RegistryError, match=message) as error:
        validate_module(module)
    assert module.__name__ in str(error.value)


def test_meta_id_must_match_the_module_name(project):
    import dataclasses

    project.scaffold("right-name", "Title")
    pm = project.get("right-name")
    module = _module_copy(pm, META=dataclasses.replace(pm.meta, id="wrong-name"))
    with pytest.raises(RegistryError, match=r"META.id = 'wrong-name' belongs in module 'wrong_name'"):
        validate_module(module)


def test_notebook_conventions_are_enforced(project):
    project.scaffold("conventions", "Title")
    pm = project.get("conventions")
    nb = nbformat.read(pm.notebook, as_version=4)
    check_notebook(pm, nb)

    no_header = nbformat.from_dict(nb)
    no_header.cells[0].metadata["tags"] = []
    with pytest.raises(RegistryError, match="first cell must be a code cell tagged 'wb-header'"):
        check_notebook(pm, no_header)

    unmarked = nbformat.read(pm.notebook, as_version=4)
    unmarked.cells[-1].source = unmarked.cells[-1].source.replace("# NBVAL_CHECK_OUTPUT\n", "")
    with pytest.raises(RegistryError, match="nbval marker"):
        check_notebook(pm, unmarked)
    unmarked.cells[-1].metadata["tags"] = ["nbval-check-output"]  # the tag form counts too
    check_notebook(pm, unmarked)

    pm.notebook.unlink()
    with pytest.raises(RegistryError, match="has no notebook"):
        check_notebook(pm)


def _claims_output(verdicts):
    """The output `Claims.report` displays in a notebook: the table as text and HTML, the verdicts in metadata."""
    shown = claims_table(verdicts)
    return nbformat.v4.new_output(
        "display_data",
        data={"text/plain": str(shown), "text/html": shown._repr_html_()},
        metadata={METADATA_KEY: {"claims": [v.to_dict() for v in verdicts]}},
    )


def test_recorded_verdicts_are_read_back_exactly_from_output_metadata(project):
    project.scaffold("verdicts", "Title")
    pm = project.get("verdicts")
    first, second = pm.claims.statements
    shown = [ClaimVerdict(first, True, "1/1 cases", OURS), ClaimVerdict(second, False, "0/1 cases", OURS)]
    nb = nbformat.read(pm.notebook, as_version=4)
    nb.cells[-1].outputs = [_claims_output(shown)]
    assert recorded_verdicts(pm, nb) == shown

    # Printed text is never parsed back: a table printed without metadata carries no verdicts.
    printed = nbformat.v4.new_output("stream", name="stdout", text=str(claims_table(shown)) + "\n")
    nb.cells[-1].outputs = [printed]
    with pytest.raises(RegistryError, match="shows no claim verdicts; execute the notebook"):
        recorded_verdicts(pm, nb)

    nb.cells[-1].outputs = [_claims_output(shown[:1])]
    with pytest.raises(RegistryError, match=f"did not show a verdict for claim '{second}'"):
        recorded_verdicts(pm, nb)


def test_scaffold_and_registry_import_without_a_cycle():
    """varlen_workbench.workbench.cli.scaffold is plain text and nbformat: importing it alone must not pull in the registry."""
    code = "import sys, varlen_workbench.workbench.cli.scaffold; assert 'varlen_workbench.workbench.registry' not in sys.modules, 'scaffold imports the registry'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_notebooks_pair_postmortems_and_keep_plain_ones(project):
    project.scaffold("paired", "Title")
    plain = project.notebooks_dir / "instruments-demo.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), plain)
    pairs = project.notebooks()
    assert [(p.name, pm.id if pm else None) for p, pm in pairs] == [("instruments-demo.ipynb", None), ("paired.ipynb", "paired")]

    (project.notebooks_dir / "paired.ipynb").unlink()
    with pytest.raises(RegistryError, match="notebooks are missing"):
        project.notebooks()


@pytest.mark.parametrize("pm_id", Registry().ids())
def test_every_committed_postmortem_is_well_formed(pm_id):
    """The repository's own post-mortems: module shape, notebook conventions, committed verdicts."""
    pm = Registry().get(pm_id)
    check_notebook(pm)
    verdicts = recorded_verdicts(pm, nbformat.read(pm.notebook, as_version=4))
    assert [v.claim for v in verdicts] == pm.claims.statements
    # A claim on a GPU record nobody could make yet reads NOT RECORDED (with its command); none FAILS.
    assert not any(v.failed for v in verdicts), claims_table(verdicts)


_LISTING_CALL = re.compile(r"""^\s*(?:\w+\.)?listing\(\s*["']([^"']+)["']\s*\)\s*$""", re.MULTILINE)


def shown_listings(nb) -> list[tuple[int, str, str]]:
    """(cell index, listing name, text the committed output shows) for every cell that ends
    with `pm.listing("name")` (a post-mortem's source listings, printed through one helper)."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not (match := _LISTING_CALL.search(cell.source)):
            continue
        texts = [o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", []) if o.output_type == "execute_result"]
        found.append((index, match[1], "".join(texts)))
    return found


@pytest.mark.parametrize("pm_id", Registry().ids())
def test_committed_source_listings_match_the_current_code(pm_id):
    """A notebook that prints source code (`listing(name)`) must show the code as it is now:
    re-render each listing from the code and compare it with the committed output."""
    pm = Registry().get(pm_id)
    nb = nbformat.read(pm.notebook, as_version=4)
    listings = shown_listings(nb)
    if not listings:
        assert "inspect.getsource" not in "".join(c.source for c in nb.cells if c.cell_type == "code"), (
            f"{pm.notebook} prints source without listing(): route it through the module's listing() so it is checked"
        )
        pytest.skip(f"{pm_id} prints no source listing")
    module = importlib.import_module(pm.module.__name__)
    for index, name, shown in listings:
        current = str(module.listing(name))
        assert shown == current, (
            f"{pm.notebook}: cell {index} shows listing {name!r} as the code was, not as it is; "
            f"re-execute it (`varlen-workbench execute {pm_id}`)"
        )


def test_a_stale_listing_is_caught():
    """The check above can fail: a committed listing of an older `_dot` signature is found stale."""
    nb = nbformat.v4.new_notebook()
    stale = "def _dot(a, b, DOT_UPCAST: tl.constexpr):\n    return tl.dot(a, b)"
    nb.cells = [
        nbformat.v4.new_code_cell(
            'pm.listing("our _dot")', outputs=[nbformat.v4.new_output("execute_result", data={"text/plain": stale})]
        )
    ]
    from varlen_workbench.postmortems import triton_interpreter_bf16_dot as interp

    ((index, name, shown),) = shown_listings(nb)
    assert (index, name) == (0, "our _dot") and shown != str(interp.listing(name))


def test_a_claim_whose_gpu_record_is_missing_is_not_recorded_rather_than_failed(capsys):
    from types import SimpleNamespace

    from varlen_workbench.workbench.postmortem import UPSTREAM_GPU, ClaimFailed, overall_verdict, recorded_probes

    meta = SimpleNamespace(id="demo-bug")
    claims = Claims()

    @claims("the GPU run shows it", evidence=UPSTREAM_GPU)
    def _gpu(r):
        return recorded_probes(r.gpu, meta)["seen"], "seen"

    @claims("our kernel is right", evidence=OURS)
    def _ours(r):
        return r.ours, "checked"

    (gpu, ours) = claims.report(SimpleNamespace(gpu=None, ours=True))  # nothing raised: nothing failed
    assert not gpu.holds and gpu.unrecorded and not gpu.failed and gpu.verdict == "NOT RECORDED"
    assert "varlen-workbench repro demo-bug --device cuda --record data/gpu/demo-bug-<gpu>.json" in gpu.evidence
    assert ClaimVerdict.from_dict(gpu.to_dict()) == gpu and "unrecorded" not in ours.to_dict()
    assert overall_verdict([gpu, ours]) == "1/2 claims hold; 1 await a GPU record"
    assert "NOT RECORDED" in capsys.readouterr().out
    assert [v.holds for v in claims.check(SimpleNamespace(gpu={"probes": {"seen": True}}, ours=True))] == [True, True]
    with pytest.raises(ClaimFailed, match="the GPU run shows it"):
        claims.report(SimpleNamespace(gpu={"probes": {"seen": False}}, ours=True))
