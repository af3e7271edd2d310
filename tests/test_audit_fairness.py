"""The audit is fair to the code it judges (issue 16, section 6).

A correct plain-PyTorch attention, written as a user would (per-sequence SDPA over cu_seqlens,
no validation at all), passes every correctness check; its missing validation shows as its own
grade, never as a FAIL. Labels are true: a Python list that gives the right answer is correct,
a negative scale is valid mathematics, a function returning None is "no output", a wrong
adapter is a usage error before any check runs, and a valid layout without real query rows
does not crash the harness.
"""

from __future__ import annotations

import pytest

from varlen_workbench.workbench.audit import Verdict, adapt, audit
from varlen_workbench.workbench.audit.campaign import Outcome
from varlen_workbench.workbench.audit.plain import plain_attention
from varlen_workbench.workbench.cli.main import main
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.probes import probe


def returns_none(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    return None


def test_a_correct_plain_pytorch_attention_passes_and_its_validation_is_its_own_grade():
    report = audit(plain_attention, "contract", budget=12)
    correctness = {r.name: r.verdict for r in report.results if r.name != "input-validation"}
    # It takes no window_size: the window check is not applicable (windows are opt-in), not failed.
    assert correctness.pop("sliding-window") is Verdict.NA and "takes no window_size" in report.result("sliding-window").evidence
    assert correctness.pop("lse") is Verdict.NA and "no return_lse parameter" in report.result("lse").evidence
    assert set(correctness.values()) == {Verdict.PASS}, report.table()
    assert report.passed, str(report)
    assert report.validation in ("no validation", "partly validates"), report.table()
    rows = {r["id"]: r["outcome"] for r in report.result("input-validation").rows}
    assert rows["cu-not-tensor"] == Outcome.CORRECT.value  # a Python list with the right answer is not wrong
    assert rows["scale-negative"] == Outcome.CORRECT.value  # valid mathematics
    assert rows["scale-tensor"] == Outcome.CORRECT.value
    # Every silent wrong result was compared with the fp64 oracle (the evidence says so).
    for row in report.result("input-validation").rows:
        if row["outcome"] == Outcome.SILENT_WRONG.value:
            assert "fp64 oracle" in row["evidence"], row


def test_none_is_no_output_not_a_wrong_result_and_not_a_harness_crash():
    report = audit(returns_none, "contract", budget=2, checks=["real-accuracy", "input-validation"])
    result = report.result("real-accuracy")
    assert result.verdict is Verdict.FAIL and result.evidence.startswith("no output: returns_none returned NoneType")
    assert "AttributeError" not in str(report)
    outcomes = {r["id"]: r["outcome"] for r in report.result("input-validation").rows}
    # The window cases are n/a: returns_none takes no window_size.
    assert {o for i, o in outcomes.items() if not i.startswith("window-")} == {Outcome.NO_OUTPUT.value}
    assert {o for i, o in outcomes.items() if i.startswith("window-")} == {Outcome.NA.value}
    assert {f.check for f in report.fuzz.failures} == {"no-output"}


def test_a_wrong_adapter_is_a_usage_error_before_any_check():
    def two_args(q, k):
        return q

    with pytest.raises(ValueError, match=r"(?s)adapter 'contract' cannot call .*two_args.*fewer than three .*register_adapter"):
        adapt(two_args, "contract")
    with pytest.raises(ValueError, match=r"no adapter recognises 42: it is a int"):
        audit(42, "contract", budget=0)
    with pytest.raises(ValueError, match=r"no adapter recognises 42"):
        audit(42, budget=0)


def test_a_layout_without_real_query_rows_does_not_crash_the_harness():
    # Valid: one sequence of 0 queries, 3 TAIL rows. plain_attention returns zeros that do not
    # depend on q, k, v; backward must give zero gradients, not "does not require grad".
    impl = adapt(plain_attention, "contract")
    record = probe(impl, pack(Case((0,), seqlens_k=(4,), tail_q=3), impl.device), poisoned=True)
    assert record.padding_exactly_zero and float(record.tensors["dk"].abs().max()) == 0.0


def test_skip_beside_checks(capsys):
    report = audit(plain_attention, "contract", budget=0, skip=["input-validation", "determinism", "gqa"])
    assert [r.name for r in report.results] == [
        "real-accuracy",
        "tail-rows",
        "gap-rows",
        "padding-leak",
        "empty-sequences",
        "no-real-query",
        "custom-scale",
        "fully-masked-rows",
        "causal-unequal",
        "sliding-window",
        "lse",
    ]
    assert "input-validation" not in report.verdicts()
    assert main(["audit", "varlen_workbench.workbench.reference:reference_attention", "--budget", "0", "--skip", "nope"]) == 2
    assert "--checks / --skip name unknown checks ['nope']" in capsys.readouterr().err
