"""Post-mortem triton-interpreter-bf16-dot: its results, and claims that fail when the facts change."""

import copy
import json

import nbformat
import pytest

from kernels import DEVICE
from postmortems import triton_interpreter_bf16_dot as pm
from workbench.cli import jsonable
from workbench.postmortem import ClaimFailed
from workbench.registry import Registry, check_notebook, recorded_verdicts


@pytest.fixture(scope="module")
def results():
    return pm.reproduce()


def _statement(prefix: str) -> str:
    return next(s for s in pm.claims.statements if s.startswith(prefix))


def _attention(results, impl, dtype="bfloat16"):
    return next(r for r in results["interpreter"]["attention"] if r["impl"] == impl and r["dtype"] == dtype)


def test_module_and_committed_notebook_follow_the_pipeline_conventions():
    postmortem = Registry("postmortems").get(pm.META.id)
    nb = nbformat.read(postmortem.notebook, as_version=4)
    check_notebook(postmortem, nb)
    verdicts = recorded_verdicts(postmortem, nb)
    assert [v.claim for v in verdicts] == pm.claims.statements
    assert all(v.holds for v in verdicts)


def test_every_claim_holds_on_this_machine(results):
    verdicts = pm.claims.check(results)
    assert all(v.holds for v in verdicts), [v for v in verdicts if not v.holds]


def test_results_are_json_ready(results):
    assert json.loads(json.dumps(results)) == results


def test_study_covers_every_dtype_and_the_three_implementations(results):
    rows = results["interpreter"]["attention"]
    assert {(r["impl"], r["dtype"]) for r in rows} == {
        *((pm.REPRODUCTION, case.dtype) for case in pm.CASES),
        (pm.WORKAROUND, "bfloat16"),
        (pm.FIXED, "bfloat16"),
    }
    assert set(_attention(results, pm.FIXED)["errors"]) == {"out", "dq", "dk", "dv"}
    assert set(results["interpreter"]["forward_seconds"]) == {case.dtype for case in pm.CASES}


def _fixed_upstream(r):  # what a Triton with PR #11585 merged would report
    r["interpreter"]["detector"]["checks"]["bfloat16"]["relative"] = 3e-8


def _other_mechanism(r):
    r["interpreter"]["detector"]["bit_pattern_gap"] = 1.0


def _reproduction_nan(r):
    _attention(r, pm.REPRODUCTION)["real_finite"] = False


def _fixed_kernel_off(r):
    _attention(r, pm.FIXED)["real_within_bound"] = False


def _detector_wrong(r):
    r["interpreter"]["detector"]["bf16_dot_is_broken"] = False


def _upcast_compiled_in(r):
    r["compiled"]["off"]["conversions"] = 2


BREAKS = [
    ("bf16 tl.dot under the interpreter differs", _fixed_upstream),
    ("the interpreter's bf16 tl.dot is exactly", _other_mechanism),
    ("a bf16 CPU reproduction without the workaround", _reproduction_nan),
    ("our kernels are within the bound", _fixed_kernel_off),
    ("the detector's answer matches", _detector_wrong),
    ("natively the workaround is compiled out", _upcast_compiled_in),
]


@pytest.mark.parametrize("prefix, breakage", BREAKS, ids=[b.__name__.strip("_") for _, b in BREAKS])
def test_each_claim_fails_when_its_fact_changes(results, prefix, breakage):
    broken = copy.deepcopy(results)
    breakage(broken)
    failing = [v.claim for v in pm.claims.check(broken) if not v.holds]
    assert failing == [_statement(prefix)]
    with pytest.raises(ClaimFailed, match="1 of 6 claims do not hold"):
        pm.claims.report(broken)


def _native(results, broken: bool):
    """A native study as a GPU run reports it: the bf16 dot correct, no upcast."""
    native = copy.deepcopy(results["interpreter"])
    detector = native["detector"]
    detector.update(interpreted=False, bit_pattern_gap=None, bf16_dot_is_broken=broken)
    detector["checks"]["bfloat16"].update(relative=1e-8, correct=True)
    return native


def test_native_results_take_part_in_the_detector_and_compile_claims(results):
    with_native = copy.deepcopy(results) | {"native": _native(results, broken=False)}
    assert all(v.holds for v in pm.claims.check(with_native))
    wrong = copy.deepcopy(results) | {"native": _native(results, broken=True)}
    failing = {v.claim for v in pm.claims.check(wrong) if not v.holds}
    assert failing == {_statement("the detector's answer matches"), _statement("natively the workaround is compiled out")}


def test_reproduce_refuses_the_other_device():
    other = "cuda" if DEVICE == "cpu" else "cpu"
    with pytest.raises(ValueError, match=f"workbench repro {pm.META.id} --device {other}"):
        pm.reproduce(device=other)


def test_gpu_records_written_by_workbench_repro_are_rendered(results, tmp_path, monkeypatch):
    # The record `workbench repro --record` writes: our results go through its `jsonable` unchanged.
    record = {"provenance": {"device": "NVIDIA H200"}, "verdict": "6/6 claims hold", "results": jsonable(results)}
    (tmp_path / f"{pm.META.id}-h200.json").write_text(json.dumps(record))
    (tmp_path / "another-postmortem-h200.json").write_text("{}")
    monkeypatch.setattr(pm, "GPU_DATA", tmp_path)
    records = pm.gpu_records()
    assert len(records) == 1 and records[0]["results"] == results
    assert "bfloat16 + upcast" in pm.dot_table(records[0]["results"])
    assert "bfloat16" in pm.cost_table(records[0]["results"])


def test_tables_show_each_mode_present(results):
    with_native = copy.deepcopy(results) | {"native": _native(results, broken=False)}
    table = pm.dot_table(with_native)
    assert table.count("interpreter ") == 4 and table.count("native ") == 4
    assert pm.dot_table({**results, "native": None}).count("native ") == 0
