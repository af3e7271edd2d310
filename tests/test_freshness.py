"""GPU record freshness: the badge is computed from the content of the measured code, a rename
alone changes nothing, and the plan packs the stale records into 10-minute calls."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from varlen_workbench.workbench.gpu_records import fingerprint, freshness
from varlen_workbench.workbench.gpu_records import plan as gpu_plan
from varlen_workbench.workbench.gpu_records.kinds import OURS, UPSTREAM, kind_of
from varlen_workbench.workbench.provenance import REPO
from varlen_workbench.workbench.records import READ_LOG, load_records, read_record, with_fingerprint, write_record


@pytest.fixture
def tree(tmp_path):
    """A copy of our kernel's sources, as a tree whose files a test may change or move."""
    for path in OURS:
        source = REPO / path
        if source.is_dir():
            shutil.copytree(source, tmp_path / path, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, tmp_path / path)
    freshness._now.cache_clear()
    yield tmp_path
    freshness._now.cache_clear()


def _record(tree) -> dict:
    kind = kind_of("audit-ours.json")
    stamp = {"commit": "abc1234", "date": "2026-12-01 18:00 UTC", "device": "NVIDIA H200"}
    return {"file": "audit-ours.json", "provenance": {**stamp, "fingerprint": fingerprint.current_fingerprint(kind, tree)}}


def test_the_badge_flips_when_the_measured_code_changes_and_not_when_it_moves(tree):
    record = _record(tree)
    fresh = freshness.freshness(record, root=tree)
    assert fresh.stale is False and "wb-stale" not in fresh.html()
    assert "NVIDIA H200" in fresh.html() and "abc1234" in fresh.html() and "2026-12-01" in fresh.html()

    (tree / "kernels/varlen/launch.py").rename(tree / "kernels/varlen/launches.py")  # a move alone
    freshness._now.cache_clear()
    assert freshness.freshness(record, root=tree).stale is False

    with (tree / "kernels/varlen/launches.py").open("a") as source:
        source.write("\nEXTRA = 1\n")  # the code changes (a comment or a docstring would not)
    freshness._now.cache_clear()
    stale = freshness.freshness(record, root=tree)
    assert stale.stale is True and freshness.STALE in stale.html()


def test_the_fingerprint_ignores_the_namespace_prefix_and_counts_upstream_versions():
    assert fingerprint.fingerprint([b"from varlen_workbench.kernels import x"], {}) == fingerprint.fingerprint(
        [b"from kernels import x"], {}
    )
    assert fingerprint.fingerprint([b"x"], {"torch": "2.11.0"}) != fingerprint.fingerprint([b"x"], {"torch": "2.12.0"})


def test_moving_a_module_between_packages_leaves_the_fingerprints_of_its_importers():
    """A module moved into a subpackage: its importers' imports are rewritten and re-sorted, and a
    `python -m` string names the new path; what runs is the same. A changed call is not."""
    before = b"""from varlen_workbench.workbench.layout import cumulative
from varlen_workbench.workbench.syncs import count
PROG = "python -m varlen_workbench.workbench.syncs"
def f(x):
    return count(cumulative(x))
"""
    moved = b"""from varlen_workbench.workbench.instruments.syncs import count
from varlen_workbench.workbench.layout import cumulative
PROG = "python -m varlen_workbench.workbench.instruments.syncs"
def f(x):
    return count(cumulative(x))
"""
    changed = moved.replace(b"count(cumulative(x))", b"count(cumulative(x)) + 1")
    assert fingerprint.fingerprint([before], {}) == fingerprint.fingerprint([moved], {})
    assert fingerprint.fingerprint([moved], {}) != fingerprint.fingerprint([changed], {})


def test_a_record_fingerprinted_from_git_history_survives_a_rename(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, check=True, text=True).stdout.strip()

    kind = kind_of("te-thd-2892-training-h200.json")  # TE's case runner and TE's version
    git("init", "-q")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts/te_thd_training.py").write_text("print('runner')\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "runner")
    before = git("rev-parse", "HEAD")
    versions = {"transformer-engine": UPSTREAM["transformer-engine"]}
    assert fingerprint.fingerprint_at(before, kind, versions, tmp_path) == fingerprint.current_fingerprint(kind, tmp_path)
    changed = fingerprint.fingerprint_at(before, kind, {"transformer-engine": "2.19.0"}, tmp_path)
    assert changed != fingerprint.current_fingerprint(kind, tmp_path)  # another TE version is other code


