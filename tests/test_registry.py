"""The registry: id <-> module mapping, module and notebook shape checks, recorded verdicts."""

import ast
import types

import nbformat
import pytest

from workbench.postmortem import Claims, Verdict, verdict_table
from workbench.registry import (
    HEADER_TAG,
    PostMortem,
    Registry,
    RegistryError,
    check_notebook,
    module_name,
    postmortem_id,
    recorded_verdicts,
    validate_module,
)


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
    module_path, notebook_path = project.scaffold("my-bug-1", 'A "quoted" $title')
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
        ({"META": None}, "META must be a workbench.postmortem.Meta"),
        ({"CASES": ()}, "CASES must be a non-empty tuple"),
        ({"CASES": ("not a case",)}, "CASES must be a non-empty tuple"),
        ({"reproduce": lambda: {}}, r"define reproduce\(device=None\)"),
        ({"claims": Claims()}, "at least one registered claim"),
        ({"claims": None}, "claims must be a workbench.postmortem.Claims"),
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


def test_recorded_verdicts_are_read_back_exactly(project):
    project.scaffold("verdicts", "Title")
    pm = project.get("verdicts")
    first, second = pm.claims.statements
    printed = [Verdict(first, True, "1/1 cases"), Verdict(second, False, "0/1 cases")]
    nb = nbformat.read(pm.notebook, as_version=4)
    nb.cells[-1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=verdict_table(printed) + "\n")]
    assert recorded_verdicts(pm, nb) == printed

    nb.cells[-1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=verdict_table(printed[:1]) + "\n")]
    with pytest.raises(RegistryError, match=f"did not print a verdict for claim '{second}'"):
        recorded_verdicts(pm, nb)


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
    assert all(v.holds for v in verdicts), verdict_table(verdicts)
