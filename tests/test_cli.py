"""The `workbench` command line: list, repro (verdicts, exit status, records), new, lab."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import nbformat
import pytest
import torch
from conftest import FAST_FIX, PLANTED_BUG, plain_notebook, scaffold_variant

from varlen_workbench.workbench.cli import main as cli
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.registry import read_manifest, recorded_verdicts


def test_every_command_is_wired():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]  # argparse keeps them here
    assert set(commands) == set(cli.HANDLERS)  # every subcommand has its handler, and no handler is unreachable
    for argv in (["info"], ["list"], ["repro", "x"], ["build"], ["new", "x", "t"], ["execute", "x"], ["lab"]):
        assert callable(cli.HANDLERS[parser.parse_args(argv).command])
    with pytest.raises(SystemExit):
        parser.parse_args(["repro", "x", "--device", "tpu"])


@pytest.mark.slow
def test_new_scaffolds_an_executed_postmortem(scaffolded, capsys):
    pm = scaffolded.get("scaffold-demo")
    assert pm.meta.title == "A scaffolded post-mortem"
    nb = nbformat.read(pm.notebook, as_version=4)
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code"), "committed with outputs"
    verdicts = recorded_verdicts(pm, nb)  # from the claims cell's output metadata
    assert [v.holds for v in verdicts] == [True, True]
    claims_output = "".join(o.get("data", {}).get("text/plain", "") for o in nb.cells[-1].outputs)
    assert claims_output.count("HOLDS") == 2 and "FAILS" not in claims_output
    # The GPU section says so when nothing was recorded for this id.
    gpu = next(c for c in nb.cells if c.cell_type == "code" and "gpu_records(pm.META)" in c.source)
    assert "Not recorded yet" in gpu.outputs[0]["data"]["text/markdown"]


def test_new_rejects_bad_input_with_exit_2(project, capsys):
    assert cli.main(["new", "Bad Id", "Title"]) == cli.EXIT_USAGE
    assert "'Bad Id' is not an id" in capsys.readouterr().err
    assert cli.main(["new", "ok-id", "two\nlines"]) == cli.EXIT_USAGE
    assert "must be one non-empty line" in capsys.readouterr().err
    assert project.ids() == []


@pytest.mark.parametrize(
    ("typed", "suggested"), [("My_Bug", "my-bug"), ("te_thd_2892", "te-thd-2892"), ("Flash-DMAttn", "flash-dmattn")]
)
def test_new_refuses_ids_outside_the_rule_and_suggests_one(project, capsys, typed, suggested):
    assert cli.main(["new", typed, "x"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"use {suggested!r}" in err and "lowercase letters, digits and '-'" in err
    assert ("module name" in err) == ("_" in typed)
    assert project.ids() == [] and not list(project.notebooks_dir.glob("*.ipynb"))


def test_repro_suggests_the_id_of_a_module_name(project, capsys):
    scaffold_variant(project, "my-bug", FAST_FIX)
    assert cli.main(["repro", "my_bug"]) == cli.EXIT_USAGE
    assert "use 'my-bug'" in capsys.readouterr().err
    assert cli.main(["repro", "Other_Bug"]) == cli.EXIT_USAGE
    assert "known ids: my-bug" in capsys.readouterr().err


def test_repro_shows_progress_case_by_case_and_claim_by_claim_in_lines_that_fit(project, capsys, monkeypatch):
    scaffold_variant(project, "progress", FAST_FIX)
    monkeypatch.setattr(cli.shutil, "get_terminal_size", lambda: os.terminal_size((60, 24)))
    assert cli.main(["repro", "progress"]) == 0
    printed = capsys.readouterr()
    err = printed.err.splitlines()
    assert "imported postmortems.progress" in printed.err and "reproducing 1 case(s)" in " ".join(printed.err.split()), err
    assert any(line.split()[1:3] == ["case", "1/1:"] and "q=[5, 3]" in line for line in err), err
    assert any("reproduced (1 layouts); checking 2 claims" in line for line in err), err
    assert any(line.split()[1:3] == ["claim", "2/2:"] for line in err), err
    assert max(map(len, err + printed.out.splitlines())) <= 60, printed


def test_progress_says_what_is_still_running_in_lines_that_fit(capsys):
    case, long = Case(seqlens_q=(3,)), Case(seqlens_q=tuple(range(1, 200)))
    with cli._Progress([case, long], quiet=0.2, width=80) as progress:
        progress.packed(case)
        progress.packed(case)  # the same layout again: not repeated
        progress.packed(case.with_(seed=1))
        time.sleep(1.5)
        progress.packed(long)
        progress.claim(1, "padding rows of out, dq, dk, dv are exactly 0", 2)
        time.sleep(1.5)
    err = capsys.readouterr().err.splitlines()
    assert sum("case 1/2" in line for line in err) == 1 and any("layout 2: q=[3]" in line for line in err)
    assert any(re.search(r"still running \(\d+ s; 2 layouts so far\) layout 2: q=\[3\]", line) for line in err), err
    assert any(re.search(r"still running \(\d+ s; 3 layouts so far\) claim 2/2: padding rows of", line) for line in err), err
    assert any("case 2/2: q=[1, 2, 3," in line and line.endswith("...") for line in err), err
    assert max(map(len, err)) <= 80, err


def test_claim_lines_wrap_the_claim_and_cut_long_evidence():
    from varlen_workbench.workbench.postmortem import OURS, ClaimVerdict

    long = ClaimVerdict("padding rows of out, dq, dk, dv are exactly 0 " * 3, False, "row 7: nan; " * 60, OURS)
    short = ClaimVerdict("real rows match", True, "max error 0.1 of the bound", OURS)
    lines, cut = cli.claim_lines([long, short], 80)
    assert cut and max(map(len, lines)) <= 80, lines
    assert lines[0].startswith("FAILS  our kernel  padding rows") and lines[3].strip().startswith("evidence: row 7: nan;")
    assert lines[5].endswith(" ...") and lines[6].startswith("HOLDS  our kernel  real rows match")
    assert lines[7].strip() == "evidence: max error 0.1 of the bound" and len(lines) == 8
    assert not cli.claim_lines([short], 80)[1]


def test_repro_prints_verdicts_and_records_with_provenance(project, tmp_path, capsys):
    scaffold_variant(project, "holds", FAST_FIX)
    record = tmp_path / "out" / "holds.json"
    assert cli.main(["repro", "holds", "--device", "cpu", "--record", str(record)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"HOLDS\s+our kernel\s+padding rows of out, dq, dk, dv are exactly 0", printed)
    assert "2/2 claims hold" in printed
    data = json.loads(record.read_text())
    assert data["id"] == "holds" and data["verdict"] == "2/2 claims hold"
    assert [c["holds"] for c in data["claims"]] == [True, True]
    assert set(data["provenance"]) >= {"python", "torch", "triton", "device", "mode", "commit", "date"}
    (row,) = data["results"]["probes"]  # one case: a key/value pair, since Case keys are not strings
    assert row["key"]["seqlens_q"] == [5, 3]
    assert row["value"]["padding_exactly_zero"] is True and row["value"]["nonfinite_real"] == 0


def test_repro_exits_1_naming_the_failing_claims(project, capsys):
    scaffold_variant(project, "planted-bug", PLANTED_BUG)
    assert cli.main(["repro", "planted-bug"]) == cli.EXIT_FAILED
    printed = capsys.readouterr().out
    assert re.search(r"FAILS\s+our kernel\s+padding rows of out, dq, dk, dv are exactly 0", printed)
    assert re.search(r"FAILS\s+our kernel\s+real rows match the fp64 reference", printed)
    assert "0/2 claims hold" in printed


def test_repro_unknown_id_and_missing_cuda_exit_2(project, capsys):
    assert cli.main(["repro", "no-such-bug"]) == cli.EXIT_USAGE
    assert "no post-mortem 'no-such-bug'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        scaffold_variant(project, "needs-gpu", FAST_FIX)
        assert cli.main(["repro", "needs-gpu", "--device", "cuda"]) == cli.EXIT_USAGE
        assert "sees no CUDA device" in capsys.readouterr().err


def test_list_shows_status_and_the_last_built_verdict(project, capsys):
    scaffold_variant(project, "listed", FAST_FIX)
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["id", "upstream", "verdict", "(last", "build)"]
    assert lines[2].split()[:5] == ["listed", "not", "checked", "not", "built"]  # the scaffold's status entry

    site = project.root / "site" / "_build"
    site.mkdir(parents=True)
    (site / "manifest.json").write_text(json.dumps({"postmortems": [{"id": "listed", "verdict": "2/2 claims hold"}]}))
    assert read_manifest(site)["postmortems"][0]["id"] == "listed"
    assert cli.main(["list"]) == 0
    assert "  2/2 claims hold" in capsys.readouterr().out.splitlines()[2]


@pytest.mark.parametrize("columns", [60, 100, 200])
def test_list_fits_the_terminal_without_importing_the_modules(project, capsys, monkeypatch, columns):
    module_path, _ = scaffold_variant(project, "a-rather-long-post-mortem-id-2024", FAST_FIX)
    title = "A title far longer than any terminal line: " + "padding rows, cu_seqlens, NaN gradients " * 4
    meta_file = module_path.parent / "cases.py"
    meta_file.write_text(meta_file.read_text().replace('title="Variant a-rather-long-post-mortem-id-2024"', f"title={title!r}"))
    monkeypatch.setattr(cli.shutil, "get_terminal_size", lambda: os.terminal_size((columns, 24)))
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= columns
    assert lines[2].startswith("a-rather-long-post-mortem-id-2024") and lines[2].split()[1:3] == ["not", "checked"]
    if lines[0].endswith("title"):  # room for titles: one line each, cut at a word
        assert columns - lines[0].index("title") >= cli.TITLE_MIN and len(lines) == 3
        assert lines[2].endswith("...") and title.startswith(lines[2][lines[0].index("title") : -3])
    else:  # the title under its row, on two lines, cut at a word
        assert columns - len(lines[0]) < cli.TITLE_MIN and lines[3].startswith("    A title far longer than any")
        assert lines[4].startswith("    ") and lines[4].endswith("...") and len(lines) == 5
    assert cli.main(["list", "--wide"]) == 0
    assert capsys.readouterr().out.splitlines()[2].endswith(title.strip())  # whole
    assert not any(name.startswith(f"{project.package}.") for name in sys.modules)  # read, not imported


def test_list_shows_every_title_readably_at_80_columns():
    """The repository's own post-mortems, as a newcomer's 80-column terminal shows them."""
    from varlen_workbench.workbench.registry import Registry

    listed = subprocess.run(
        [sys.executable, "-m", "varlen_workbench.workbench", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert listed.returncode == 0, listed.stderr
    lines, text = listed.stdout.splitlines(), " ".join(listed.stdout.split())
    assert max(map(len, lines)) <= 80, lines
    for postmortem_id in Registry().ids():
        row = next(line for line in lines if line.startswith(f"{postmortem_id} "))
        title = cli._title_from_source(Registry().package_dir / postmortem_id.replace("-", "_"))
        assert row.split()[1] in listed.stdout and " ".join(title.split()[:8]) in text, (title, listed.stdout)


def test_list_without_postmortems_says_how_to_start(project, capsys):
    assert cli.main(["list"]) == 0
    assert "varlen-workbench new" in capsys.readouterr().out


@pytest.mark.slow  # executes a notebook end to end: ~4 s
def test_execute_saves_notebooks_with_outputs(project, capsys):
    plain_notebook(project.notebooks_dir / "notes.ipynb", "print(6 * 7)")
    assert cli.main(["execute", "notes"]) == 0
    cell = nbformat.read(project.notebooks_dir / "notes.ipynb", as_version=4).cells[1]
    assert cell.execution_count == 1 and cell.outputs[0].text == "42\n"
    assert cli.main(["execute", "missing"]) == cli.EXIT_USAGE
    assert "missing.ipynb does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("uid", [0, 1000], ids=["root", "user"])
def test_lab_opens_jupyterlab_on_notebooks(project, monkeypatch, uid):
    calls = []
    monkeypatch.setattr(cli, "run_forwarding_signals", lambda command: calls.append(command) or 0)
    monkeypatch.setattr(cli.os, "geteuid", lambda: uid)
    assert cli.main(["lab", "--no-browser", "--port", "8899"]) == 0
    (command,) = calls
    assert command[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={project.notebooks_dir}" in command
    assert command[-3:] == ["--no-browser", "--port", "8899"]
    assert ("--allow-root" in command) == (uid == 0)  # JupyterLab refuses root without it
    calls.clear()
    assert cli.main(["lab", "--allow-root"]) == 0
    assert calls[0].count("--allow-root") == 1


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = f"/proc/{pid}/stat"
    return not (os.path.exists(stat) and open(stat).read().rpartition(")")[2].split()[0] == "Z")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGTERM,
        signal.SIGINT,
        pytest.param(
            signal.SIGKILL, marks=pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal")
        ),
    ],
    ids=["SIGTERM", "SIGINT", "SIGKILL"],
)
def test_lab_stops_its_child_when_signalled(tmp_path, sig):
    """`varlen-workbench lab` killed by its PID or Ctrl-C takes JupyterLab with it: the signal is
    forwarded; killed with -9, which it cannot see, the kernel's parent-death signal stops it."""
    pid_file = tmp_path / "child.pid"
    child = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(60)"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; from varlen_workbench.workbench.cli.main import run_forwarding_signals; sys.exit(run_forwarding_signals([sys.executable, '-c', {child!r}]))",
        ]
    )
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
        time.sleep(0.1)
    parent.send_signal(sig)
    assert parent.wait(timeout=30) != 0
    child_pid = int(pid_file.read_text())
    while time.monotonic() < deadline:
        if not _alive(child_pid):
            return
        time.sleep(0.1)
    os.kill(child_pid, signal.SIGKILL)
    pytest.fail("the child outlived its signalled parent")


