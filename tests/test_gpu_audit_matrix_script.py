"""scripts/gpu_audit_matrix.py's bookkeeping on the CPU: which rows a call redoes, in which
phase, which compute-sanitizer tools a row gets, and how a fuzz-only run joins its row's record."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from varlen_workbench.workbench.provenance import REPO

# Records as they stood before a rerun (data/gpu/ holds the latest, which the next GPU call replaces).
FROZEN = REPO / "tests" / "data" / "audit-records"


@pytest.fixture
def script(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_audit_matrix", REPO / "scripts" / "gpu_audit_matrix.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for path in FROZEN.glob("audit-*.json"):
        shutil.copy(path, tmp_path)
    monkeypatch.setattr(module, "DATA", tmp_path)
    return module


def _write(directory, row, **changes):
    path = directory / f"audit-{row}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_slow_row_runs_what_it_still_needs_and_a_fast_one_everything_at_once(script):
    assert script._phases("sdpa-math", force=False) == ["all"]  # 1205 layouts in 90 s
    # 51 layouts in 90 s: slow. Its record predates the sliding-window check, its fuzzer short.
    assert script._phases("dmattn-triton", force=False) == ["checks", "fuzz"]
    checks = script._earlier("dmattn-triton")["checks"]
    _write(script.DATA, "dmattn-triton", checks=[*checks, {"name": "sliding-window", "verdict": "n/a", "evidence": "-"}])
    assert script._phases("dmattn-triton", force=False) == ["fuzz"]
    assert script._phases("dmattn-triton", force=True) == ["checks", "fuzz"]
    assert script._phases("torch-varlen", force=False)[0] == "checks"  # checks left "not run" by a lost context
    assert script._phases("sdpa-nested", force=False) == ["fuzz"]  # its checks whole, no fuzzer recorded


def test_a_slow_rows_checks_left_are_split_into_parts(script):
    fsa = script._earlier("fsa-dense-varlen")  # real-accuracy faulted, the rest lost with the context
    left = script._checks_left(fsa, force=False)
    assert "real-accuracy" not in left and left[0] == "tail-rows" and left[-1] == "input-validation"
    assert "sliding-window" in left  # added after the record was made
    parts = script._parts(left, 3)
    assert sorted(sum(parts, [])) == sorted(left) and [len(p) for p in parts] == [4, 4, 4]
    assert script._parts(["gqa"], 3) == [["gqa"]]
    assert script._checks_left(fsa, force=True)[0] == "real-accuracy"


def _part(record, names, partial=""):
    """A checks-only run's record of `names` (each passing), as `varlen-workbench audit --record` writes it."""
    checks = [{"name": n, "verdict": "pass", "evidence": "fine", "seconds": 1.0} for n in names]
    provenance = {**record["provenance"], "commit": "new", "date": "2026-12-02 09:00 UTC"}
    return {**record, "checks": checks, "provenance": provenance, "budget": 0, "fuzz": None, "partial": partial}


def test_check_parts_merge_into_the_row_with_the_run_each_check_came_from(script):
    from varlen_workbench.workbench.audit.matrix import cell, complete

    fsa = script._earlier("fsa-dense-varlen")
    left = script._checks_left(fsa, force=False)
    first = script._merge_checks(fsa, _part(fsa, left[:3], partial="checks not run yet: x"), "timeout", 520.0)
    assert [c["name"] for c in first["checks"]][:4] == ["real-accuracy", "tail-rows", "gap-rows", "padding-leak"]
    assert cell(first, "tail-rows") == ("pass", "fine") and cell(first, "real-accuracy")[0] == "FAIL"
    earlier_run, this_run = first["check_runs"]
    assert earlier_run["provenance"]["commit"] == "fea1f20" and "real-accuracy" in earlier_run["checks"]
    assert "tail-rows" not in earlier_run["checks"] and this_run["checks"] == left[:3]
    assert this_run["rc"] == "timeout" and this_run["partial"] == "checks not run yet: x"
    assert first["provenance"]["commit"] == "new" and first["failed"] == ["real-accuracy"]
    assert script._checks_left(first, force=False) == left[3:]  # the next call runs only the rest
    whole = script._merge_checks(first, _part(fsa, left[3:]), 1, 300.0)
    assert not script._checks_left(whole, force=False) and len(whole["check_runs"]) == 3
    assert not complete(whole) and cell(whole, "fuzzer") == ("not run", "fuzzing not asked (--budget 0)")
    fuzzed = {"fuzz": {"tried": 1000, "seconds": 90.0, "failures": [], "failing_layouts": 0}, "provenance": {"commit": "fz"}}
    done = script._merge_fuzz(whole, fuzzed)
    assert complete(done) and done["check_runs"] == whole["check_runs"] and done["fuzz_provenance"] == {"commit": "fz"}
    # A later checks part keeps the fuzzer's provenance beside the row's new one.
    again = script._merge_checks(done, _part(fsa, ["gqa"]), 1, 9.0)
    assert again["fuzz_provenance"] == {"commit": "fz"} and again["fuzz"]["tried"] == 1000


