"""Imports run one way: postmortems -> workbench -> kernels, and no post-mortem imports another.

Read from the source (every import statement, at any depth), so a late import inside a function
counts as much as one at the top. The registry loads post-mortems by name (importlib), which is
the one road from workbench to postmortems. Every import of ours names the namespace
(`varlen_workbench.kernels`, ...): the old top-level names are other distributions' now.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "varlen_workbench"
FOLDERS = ("kernels", "workbench", "postmortems")  # the folders the namespace maps, each a layer


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def layer(module: str) -> str | None:
    """The folder (layer) of one of our modules, None for anyone else's."""
    names = module.split(".")
    return names[1] if names[0] == NAMESPACE and len(names) > 1 else None


@pytest.mark.parametrize(("package", "forbidden"), [("kernels", {"workbench", "postmortems"}), ("workbench", {"postmortems"})])
def test_lower_layers_never_import_upper_ones(package, forbidden):
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(package)
        for line, module in imported(path)
        if layer(module) in forbidden
    ]
    assert not wrong, wrong


def test_no_postmortem_imports_another():
    wrong = []
    for path in sources("postmortems"):
        own = path.relative_to(ROOT / "postmortems").parts[0].removesuffix(".py")
        for line, module in imported(path):
            names = module.split(".")
            if layer(module) == "postmortems" and len(names) > 2 and names[2] != own:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, wrong


@pytest.mark.parametrize("folder", [*FOLDERS, "tests", "benchmarks", "scripts", "docs"])
def test_no_import_names_an_old_top_level_package(folder):
    """`import kernels` is Hugging Face's package, `import workbench` a PyPI distribution's."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(folder)
        for line, module in imported(path)
        if module.split(".")[0] in FOLDERS
    ]
    assert not wrong, wrong


def test_the_rules_see_late_imports(tmp_path):
    """A check that cannot fail is no check: an import inside a function is found, old names too."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from varlen_workbench.postmortems.other import X\n    import kernels.hf\n")
    assert imported(sample) == [(2, "varlen_workbench.postmortems.other"), (3, "kernels.hf")]
    assert layer("varlen_workbench.postmortems.other") == "postmortems" and layer("kernels.hf") is None