def test_lab_help_is_real_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["lab", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: varlen-workbench lab")
    assert "--allow-root" in out and "--no-browser" in out and "varlen-workbench execute ID" in out


def test_jsonable_results():
    from varlen_workbench.workbench.records import jsonable

    case = Case(seqlens_q=(3,))
    assert jsonable({"a": (1, 2.5, None), "t": torch.arange(3)}) == {"a": [1, 2.5, None], "t": [0, 1, 2]}
    assert jsonable({case: True}) == [{"key": case.to_dict(), "value": True}]
    assert jsonable(torch.zeros(2000)) == {"shape": [2000], "dtype": "torch.float32"}
    assert jsonable(object()).startswith("<object object")


def test_a_record_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """`write_json` (which `write_record` and `varlen-workbench audit --record` write through): a write
    cut off midway (a kill, a full disk) leaves the earlier record as it was, and no partial file."""
    import pathlib

    from varlen_workbench.workbench.records import read_record, write_json, write_record

    path = tmp_path / "sub" / "audit-row.json"
    first = write_record(path, {"rows": [1]}, command="python -m varlen_workbench.workbench audit x")
    whole_write = pathlib.Path.write_text

    def cut_off(self, text, *args, **kwargs):
        whole_write(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError("No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", cut_off)
    with pytest.raises(OSError, match="No space left"):
        write_json(path, {"rows": [2] * 100})
    monkeypatch.undo()
    assert read_record(path) == first
    assert [p.name for p in path.parent.iterdir()] == ["audit-row.json"]


def test_audit_help_names_the_registries_checks_and_adapters():
    """`varlen-workbench audit --help` lists the checks and adapters from the torch-free catalogue,
    which the registries match: a check or adapter declared in one place only fails at import."""
    from varlen_workbench.workbench import audit_catalog
    from varlen_workbench.workbench.audit import ADAPTERS, CHECKS

    audit = cli.build_parser()._subparsers._group_actions[0].choices["audit"]  # type: ignore[union-attr]
    helps = {action.dest: action.help for action in audit._actions}
    assert tuple(CHECKS) == audit_catalog.CHECKS and all(name in helps["checks"] for name in CHECKS)
    builtin = [name for name in ADAPTERS if name in audit_catalog.ADAPTERS]
    assert builtin == list(audit_catalog.ADAPTERS) and all(name in helps["adapter"] for name in builtin)
    assert {name for name in ADAPTERS if name.startswith(audit_catalog.BACKEND_ADAPTER_PREFIX)} >= {"ours-triton", "ours-torch"}
    with pytest.raises(RuntimeError, match=r"declare each of the audit's checks in both, in one order"):
        audit_catalog.registered_as_declared("checks", [*audit_catalog.CHECKS, "new-check"], audit_catalog.CHECKS)
