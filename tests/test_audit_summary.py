"""The audit matrix's three lines are computed from the committed records and their judgements:
a row moves between them when its record changes, and no row is both broken and recommended."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

from varlen_workbench.workbench.audit.judgements import judgements
from varlen_workbench.workbench.audit.matrix import fails, load_matrix
from varlen_workbench.workbench.audit.summary import failures, summary


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_each_judged_fail_lands_on_its_line():
    records = load_matrix()
    found, judged = failures(records), judgements()
    for row, check, _ in fails(records):
        j = judged[(row, check)]
        kind = "nan-padding" if j.nan_padding else "broken" if j.kind == "upstream" else j.kind
        assert check in found[row][kind], (row, check)
    text = summary(records)
    broken, nan, use = _line(text, "* **Broken**"), _line(text, "* **NaN planted"), _line(text, "* **Use:**")
    assert "`torch-varlen` (tail-rows" in broken and "[torch-varlen-176793](torch-varlen-176793.html)" in broken
    assert "`sdpa-math` (padding-leak" in nan and "`sdpa-math`" not in broken
    as_is = use.removeprefix("* **Use:** ").partition(" as is;")[0]
    assert "`ours`" in as_is.split(", ") and "`sdpa-math`" not in as_is and "`sdpa-math`" in use
    documented = broken.partition("Documented upstream as intended: ")[2]
    for row, kinds in found.items():
        assert ("broken" in kinds) == (f"`{row}` (" in broken.partition(" Documented")[0]), row
        assert ("documented" in kinds) == (f"`{row}` (" in documented.partition(" From our")[0]), row
        assert not (kinds.keys() - {"nan-padding"} and f"`{row}`" in use), f"{row} is recommended with FAILs: {kinds}"


def test_a_new_fail_moves_a_row_from_use_to_broken():
    """An unjudged FAIL counts as broken: our kernel failing tail-rows leaves the Use line."""
    records = copy.deepcopy(load_matrix())
    ours = next(r for r in records if r["row"] == "ours")
    next(c for c in ours["checks"] if c["name"] == "tail-rows")["verdict"] = "FAIL"
    text = summary(records)
    assert "`ours` (tail-rows)" in _line(text, "* **Broken**")
    assert "`ours`" not in _line(text, "* **Use:**")


def test_rows_without_an_answer_are_named():
    records = copy.deepcopy(load_matrix())
    next(r for r in records if r["row"] == "sdpa-math")["ran"] = False
    text = summary(records)
    assert "`sdpa-math` did not run" in text and "`sdpa-math`" not in _line(text, "* **Use:**")


def _standalone() -> dict:
    from varlen_workbench.workbench.audit.records import load_audit_records

    records = {record["file"]: record for record in load_audit_records()}
    return {
        "torch `varlen_attn`": {**records["audit-torch-varlen-earlier.json"], "row": "torch-varlen"},
        "our kernel": {**records["audit-kernels.json"], "row": "ours"},
    }


def test_standalone_audits_group_tail_only_fails_with_the_tail_mechanism():
    """The earlier varlen_attn audit's empty-sequences FAIL has TAIL values only: it joins tail-rows."""
    from varlen_workbench.workbench.audit.summary import audits_summary

    text = audits_summary(_standalone())
    broken = _line(text, "* **Broken:**")
    assert "every failing value of tail-rows, empty-sequences, fuzzer: tail-rows lies there" in broken
    assert "documented upstream as intended: determinism" in broken
    assert "our kernel: every check passes; the fuzzer tried 5,000 layouts" in _line(text, "* **Not broken:**")
    assert _line(text, "* **Use:**") == "* **Use:** our kernel as is; torch `varlen_attn` with its TAIL rows zeroed."


def test_a_silent_fail_outside_tail_rows_withdraws_the_recommendation():
    from varlen_workbench.workbench.audit.summary import audits_summary

    subjects = copy.deepcopy(_standalone())
    checks = subjects["torch `varlen_attn`"]["checks"]
    real = next(c for c in checks if c["name"] == "real-accuracy")
    real.update(verdict="FAIL", evidence="q=[5] H=2 D=64 float16 (zeros padding): out: max |x| 3 in 5 REAL rows")
    text = audits_summary(subjects)
    assert "silently wrong in real-accuracy" in _line(text, "* **Broken:**")
    assert _line(text, "* **Use:**") == "* **Use:** our kernel as is."


