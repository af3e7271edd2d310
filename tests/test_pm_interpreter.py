"""Post-mortem triton-interpreter-bf16-dot: its results, and claims that fail when the facts change."""

import copy
import dataclasses
import json

import nbformat
import pytest
import torch

from varlen_workbench.postmortems import triton_interpreter_bf16_dot as pm
from varlen_workbench.workbench.postmortem import OURS, UPSTREAM_CPU, UPSTREAM_GPU, ClaimFailed, Evidence
from varlen_workbench.workbench.records import jsonable, load_records
from varlen_workbench.workbench.registry import Registry, check_notebook, recorded_verdicts


@pytest.fixture(scope="module")
def results():
    return pm.reproduce()


def _statement(prefix: str) -> str:
    return next(s for s in pm.claims.statements if s.startswith(prefix))


def _attention(results, impl, dtype="bfloat16"):
    return next(r for r in results.interpreter["attention"] if r["impl"] == impl and r["dtype"] == dtype)


def _replace(results, **changes):
    return dataclasses.replace(copy.deepcopy(results), **changes)


def test_module_and_committed_notebook_follow_the_pipeline_conventions():
    postmortem = Registry().get(pm.META.id)
    nb = nbformat.read(postmortem.notebook, as_version=4)
    check_notebook(postmortem, nb)
    verdicts = recorded_verdicts(postmortem, nb)
    assert [v.claim for v in verdicts] == pm.claims.statements
    assert all(v.holds for v in verdicts)
    assert pm.META.category == "tooling bug"


def test_every_claim_says_what_produced_its_evidence():
    levels = dict(zip(pm.claims.statements, pm.claims.levels))
    assert levels[_statement("bf16 tl.dot under the interpreter")] == UPSTREAM_CPU  # the real interpreter
    assert levels[_statement("compiled natively on a GPU")] == UPSTREAM_GPU  # the recorded H200 run
    source = levels[_statement("the interpreter stores bf16 as uint16")]
    assert source.kind == "source" and source.at == pm.SOURCE_READ
    assert levels[_statement("our kernels are within the bound")] == OURS
    # The bug itself is shown on the CPU, in the real interpreter: that is the index's level, not the
    # GPU control's (a stronger level that says nothing of how the bug was shown).
    assert pm.claims.headline_level == UPSTREAM_CPU and UPSTREAM_GPU in pm.claims.levels
    assert all(isinstance(level, Evidence) for level in levels.values())


def test_every_claim_holds_on_this_machine(results):
    verdicts = pm.claims.check(results)
    assert all(v.holds for v in verdicts), [v for v in verdicts if not v.holds]


def test_results_are_json_ready(results):
    summary = results.summary()
    assert json.loads(json.dumps(summary)) == summary
    assert set(summary) == {"interpreter", "native", "compiled", "source", "gpu", "sum_nan"}


def test_study_covers_every_dtype_and_the_three_implementations(results):
    rows = results.interpreter["attention"]
    assert {(r["impl"], r["dtype"]) for r in rows} == {
        *((pm.REPRODUCTION, case.dtype) for case in pm.CASES),
        (pm.WORKAROUND, "bfloat16"),
        (pm.FIXED, "bfloat16"),
    }
    assert set(_attention(results, pm.FIXED)["errors"]) == {"out", "dq", "dk", "dv"}
    assert set(results.interpreter["forward_seconds"]) == {case.dtype for case in pm.CASES}


def _fixed_upstream(r):  # what a Triton with PR #11585 merged would report
    r.interpreter["detector"]["checks"]["bfloat16"]["relative"] = 3e-8


def _other_mechanism(r):
    r.interpreter["detector"]["bit_pattern_gap"] = 1.0


def _source_changed(r):  # a Triton whose create_dot converts bf16 too
    r.source["create_dot"] = r.source["create_dot"].replace("primitive_bitwidth == 8", "primitive_bitwidth <= 16")


def _native_wrong(r):  # a GPU record whose native bf16 dot is off
    r.gpu[-1]["results"]["native"]["detector"]["checks"]["bfloat16"]["correct"] = False


def _reproduction_nan(r):
    _attention(r, pm.REPRODUCTION)["real_finite"] = False


def _fixed_kernel_off(r):
    _attention(r, pm.FIXED)["real_within_bound"] = False


def _detector_wrong(r):
    r.interpreter["detector"]["bf16_dot_is_broken"] = False


def _upcast_compiled_in(r):
    r.compiled["off"]["conversions"] = 2


def _sum_fixed_upstream(r):
    r.sum_nan["bfloat16"] = None  # a Triton whose interpreter sums bf16 as values (triton#11604 fixed): NaN


