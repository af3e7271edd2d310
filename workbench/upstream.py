"""Loading upstream code as it is installed: the one way the workbench imports a library it studies.

Two needs recur. A package imports, at import time, a dependency it never declares and the
studied code never uses (flash_sparse_attn 2.0.x imports OpenAI's `triton_kernels`, which ships
inside Triton's source tree, not on PyPI, for its projection kernels only): `import_module(...,
stub=...)` stands a stub in for the missing package, and every name taken from the stub raises
ImportError naming it when used. And a study runs one installed file exactly as shipped, but
apart from its package (whose `__init__` may need what is missing) or with Python's assertions
stripped (`python -O`, for upstream `assert q.is_cuda` lines under the Triton interpreter):
`run_file` executes that file unmodified as a module of its own, with optional stand-ins in
`sys.modules` for the duration of its imports only.

    from varlen_workbench.workbench.upstream import import_module, run_file
    fsa = import_module("flash_sparse_attn", stub={"triton_kernels": "flash_sparse_attn"})
    triton = run_file(installed_file("flash-dmattn", "flash_dmattn/flash_dmattn_triton.py"), optimize=1)
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.metadata
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["MissingName", "StubFinder", "import_module", "installed_file", "run_file", "stub_missing", "stubbed"]


class MissingName:
    """A name imported from a stubbed package: calling, instantiating or subscripting it raises ImportError.

    Subclassable and subscriptable (`class X(stub.Base)`, `stub.Config[int]` at import time are
    fine): only using it fails, with the package and the reason it was stubbed."""

    package = "?"
    used_by = "?"

    def __init__(self, *args, **kwargs):
        raise ImportError(
            f"{self.package} is not installed; a stub stands in for it so that {self.used_by} imports "
            f"(varlen_workbench.workbench.upstream), and this name needs the real package"
        )

    def __class_getitem__(cls, item):
        return cls


class StubFinder:
    """Import hook: `package` and every `package.x.y` import as empty stubs whose names are `MissingName`s."""

    def __init__(self, package: str, used_by: str):
        self.package, self.used_by = package, used_by
        self.missing = type(f"Missing_{package}", (MissingName,), {"package": package, "used_by": used_by})

    def find_spec(self, name, path=None, target=None):
        if name != self.package and not name.startswith(self.package + "."):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name, f"stub for the missing {self.package} (varlen_workbench.workbench.upstream)")
        module.__path__ = []
        missing = self.missing

        def attribute(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return missing

        module.__getattr__ = attribute
        return module

    def exec_module(self, module):
        pass


def stubbed() -> list[str]:
    """The packages a stub stands in for in this process."""
    return [f.package for f in sys.meta_path if isinstance(f, StubFinder)]


def stub_missing(package: str, used_by: str) -> bool:
    """Makes `package` importable as a stub when it is not installed; True if the stub is in place.

    An installed `package` is left alone (False). `used_by` says who needs the import, for the
    error a stubbed name raises when used."""
    if package in stubbed():
        return True
    try:
        importlib.import_module(package)
    except ImportError:
        sys.modules.pop(package, None)
        sys.meta_path.insert(0, StubFinder(package, used_by))
        return True
    return False


def import_module(
    name: str, *, stub: Mapping[str, str] | None = None, install: str = "", for_interpreter: bool | None = None
) -> types.ModuleType:
    """Imports `name` as installed, after stubbing each missing package of `stub` (package -> who imports it).

    Its Triton kernels are decorated for Triton's CPU interpreter when `for_interpreter` (default:
    where the default device's kernels are interpreted, `varlen_workbench.kernels.runtime.interpreted(default_device())`),
    else for compilation: `triton.jit` decides when it decorates, so a module's first import
    fixes it for the process. A missing `name` itself is a ModuleNotFoundError saying how to
    install it (`install`: the pip command; default `pip install <top-level name>`)."""
    from varlen_workbench.kernels._compat import default_device
    from varlen_workbench.kernels.runtime import decorating_for_interpreter, interpreted

    for package, used_by in (stub or {}).items():
        stub_missing(package, used_by)
    if for_interpreter is None:
        for_interpreter = interpreted(default_device())
    try:
        with decorating_for_interpreter() if for_interpreter else contextlib.nullcontext():
            return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.partition(".")[0]
        if exc.name not in (name, top):
            raise
        raise ModuleNotFoundError(f"{name} is not installed: {install or 'pip install ' + top}", name=exc.name) from exc


def installed_file(distribution: str, relative: str) -> Path:
    """The file `relative` (e.g. "flash_dmattn/flash_dmattn_flex.py") of an installed distribution,
    found without importing its package."""
    try:
        found = Path(str(importlib.metadata.distribution(distribution).locate_file(relative)))
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModuleNotFoundError(f"{distribution} is not installed: pip install --no-deps {distribution}") from exc
    if not found.exists():
        version = importlib.metadata.version(distribution)
        raise FileNotFoundError(f"{distribution} {version} has no {relative} (looked at {found})")
    return found


@contextlib.contextmanager
def _standing_in(modules: Mapping[str, types.ModuleType]) -> Iterator[None]:
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def run_file(
    path: str | Path, name: str | None = None, *, optimize: int = 0, stand_ins: Mapping[str, types.ModuleType] | None = None
) -> types.ModuleType:
    """Executes the upstream file at `path`, unmodified, as a new module `name` (default: `_upstream_<stem>`).

    The module is registered in `sys.modules` (Triton resolves a kernel's globals through its
    module). `optimize=1` compiles it as `python -O` does (assertions stripped, nothing else).
    `stand_ins` (module name -> module) are visible in `sys.modules` while the file's top level
    runs, and only then: the rest of the process keeps what it had."""
    path = Path(path)
    name = name or f"_upstream_{path.stem}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    code = compile(path.read_text(), str(path), "exec", optimize=optimize)
    sys.modules[name] = module
    try:
        with _standing_in(stand_ins or {}):
            exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
