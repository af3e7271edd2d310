"""scripts/gpu_audit_matrix.py's bookkeeping on the CPU: which rows a call redoes, in which
phase, which compute-sanitizer tools a row gets, and how a fuzz-only run joins its row's record."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from workbench.provenance import REPO

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


def test_a_slow_row_is_audited_in_two_calls_and_a_fast_one_in_one(script):
    assert script._phase("sdpa-math", force=False) == "all"  # 1205 layouts in 90 s
    # 51 layouts in 90 s: slow. Its record predates the sliding-window check: checks first.
    assert script._phase("dmattn-triton", force=False) == "checks"
    checks = script._earlier("dmattn-triton")["checks"]
    _write(script.DATA, "dmattn-triton", checks=[*checks, {"name": "sliding-window", "verdict": "n/a", "evidence": "-"}])
    assert script._phase("dmattn-triton", force=False) == "fuzz" and script._phase("dmattn-triton", force=True) == "checks"
    assert script._phase("torch-varlen", force=False) == "checks"  # checks left "not run" by a lost context


def test_a_fuzz_only_run_joins_the_checks_record(script):
    record = script._earlier("dmattn-triton")
    fuzzed = {"fuzz": {**record["fuzz"], "tried": 400, "failures": []}, "provenance": {"commit": "abc"}}
    merged = script._merge_fuzz(record, fuzzed)
    assert merged["fuzz"]["tried"] == 400 and merged["fuzz_provenance"] == {"commit": "abc"}
    assert merged["checks"] == record["checks"] and "fuzz:real-accuracy" not in merged["failed"]
    assert "real-accuracy" in merged["failed"] and merged["passed"] is False


def test_racecheck_goes_to_rows_with_atomics_or_a_nondeterministic_record(script):
    assert script.tools("sdpa-math") == ("initcheck", "memcheck")
    assert script.tools("sdpa-cudnn")[-1] == "racecheck"  # its determinism check FAILs
    assert script.tools("fa4")[-1] == "racecheck"  # no record yet: listed in RACECHECK


def test_a_counted_run_is_not_repeated(script):
    assert script._counted({"tool": "initcheck", "errors": 0, "completed": True})
    assert script._counted({"tool": "initcheck", "errors": None, "why": "sdpa-flash: not applicable: no attn_mask"})
    assert not script._counted({"tool": "initcheck", "errors": None, "why": "timed out after 240 s"})
    assert not script._counted({"tool": "initcheck", "errors": 0, "completed": False, "program": ["ImportError"]})
