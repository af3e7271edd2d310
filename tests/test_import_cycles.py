"""No import cycles among our modules, including those an import inside a function hides.

The graph is read from the syntax tree of every module of `varlen_workbench.kernels`,
`.workbench` and `.postmortems` (the repository folders pyproject.toml maps): every `import` and
`from ... import` anywhere in a file, module level or inside a function, except under
`if TYPE_CHECKING:` (never run). A function-level import only postpones a cycle to the first call;
the modules still depend on each other both ways.

What an import depends on: the module it names. `from pkg import name` is the submodule
`pkg.name` where that is a module, else `pkg` itself (its `__init__`, which defines `name`).
Python runs the `__init__` of every ancestor package first, but an ancestor being half-way
through its own imports (a package's `__init__` importing its children: the unavoidable
package -> child edge) breaks nothing unless the child needs a name the `__init__` defines, which
is the edge back that makes the cycle: so ancestors are not edges, and `from pkg import name` from
inside `pkg` is.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kernels": "varlen_workbench.kernels",
    "workbench": "varlen_workbench.workbench",
    "postmortems": "varlen_workbench.postmortems",
}


def modules(root: Path, folders: dict[str, str]) -> dict[str, Path]:
    """Module name -> file, for every .py file under each folder (a package is its `__init__.py`)."""
    found = {}
    for folder, package in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth, except in `if TYPE_CHECKING:` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _imports(child)


def dependencies(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules among `known` that module `name` (file `path`) imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for statement in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(statement, ast.Import):
            found.update(alias.name for alias in statement.names)
            continue
        base = statement.module or ""
        if statement.level:  # relative: from the package, up one per extra dot
            anchor = package.rsplit(".", statement.level - 1)[0] if statement.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        for alias in statement.names:
            found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def graph(root: Path, folders: dict[str, str]) -> dict[str, set[str]]:
    found = modules(root, folders)
    return {name: dependencies(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> dict[frozenset[str], list[str]]:
    """Each strongly connected group of more than one module (Tarjan's algorithm, iterative) with
    one import chain through it, from its first module by name back to it: ["a", "b", "a"]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return {frozenset(group): _chain(group, edges) for group in groups}


def _chain(group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest import chain within `group` from its first module back to it (breadth first)."""
    first = min(group)
    paths = {first: [first]}
    queue = [first]
    while queue:
        node = queue.pop(0)
        for child in sorted(edges[node] & group):
            if child == first:
                return [*paths[node], first]
            if child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def test_our_modules_import_one_another_without_a_cycle():
    edges = graph(REPO, PACKAGES)
    assert len(edges) > 100 and any(edges.values())  # the walk found our modules and their imports
    found = list(cycles(edges).values())
    assert not found, "import cycles (each import inside a function counts):\n" + "\n".join(" -> ".join(chain) for chain in found)


def test_the_detector_finds_a_cycle_hidden_in_a_function_and_ignores_type_checking(tmp_path):
    """A planted package: `a` imports `b` inside a function and `b` imports `a`: a cycle. The
    package's `__init__` imports its children (no cycle), `c` imports `a` only under
    TYPE_CHECKING (no edge), and `d` takes a name from the package's `__init__` (a cycle)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {
        "__init__.py": "from pkg import a, c\nfrom pkg.d import D\nNAME = 1\n",
        "a.py": "def late():\n    from pkg import b\n    return b\n",
        "b.py": "import pkg.a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nelse:\n    import json\n",
        "d.py": "from . import NAME\nD = NAME\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    edges = graph(tmp_path, {"pkg": "pkg"})
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.a"} and edges["pkg.c"] == set()
    assert edges["pkg"] == {"pkg.a", "pkg.c", "pkg.d"} and edges["pkg.d"] == {"pkg"}
    assert sorted(cycles(edges).values()) == [["pkg", "pkg.d", "pkg"], ["pkg.a", "pkg.b", "pkg.a"]]
