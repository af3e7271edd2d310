"""Imports run one way: postmortems -> workbench -> kernels, and no post-mortem imports another.

Read from the source (every import statement, at any depth), so a late import inside a function
counts as much as one at the top. The registry loads post-mortems by name (importlib), which is
the one road from workbench to postmortems.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(module: str) -> str:
    return module.partition(".")[0]


@pytest.mark.parametrize(("package", "forbidden"), [("kernels", {"workbench", "postmortems"}), ("workbench", {"postmortems"})])
def test_lower_layers_never_import_upper_ones(package, forbidden):
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(package)
        for line, module in imported(path)
        if top(module) in forbidden
    ]
    assert not wrong, wrong


def test_no_postmortem_imports_another():
    wrong = []
    for path in sources("postmortems"):
        parts = path.relative_to(ROOT / "postmortems").parts
        own = parts[0].removesuffix(".py") if len(parts) > 1 or parts[0] != "__init__.py" else None
        for line, module in imported(path):
            names = module.split(".")
            if names[0] == "postmortems" and len(names) > 1 and names[1] != own:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, wrong


def test_the_rule_sees_late_imports(tmp_path):
    """A check that cannot fail is no check: an import inside a function is found."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from postmortems.other import X\n    import workbench.layout\n")
    assert imported(sample) == [(2, "postmortems.other"), (3, "workbench.layout")]


def test_no_lazy_name_of_workbench_shadows_one_of_its_modules():
    """`from workbench import probe` must stay the function after `import workbench.probes`: a name
    exported lazily never equals a submodule's name (importing the submodule would rebind it)."""
    import workbench

    modules = {path.stem for path in (ROOT / "workbench").glob("*.py")} | {
        path.parent.name for path in (ROOT / "workbench").glob("*/__init__.py")
    }
    assert not modules & set(workbench._EXPORTS), modules & set(workbench._EXPORTS)
