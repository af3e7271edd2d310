"""varlen_workbench.workbench.upstream: stubs for missing imports, installed files run unmodified."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from varlen_workbench.workbench import upstream


@pytest.fixture
def isolated_imports():
    """Restores sys.meta_path and the modules a test stubbed or ran."""
    meta_path, modules = list(sys.meta_path), dict(sys.modules)
    yield
    sys.meta_path[:] = meta_path
    for name in set(sys.modules) - set(modules):
        del sys.modules[name]


def test_a_missing_package_imports_as_a_stub_whose_names_raise_only_when_used(isolated_imports):
    assert upstream.stub_missing("no_such_pkg_wb", "some_library")
    from no_such_pkg_wb.sub.deeper import Config, kernel  # what an upstream __init__ does

    class Subclass(Config):  # subclassing and subscripting at import time work
        pass

    assert Config[int] is Config and "no_such_pkg_wb" in upstream.stubbed()
    with pytest.raises(ImportError, match="no_such_pkg_wb is not installed.*so that some_library imports"):
        kernel(1, 2)
    with pytest.raises(ImportError, match="no_such_pkg_wb"):
        Subclass()
    assert not hasattr(importlib.import_module("no_such_pkg_wb"), "__wrapped__")  # dunders stay honest (inspect, pickle)
    assert upstream.stub_missing("no_such_pkg_wb", "some_library")  # idempotent: one finder
    assert upstream.stubbed().count("no_such_pkg_wb") == 1


def test_an_installed_package_is_never_stubbed(isolated_imports):
    assert not upstream.stub_missing("json", "nobody")
    assert "json" not in upstream.stubbed()


def test_import_module_names_the_install_command_for_the_package_itself():
    with pytest.raises(ModuleNotFoundError, match="no_such_pkg_wb is not installed: pip install --no-deps x==1"):
        upstream.import_module("no_such_pkg_wb", install="pip install --no-deps x==1")


@pytest.mark.skipif(importlib.util.find_spec("flash_sparse_attn") is None, reason="flash-sparse-attn not installed")
def test_flash_sparse_attn_imports_with_triton_kernels_stubbed(isolated_imports):
    for name in [n for n in sys.modules if n.startswith(("flash_sparse_attn", "triton_kernels"))]:
        del sys.modules[name]
    fsa = upstream.import_module("flash_sparse_attn", stub={"triton_kernels": "flash_sparse_attn"})
    assert callable(fsa.flash_dense_attn_varlen_func)
    if "triton_kernels" in upstream.stubbed():
        from triton_kernels.matmul_ogs import matmul_ogs

        with pytest.raises(ImportError, match="triton_kernels is not installed"):
            matmul_ogs()


def test_run_file_executes_the_file_unmodified_with_stand_ins_for_its_imports_only(tmp_path, isolated_imports):
    source = "import wb_stand_in\nassert False, 'stripped under optimize=1'\nVALUE = wb_stand_in.X + 1\n"
    path = tmp_path / "upstream_file.py"
    path.write_text(source)
    stand_in = types.ModuleType("wb_stand_in")
    stand_in.X = 41
    with pytest.raises(AssertionError, match="stripped"):
        upstream.run_file(path, "wb_asserting", stand_ins={"wb_stand_in": stand_in})
    assert "wb_asserting" not in sys.modules  # a failed run leaves nothing behind
    module = upstream.run_file(path, optimize=1, stand_ins={"wb_stand_in": stand_in})
    assert module.VALUE == 42 and sys.modules["_upstream_upstream_file"] is module
    assert module.__file__ == str(path) and path.read_text() == source
    assert "wb_stand_in" not in sys.modules  # the stand-in was visible to the file's imports only


def test_installed_file_finds_a_file_without_importing_its_package():
    found = upstream.installed_file("pytest", "_pytest/__init__.py")
    assert found.name == "__init__.py" and found.exists()
    with pytest.raises(FileNotFoundError, match="has no _pytest/nothing.py"):
        upstream.installed_file("pytest", "_pytest/nothing.py")
    with pytest.raises(ModuleNotFoundError, match="not-a-distribution-wb is not installed"):
        upstream.installed_file("not-a-distribution-wb", "x.py")