def test_incomplete_rows_say_why_from_h200_records(tmp_path):
    """On a frozen copy of rows of the H200 matrix as they stood on 2026-12-01 (records, sanitizer
    runs, the logs of runs killed at a call's deadline)."""
    from varlen_workbench.workbench.audit.matrix import complete
    from varlen_workbench.workbench.audit.summary import incomplete

    snapshot = Path(__file__).parent / "data" / "audit-matrix-snapshot"
    records = load_matrix(snapshot)
    found = incomplete(records, snapshot)
    for record in records:
        assert (record["row"] in found) >= (not complete(record)), record["row"]
    assert "ours" not in found and "torch-varlen" not in found
    assert "sdpa-flash" not in found  # compute-sanitizer cannot express its layout: n/a, not missing
    # Its checks-only record, then a fuzz-only run killed at its deadline that recorded nothing.
    assert found["sdpa-nested"] == [
        "the latest run's fuzzer killed at the call's deadline after 524 s (the record is an earlier run's)",
        "fuzzer: fuzzing not asked (--budget 0)",
        "compute-sanitizer initcheck: not run: timed out after 240 s",
    ]
    fsa = found["fsa-dense-varlen"]
    assert fsa[0].startswith("the latest run's checks killed at the call's deadline after ")
    assert any(
        why.startswith("tail-rows, gap-rows") and why.endswith("the CUDA context was lost at check real-accuracy") for why in fsa
    )
    # A killed run that recorded what it finished says so on a last line: no longer a lost run;
    # a killed part of a checks run that recorded nothing is one.
    shutil.copytree(snapshot, tmp_path / "gpu")
    log = tmp_path / "gpu" / "logs" / "audit-fsa-dense-varlen-checks.log"
    log.write_text(log.read_text() + "recorded what it finished before the kill (checks not run yet: gqa)\n")
    assert not any("killed" in why for why in incomplete(records, tmp_path / "gpu")["fsa-dense-varlen"])
    (log.parent / "audit-fsa-dense-varlen-checks-2.log").write_text("gqa: pass (3.0 s)\n\nkilled after 520 s\n")
    assert "killed at the call's deadline after 520 s" in incomplete(records, tmp_path / "gpu")["fsa-dense-varlen"][0]


def test_incomplete_names_each_gap_of_a_synthetic_record(tmp_path):
    from varlen_workbench.workbench.audit.summary import incomplete

    ours = copy.deepcopy(next(r for r in load_matrix() if r["row"] == "ours"))
    assert incomplete([ours], tmp_path) == {}
    ours["fuzz"]["tried"] = 10
    next(c for c in ours["checks"] if c["name"] == "gqa")["evidence"] = "not run: the CUDA context was lost at check tail-rows"
    ours["sanitizer"]["memcheck"] = {"tool": "memcheck", "errors": None, "why": "timed out after 240 s"}
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "audit-ours-fuzz.log").write_text("real-accuracy: pass (1.0 s)\n\nkilled after 42 s\n")
    assert incomplete([ours], tmp_path)["ours"] == [
        "the latest run's fuzzer killed at the call's deadline after 42 s (the record is an earlier run's)",
        "gqa: the CUDA context was lost at check tail-rows",
        "fuzzer: 10 layouts, short of both budgets",
        "compute-sanitizer memcheck: not run: timed out after 240 s",
    ]
    never = {"row": "fa4", "ran": False, "output": ["ImportError: no module named flash_attn"], "sanitizer": {}}
    assert incomplete([never], tmp_path)["fa4"] == [
        "did not run: ImportError: no module named flash_attn",
        "compute-sanitizer: no record",
    ]


def test_a_check_that_joined_the_audit_after_a_run_is_no_gap_of_it(tmp_path):
    """The lse check came after the H200 records: they are whole without it, and the matrix has no lse
    column yet; a run made after it joined, that lacks it, left it out."""
    from varlen_workbench.workbench.audit.checks import CHECKS
    from varlen_workbench.workbench.audit.matrix import columns, complete, left_out
    from varlen_workbench.workbench.audit.summary import incomplete

    ours = copy.deepcopy(next(r for r in load_matrix() if r["row"] == "ours"))
    ours["checks"] = [c for c in ours["checks"] if c["name"] != "lse"]
    ours["provenance"]["date"] = "2026-12-02 02:22 UTC"
    assert CHECKS["lse"].added > "2026-12-02" and not left_out(ours, "lse") and complete(ours)
    assert "lse" not in columns([ours]) and incomplete([ours], tmp_path) == {}
    ours["provenance"]["date"] = f"{CHECKS['lse'].added} 12:00 UTC"
    assert left_out(ours, "lse") and not complete(ours)
    assert incomplete([ours], tmp_path) == {"ours": ["lse: this check was not in the recorded run"]}


def test_a_fail_that_raised_is_loud_not_silently_wrong():
    """The matrix's varlen_attn audit: no-real-query raised AcceleratorError; the page once called it silently wrong."""
    from varlen_workbench.workbench.audit.records import load_audit_records
    from varlen_workbench.workbench.audit.summary import audits_summary

    records = {record["file"]: record for record in load_audit_records()}
    record = records["audit-torch-varlen.json"]
    no_query = next(c for c in record["checks"] if c["name"] == "no-real-query")
    assert no_query["verdict"] == "FAIL" and no_query["evidence"].startswith("raised AcceleratorError")
    broken = _line(audits_summary({"torch `varlen_attn`": {**record, "row": "torch-varlen"}}), "* **Broken:**")
    silent, _, loud = broken.partition("loud failures")
    assert "no-real-query" not in silent and "silently wrong in fuzzer: real-accuracy" in silent
    assert "no-real-query (raised AcceleratorError: CUDA error: invalid argument)" in loud
