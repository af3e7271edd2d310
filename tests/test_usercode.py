"""An error inside the user's own module is reported as itself: its type, its message and the line
of the user's code that raised it, for `varlen-workbench audit MODULE:FUNCTION`, `--import` and a
post-mortem's package; "cannot import module" only for a module that does not exist."""

from __future__ import annotations

import pytest
from conftest import FAST_FIX, scaffold_variant

from varlen_workbench.workbench.cli import main as cli
from varlen_workbench.workbench.usercode import UserModuleError, import_user_module, where_raised


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """A directory on sys.path, the working directory (as a user's package is to `varlen-workbench audit`)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(source)

    return write


def test_audit_reports_the_exception_raised_inside_the_users_module(modules, capsys):
    modules(
        "wb_user_nameerror",
        "import math\n\nSCALE = math.sqrt(HEAD_DIM)\n\ndef attn(q, k, v, cu_seqlens, max_seqlen):\n    return q\n",
    )
    assert cli.main(["audit", "wb_user_nameerror:attn", "--budget", "0"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert (
        "varlen-workbench audit: target 'wb_user_nameerror:attn': cannot load 'wb_user_nameerror': importing 'wb_user_nameerror' "
        "raised NameError: name 'HEAD_DIM' is not defined (at wb_user_nameerror.py, line 3)"
    ) in err, err
    assert "cannot import module" not in err


def test_a_missing_dependency_inside_the_module_is_its_error_not_the_modules_absence(modules, capsys):
    modules("wb_user_helper", "raise ImportError('flash_attn 2.8 is needed for its varlen functions')\n")
    modules("wb_user_deps", "import torch\nfrom wb_user_helper import varlen\n")
    assert cli.main(["audit", "wb_user_deps:attn"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert (
        "importing 'wb_user_deps' raised ImportError: flash_attn 2.8 is needed for its varlen functions "
        "(at wb_user_helper.py, line 1, reached from wb_user_deps.py, line 2)"
    ) in err, err
    assert cli.main(["audit", "wb_user_not_there:attn"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot import module 'wb_user_not_there': no module named 'wb_user_not_there'" in err, err


def test_import_flag_reports_the_exception_too(modules, capsys):
    modules(
        "wb_user_adapters", "from varlen_workbench.workbench.audit import register_adapter\n\nregister_adapter('x')(undefined)\n"
    )
    assert (
        cli.main(["audit", "varlen_workbench.workbench.reference:reference_attention", "--import", "wb_user_adapters"])
        == cli.EXIT_USAGE
    )
    err = capsys.readouterr().err
    assert (
        "varlen-workbench audit: --import wb_user_adapters: importing 'wb_user_adapters' raised NameError: name 'undefined' is not "
        "defined (at wb_user_adapters.py, line 3)"
    ) in err, err


def test_a_syntax_error_names_its_line(modules):
    modules("wb_user_syntax", "def attn(q, k, v:\n    return q\n")
    with pytest.raises(
        UserModuleError, match=r"raised SyntaxError: '\(' was never closed \(at wb_user_syntax\.py, line 1\)$"
    ) as raised:
        import_user_module("wb_user_syntax")
    assert isinstance(raised.value.__cause__, SyntaxError) and where_raised(raised.value.__cause__) == "wb_user_syntax.py, line 1"


def test_repro_reports_the_exception_inside_a_postmortem_package(project, capsys):
    study, _ = scaffold_variant(project, "broken-study", FAST_FIX)
    study.write_text(study.read_text() + "\nCASE_COUNT = len(CASSES)  # a typo at module level\n")
    line = len(study.read_text().splitlines())
    assert cli.main(["repro", "broken-study"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert (
        f"varlen-workbench repro: post-mortem 'broken-study' does not import: importing '{project.package}.broken_study' " in err
    )
    assert f"raised NameError: name 'CASSES' is not defined (at {study}, line {line}, reached from " in err, err
