"""`varlen_workbench.workbench.audit.records`: recorded audits (data/gpu/audit-*.json) read back and printed as
`varlen-workbench audit` printed them.

Run against the committed records (whatever run they hold) and against edited copies under
tmp_path; a live audit of a planted TAIL bug checks that a record prints exactly like its report.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_audit import tail_unwritten

from varlen_workbench.workbench.audit import audit
from varlen_workbench.workbench.audit.records import (
    CAMPAIGN_CHECKS,
    GPU_DATA,
    campaign_table,
    fuzz_failure,
    fuzz_summary,
    load_audit_records,
    shown_snippet,
    verdict_table,
    verdicts,
)
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.records import portable


@pytest.fixture
def records_copy(tmp_path):
    """A writable copy of the committed audit records."""
    for path in GPU_DATA.glob("audit-*.json"):
        shutil.copy(path, tmp_path)
    return tmp_path


def _edit(directory, name, **changes):
    """Rewrites record `name` under `directory` with top-level `changes`; returns it as loaded."""
    path = directory / name
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return next(r for r in load_audit_records(directory) if r["file"] == name)


def test_committed_records_load_sorted_with_their_file_names():
    records = load_audit_records()
    files = [r["file"] for r in records]
    audits = [p.name for p in GPU_DATA.glob("audit-*.json") if "checks" in json.loads(p.read_text())]
    assert files == sorted(audits) and len(files) >= 2  # the sanitizer's record and rows that did not run are left out
    for record in records:
        assert {"target", "checks", "fuzz", "provenance"} <= set(record), record["file"]


def test_a_copy_loads_the_same_records_and_an_empty_directory_names_the_command(records_copy, tmp_path):
    assert load_audit_records(records_copy) == load_audit_records()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as raised:
        load_audit_records(empty)
    assert str(empty) in str(raised.value)
    assert "varlen-workbench audit MODULE:FUNCTION --device cuda --record data/gpu/audit-<name>.json" in str(raised.value)


@pytest.mark.parametrize("record", load_audit_records(), ids=lambda r: r["file"])
def test_verdict_table_names_every_check_with_its_verdict(record):
    lines = verdict_table(record).splitlines()
    assert lines[0].split() == ["check", "verdict", "evidence"] and set(lines[1]) == {"-"}
    assert [line.split()[0] for line in lines[2:]] == [c["name"] for c in record["checks"]]
    verdict_column = lines[0].index("verdict")
    assert all(line[verdict_column:].startswith(c["verdict"]) for line, c in zip(lines[2:], record["checks"]))


CAMPAIGNS = [r for r in load_audit_records() if any(c["name"] in CAMPAIGN_CHECKS and c["rows"] for c in r["checks"])]


@pytest.mark.parametrize("record", CAMPAIGNS, ids=lambda r: r["file"])
def test_campaign_table_gives_each_malformed_call_its_outcome(record):
    rows = next(c["rows"] for c in record["checks"] if c["name"] in CAMPAIGN_CHECKS)
    lines = campaign_table(record).splitlines()
    assert len(lines) == len(rows) > 0
    for line, row in zip(lines, rows):
        assert line.split()[0] == row["id"] and f"  {row['outcome']}" in line
        assert line.endswith(portable(row["evidence"]).rstrip())  # the table shows machine paths portable


def test_campaign_table_is_empty_without_the_bad_input_check(records_copy):
    checks = [c for c in load_audit_records(records_copy)[0]["checks"] if c["name"] not in CAMPAIGN_CHECKS]
    assert campaign_table(_edit(records_copy, "audit-kernels.json", checks=checks)) == ""


def test_a_record_prints_exactly_like_the_report_it_was_recorded_from():
    report = audit(tail_unwritten, "contract", budget=0, checks=["tail-rows", "input-validation"])
    record = json.loads(json.dumps(report.to_dict()))  # what --record writes and the loader reads
    assert verdict_table(record) == report.table() and verdicts(record) == report.verdicts()
    assert campaign_table(record) == report.campaign_table()


def test_a_run_hands_over_its_report_after_each_check_marked_partial_until_it_ends():
    """What `varlen-workbench audit --record` writes as it goes, so that a run killed at a deadline keeps
    the checks it finished."""
    heard: list = []
    report = audit(tail_unwritten, "contract", budget=2, checks=["tail-rows", "custom-scale"], checkpoint=heard.append)
    assert [[r.name for r in h.results] for h in heard] == [["tail-rows"], ["tail-rows", "custom-scale"]]
    assert heard[0].partial == "checks not run yet: custom-scale; fuzzer not run yet"
    assert heard[1].partial == "fuzzer not run yet" and heard[1].fuzz is None
    assert json.loads(json.dumps(heard[0].to_dict()))["partial"] == heard[0].partial
    assert not report.partial and "partial" not in report.to_dict() and report.fuzz and report.fuzz.tried == 2


def test_fuzz_summary_reports_the_recorded_counts(records_copy):
    for record in load_audit_records(records_copy):
        fuzzed = record["fuzz"]
        if fuzzed is None:
            assert fuzz_summary(record) == "fuzzer: not run"
            continue
        line = fuzz_summary(record)
        assert (
            f"{fuzzed['tried']} layouts ({fuzzed['profile']} profile" in line and f"; {fuzzed['failing_layouts']} failing" in line
        )
        if fuzzed["seconds"]:
            assert f"{fuzzed['tried'] / fuzzed['seconds']:.1f} layouts/s" in line
        assert ("stopped early: " + fuzzed["stopped_early"] in line) == bool(fuzzed["stopped_early"])

    fuzzed = {
        **next(r["fuzz"] for r in load_audit_records(records_copy) if r["fuzz"]),
        "tried": 5000,
        "seconds": 100.0,
        "failing_layouts": 0,
        "stopped_early": "",
    }
    line = fuzz_summary(_edit(records_copy, "audit-kernels.json", fuzz=fuzzed))
    assert "5000 layouts" in line and "50.0 layouts/s" in line and line.endswith("; 0 failing")
    assert fuzz_summary(_edit(records_copy, "audit-kernels.json", fuzz=None)) == "fuzzer: not run"


def test_fuzz_failure_gives_the_shrunk_case_of_a_check(records_copy):
    case = Case(seqlens_q=(1,), tail_k=1, heads=1, head_dim=64, dtype="bfloat16")
    failure = {
        "check": "tail-rows",
        "evidence": "dk: 64 non-finite values in 1 TAIL rows",
        "case": case.to_dict(),
        "original": case.to_dict(),
        "shrink_probes": 3,
        "snippet": "# tail-rows",
    }
    fuzzed = {**next(r["fuzz"] for r in load_audit_records(records_copy) if r["fuzz"]), "failures": [failure]}
    record = _edit(records_copy, "audit-kernels.json", fuzz=fuzzed)
    assert Case(**fuzz_failure(record, "tail-rows")["case"]) == case  # JSON lists and fill names rebuild the Case
    with pytest.raises(KeyError, match=r"found no gap-rows failure; it found \['tail-rows'\]"):
        fuzz_failure(record, "gap-rows")
    with pytest.raises(KeyError, match=r"found no tail-rows failure; it found \[\]"):
        fuzz_failure(_edit(records_copy, "audit-kernels.json", fuzz=None), "tail-rows")


def test_an_earlier_record_is_regraded_with_todays_rules():
    """The earlier varlen_attn run (campaign and checks on layouts with TAIL rows) read again:
    its empty-sequences FAIL is TAIL rows alone, the later run's case has none and passes, and
    the campaign's 'silent NaN' counts that are exactly the TAIL values are the TAIL bug."""
    from varlen_workbench.workbench.audit import adapt
    from varlen_workbench.workbench.audit.regrade import EVERY_ROW_NAN, TAIL_BUG, TAIL_ONLY, regrade_campaign, regrade_checks

    records = {r["file"]: r for r in load_audit_records()}
    earlier, later = records["audit-torch-varlen-earlier.json"], records["audit-torch-varlen.json"]
    assert regrade_checks(earlier)["empty-sequences"] == ("FAIL", TAIL_ONLY)
    assert regrade_checks(earlier)["tail-rows"] == ("FAIL", "FAIL") and regrade_checks(later)["empty-sequences"] == (
        "pass",
        "pass",
    )
    aliases = adapt("torch.nn.attention.varlen:varlen_attn", adapter="torch-varlen", device="cpu").aliases
    today = {case: new for case, _, new in regrade_campaign(earlier, aliases)}
    assert today["cu-float"] == "clear error" and today["q-not-tensor"] == "clear error"  # torch's own name: query
    assert today["max-seqlen-too-small"] == TAIL_BUG and today["scale-negative"] == EVERY_ROW_NAN