# Stands in for `varlen-workbench audit ... --record OUT`: records its first check as a run under way
# does, starts a process of its own (as the audit's children), and hangs until killed.
FAKE_AUDIT = """
import json, subprocess, sys, time
out, first = sys.argv[1], sys.argv[2].split(",")[0]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(out + ".pid", "w").write(str(child.pid))
record = json.loads(sys.argv[3])
record.update(checks=[{"name": first, "verdict": "pass", "evidence": "fine", "seconds": 0.1}], partial="checks not run yet: more")
json.dump(record, open(out, "w"))
print(first + ": pass (0.1 s)", flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "State:\tZ" in status.read_text()


def test_a_call_killed_at_its_deadline_keeps_the_checks_its_parts_finished(script, monkeypatch):
    import argparse
    import sys
    import time

    fsa = script._earlier("fsa-dense-varlen")
    base = json.dumps({k: fsa[k] for k in ("target", "adapter", "device", "dtype", "versions", "provenance")} | {"budget": 0})
    monkeypatch.setattr(script, "MIN_ROW_SECONDS", 0)
    monkeypatch.setattr(script, "_phases", lambda row, force: ["checks"])
    monkeypatch.setattr(script, "_command", lambda *a: [sys.executable, "-c", FAKE_AUDIT, str(a[-1]), ",".join(a[-2]), base])
    args = argparse.Namespace(force=False, workers=1, check_parts=2, recheck=[], check_timeout=150)
    outcome = script.run_audit("fsa-dense-varlen", fsa["target"], "fsa-varlen", args, time.time() + 7)
    assert outcome["rc"] == "checks: timeout,timeout" and outcome["seconds"] < 5
    record = script._earlier("fsa-dense-varlen")
    assert [run["rc"] for run in record["check_runs"][1:]] == ["timeout", "timeout"]
    assert {c["name"] for c in record["checks"] if c["evidence"] == "fine"} == {"tail-rows", "gap-rows"}
    for part in (1, 2):
        log = (script.DATA / "logs" / f"audit-fsa-dense-varlen-checks-{part}.log").read_text().splitlines()
        assert log[-2].startswith("killed after ") and log[-1].startswith("recorded what it finished before the kill")
        pid = int((script.DATA / f"audit-fsa-dense-varlen-checks-{part}.json.new.pid").read_text())
        deadline = time.time() + 5
        while not _gone(pid) and time.time() < deadline:
            time.sleep(0.1)
        assert _gone(pid), "the audit's own children die with it"


def test_a_recheck_runs_only_the_checks_it_names_with_its_time_limit(script, monkeypatch):
    import argparse
    import time

    commands = []
    logs = []
    monkeypatch.setattr(script, "_run", lambda command, log, hard: commands.append(command) or logs.append(log.name) or (0, 0.1))
    monkeypatch.setattr(script, "ROOT", script.DATA.parent)  # the record path is named relative to it
    kept = script.DATA / "logs" / "audit-fsa-dense-varlen-checks-1.log"  # a checks run's part: evidence of its checks
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text("real-accuracy: FAIL\n")
    fsa = script._earlier("fsa-dense-varlen")
    args = argparse.Namespace(force=False, workers=1, check_parts=3, recheck=["no-real-query"], check_timeout=400)
    script.run_audit("fsa-dense-varlen", fsa["target"], "fsa-varlen", args, time.time() + 600)
    [command] = commands  # one checks run: no fuzzer, no other check
    assert command[command.index("--checks") + 1] == "no-real-query" and "--skip" not in command
    assert command[command.index("--check-timeout") + 1] == "400"
    assert logs == ["audit-fsa-dense-varlen-recheck.log"] and kept.exists()


def test_racecheck_goes_to_rows_with_atomics_or_a_nondeterministic_record(script):
    assert script.tools("sdpa-math") == ("initcheck", "memcheck")
    assert script.tools("sdpa-cudnn")[-1] == "racecheck"  # its determinism check FAILs
    assert script.tools("fa4")[-1] == "racecheck"  # no record yet: listed in RACECHECK


def test_a_counted_run_is_not_repeated(script):
    assert script._counted({"tool": "initcheck", "errors": 0, "completed": True})
    assert script._counted({"tool": "initcheck", "errors": None, "why": "sdpa-flash: not applicable: no attn_mask"})
    assert not script._counted({"tool": "initcheck", "errors": None, "why": "timed out after 240 s"})
    assert not script._counted({"tool": "initcheck", "errors": 0, "completed": False, "program": ["ImportError"]})