def test_every_committed_record_has_a_kind_and_a_fingerprint():
    committed = fingerprint.committed_fingerprints()
    for record in load_records("*.json"):
        kind_of(record["file"])
        assert fingerprint.recorded_fingerprint(record, committed), (
            f"{record['file']} has no fingerprint: run varlen-workbench gpu-records --backfill"
        )


def test_a_gpu_record_is_written_with_the_fingerprint_of_its_code(tmp_path):
    kind = kind_of("audit-ours.json")
    written = write_record(tmp_path / "audit-ours.json", {"passed": 1}, command="test")
    assert written["provenance"]["fingerprint"] == fingerprint.current_fingerprint(
        kind, versions=fingerprint.installed_versions(kind)
    )
    assert "fingerprint" not in write_record(tmp_path / "notes.json", {}, command="test")["provenance"]
    assert read_record(tmp_path / "audit-ours.json")["provenance"]["fingerprint"]
    audited = with_fingerprint(tmp_path / "audit-fa4.json", {"passed": 1, "provenance": {"commit": "abc1234"}})
    assert audited["provenance"]["fingerprint"] == fingerprint.current_fingerprint(
        kind_of("audit-fa4.json"), versions=fingerprint.installed_versions(kind_of("audit-fa4.json"))
    )
    assert "fingerprint" not in with_fingerprint(tmp_path / "audit-fa4.json.new", audited | {"provenance": {}})["provenance"]


def test_an_undeclared_record_kind_names_the_table_to_declare_it_in():
    with pytest.raises(LookupError, match="gpu_records.kinds.KINDS"):
        kind_of("mystery-h200.json")


def _entry(name: str, stale: bool | None, minutes: float, carried: bool = False, command: str | None = None):
    f = freshness.Freshness(name, "2026-12-01", "NVIDIA H200", "abc1234", stale)
    return gpu_plan.Entry(f, command or f"make {name}", True, minutes, carried)


def test_the_plan_runs_wheels_then_tests_then_stale_records_in_calls_of_at_most_ten_minutes():
    rows = [
        _entry("a.json", True, 6.0, carried=True),
        _entry("b.json", False, 9.0),
        _entry("c.json", True, 4.0),
        _entry("d.json", None, 5.0),
        _entry("e.json", True, 3.0, command="make c.json"),  # shares c's command: run once
    ]
    calls = gpu_plan.plan(rows)
    commands = [command for call in calls for command, _ in call]
    assert commands[:2] == [gpu_plan.WHEELS[0], gpu_plan.TESTS[0]]
    assert commands[2:] == ["make a.json", "make c.json", "make d.json"]
    assert all(sum(m for _, m in call) <= gpu_plan.CALL_MINUTES for call in calls)
    assert gpu_plan.plan([_entry("b.json", False, 9.0)]) == []


def test_the_gpu_records_read_are_listed_where_the_environment_says(tmp_path, monkeypatch):
    """A notebook's kernel lists each GPU record it reads in the file READ_LOG names (every cell
    and subprocess alike); without it, reading lists nothing; a record outside data/gpu is no GPU record."""
    listed = tmp_path / "read.txt"
    read_record(REPO / "data" / "gpu" / "audit-te.json")
    assert not listed.exists()
    monkeypatch.setenv(READ_LOG, str(listed))
    load_records("audit-te.json")
    read_record(REPO / "data" / "gpu" / "audit-te.json")
    write_record(tmp_path / "local.json", {"rows": []})
    read_record(tmp_path / "local.json")
    assert listed.read_text() == "audit-te.json\naudit-te.json\n"


@pytest.mark.slow
def test_a_page_stamps_the_gpu_records_its_notebook_read_with_their_computed_badge(project, tmp_path, monkeypatch):
    from conftest import plain_notebook

    from varlen_workbench.workbench.site.build import build

    read = "from varlen_workbench.workbench.records import load_records\nrows = load_records('audit-te.json')"
    plain_notebook(project.notebooks_dir / "reads.ipynb", read)
    out = tmp_path / "site" / "_build"
    monkeypatch.setattr(freshness, "_now", lambda kind, root: "the code of another commit")  # as if it changed
    build(project, out, log=lambda message: None)
    page = (out / "reads.html").read_text()
    assert "GPU records on this page: 1" in page and "data/gpu/audit-te.json" in page
    assert '<span class="wb-stale"' in page and freshness.STALE in page