def test_tail_only_reads_the_regions_a_finding_names():
    from varlen_workbench.workbench.audit.regrade import tail_only

    case = "q=[3, 0] tail=2 H=2 D=64 float16 (zeros padding): "
    assert tail_only(case + "out: 256 non-finite values in 2 TAIL rows; dq: max |x| 0.5 in 2 TAIL rows")
    assert not tail_only(case + "out: 256 non-finite values in 2 TAIL rows; dk: 3 non-finite values in 1 GAP rows")
    assert not tail_only(case + "dq: error 0.3 > bound 0.01 (30x PyTorch's own error)")
    assert not tail_only("raised RuntimeError: CUDA error: invalid argument")
    assert tail_only("dk: 64 non-finite values in 1 TAIL rows; dv: 64 non-finite values in 1 TAIL rows")  # a fuzzer's


def test_recorded_snippets_are_shown_with_the_import_names_of_today():
    """Records made before the rename import `workbench` and `kernels`, other distributions' names
    now: shown, every recorded snippet imports what exists today, and the record file is untouched."""
    import ast
    import importlib

    failures = [f for r in load_audit_records() if r.get("fuzz") for f in r["fuzz"]["failures"]]
    assert any("from workbench import" in f["snippet"] for f in failures)  # the old names are there to translate
    for failure in failures:
        for node in ast.walk(ast.parse(shown_snippet(failure))):
            if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in ("varlen_workbench", "kernels", "workbench"):
                module = importlib.import_module(node.module)
                assert all(hasattr(module, alias.name) for alias in node.names), ast.unparse(node)