BREAKS = [
    ("bf16 tl.dot under the interpreter differs", _fixed_upstream),
    ("the interpreter's bf16 tl.dot is exactly", _other_mechanism),
    ("the interpreter stores bf16 as uint16", _source_changed),
    ("a bf16 attention forward with two tl.dot", _reproduction_nan),
    ("compiled natively on a GPU", _native_wrong),
    ("our kernels are within the bound", _fixed_kernel_off),
    ("the detector's answer matches", _detector_wrong),
    ("natively the workaround is compiled out", _upcast_compiled_in),
    ("the same uint16 storage breaks the interpreter's bf16 tl.sum", _sum_fixed_upstream),
]


@pytest.mark.parametrize("prefix, breakage", BREAKS, ids=[b.__name__.strip("_") for _, b in BREAKS])
def test_each_claim_fails_when_its_fact_changes(results, prefix, breakage):
    broken = copy.deepcopy(results)
    breakage(broken)
    failing = [v.claim for v in pm.claims.check(broken) if not v.holds]
    assert failing == [_statement(prefix)]
    with pytest.raises(ClaimFailed, match=f"1 of {len(pm.claims)} claims do not hold"):
        pm.claims.report(broken)


def _native(results, broken: bool):
    """A native study as a GPU run reports it: the bf16 dot correct, no upcast."""
    native = copy.deepcopy(results.interpreter)
    detector = native["detector"]
    detector.update(interpreted=False, bit_pattern_gap=None, bf16_dot_is_broken=broken)
    detector["checks"]["bfloat16"].update(relative=1e-8, correct=True)
    return native


def test_native_results_take_part_in_the_detector_and_compile_claims(results):
    with_native = _replace(results, native=_native(results, broken=False))
    assert all(v.holds for v in pm.claims.check(with_native))
    wrong = _replace(results, native=_native(results, broken=True))
    failing = {v.claim for v in pm.claims.check(wrong) if not v.holds}
    assert failing == {_statement("the detector's answer matches"), _statement("natively the workaround is compiled out")}


def test_without_any_native_run_the_gpu_claim_fails_saying_how_to_record_one(results):
    (verdict,) = [v for v in pm.claims.check(_replace(results, gpu=[], native=None)) if v.level == UPSTREAM_GPU]
    assert not verdict.holds and "varlen-workbench repro triton-interpreter-bf16-dot --device cuda --record" in verdict.evidence


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA has the device")
def test_reproduce_refuses_a_device_it_does_not_have():
    with pytest.raises(ValueError, match=f"sees no CUDA device: run `varlen-workbench repro {pm.META.id} --device cuda`"):
        pm.reproduce(device="cuda")


def test_the_committed_gpu_record_is_read_in_its_older_shape(results):
    """data/gpu/triton-interpreter-bf16-dot-h200.json predates `source`, `gpu` and claim levels:
    gpu_records(META) still reads it, and its results render through the same tables."""
    (record,) = load_records(f"{pm.META.id}-*.json")
    assert record["provenance"]["device"] == "NVIDIA H200" and record["results"]["native"] is not None
    assert results.gpu and results.gpu[-1]["file"] == record["file"]
    recorded = pm._recorded(record)
    assert str(pm.dot_table(recorded)).count("native ") == 4
    assert "NVIDIA H200" in str(pm.gpu_table(results))


def test_records_written_by_workbench_repro_are_rendered(results, tmp_path):
    # The record `varlen-workbench repro --record` writes: our results go through `jsonable` unchanged.
    record = {"provenance": {"device": "NVIDIA H200"}, "verdict": "8/8 claims hold", "results": jsonable(results)}
    (tmp_path / f"{pm.META.id}-h200.json").write_text(json.dumps(record))
    (tmp_path / "another-postmortem-h200.json").write_text("{}")
    (loaded,) = load_records(f"{pm.META.id}-*.json", tmp_path)
    assert loaded["results"] == results.summary()
    assert "bfloat16 + upcast" in str(pm.dot_table(pm._recorded(loaded)))


def test_tables_show_each_mode_present(results):
    with_native = _replace(results, native=_native(results, broken=False))
    shown = str(pm.dot_table(with_native))
    assert shown.count("interpreter ") == 4 and shown.count("native ") == 4
    assert str(pm.dot_table(_replace(results, native=None))).count("native ") == 0


def test_listings_read_the_code_as_it_is_now():
    from varlen_workbench.kernels.varlen import kernel_common

    assert "def _dot(a, b, DOT_UPCAST: tl.constexpr, acc=None):" in str(pm.listing("our _dot"))
    assert kernel_common._dot.fn.__name__ == "_dot"
    with pytest.raises(ValueError, match="give one of"):
        pm.listing("nothing")
