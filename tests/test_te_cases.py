"""The runner of TransformerEngine on the report's repro (postmortems/te_thd_2892/upstream.py), on the CPU.

TE itself runs on the GPU machine only (scripts/te_thd_cases.py). Here a stand-in for it
(tests/data/fake_te: DotProductAttention's THD call computed by the oracle, TE's assertions and
debug log, and the report's SIGSEGV planted under Float8BlockScaling with different boundaries)
drives every part of the runner in real child processes: the case table, the script's slips,
how a child's end is classified, the backend read from the log, the record of each measurement.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import signal
import subprocess
import sys

import pytest
import torch

from varlen_workbench.postmortems.te_thd_2892 import upstream
from varlen_workbench.workbench.layout import Case, Fill, Region, pack
from varlen_workbench.workbench.provenance import REPO
from varlen_workbench.workbench.records import read_record

FAKE_TE = {"PYTHONPATH": str(REPO / "tests" / "data" / "fake_te")}
SMALL = Case(
    seqlens_q=(5, 9, 3), padded_q=(8, 16, 8), padded_k=(8, 16, 8), heads=4, head_dim=16, dtype="bfloat16", causal=True, seed=1
)
RECIPE = {r.name: r for r in upstream.RECIPES}


def test_the_case_table_is_every_recipe_with_each_boundary_on_the_reports_shapes():
    cases = upstream.te_cases()
    assert len(cases) == len(upstream.RECIPES) * 3 and len({c.name for c in cases}) == len(cases)
    report = upstream.REPORT_CASE
    assert report.padded_lengths("q") == (112, 160, 128, 144) and report.real_lengths("q") == (100, 150, 120, 130)
    assert report.heads * report.head_dim == 1536 and report.head_dim == 48 and report.causal
    assert all(p % 16 == 0 for p in report.padded_lengths("q"))  # the report's FP8 alignment
    assert [c.name for c in cases[:3]] == ["bf16:different", "bf16:equal", "bf16:equal-copies"]
    assert RECIPE["block-dpa"].describe() == "Float8BlockScaling(fp8_dpa=True)"
    again = upstream.TeCase.from_json(cases[5].to_json())
    assert again == cases[5]
    with pytest.raises(ValueError, match="boundaries = 'same' must be one of"):
        upstream.TeCase(RECIPE["bf16"], "same")


def test_the_slips_are_mended_one_at_a_time_and_each_version_is_python():
    written = upstream.report_script(0)
    assert written == upstream.REPORT_SCRIPT
    assert "DotProductAttention(num_heads, head_dim, head_dim)" in written and written.count("te.recipe.BlockScaling()") == 2
    versions = [upstream.report_script(n) for n in range(len(upstream.SLIPS) + 1)]
    for before, after in zip(versions, versions[1:]):
        assert before != after
    for text in versions:
        ast.parse(text)
    meant = versions[-1]
    assert "te.recipe" not in meant and "'causal'" not in meant and "head_dim, head_dim" not in meant
    assert "device='cpu'" in upstream.report_script(3, "cpu") and "cuda" not in upstream.report_script(3, "cpu")
    with pytest.raises(ValueError, match="the script has 3 slips"):
        upstream.report_script(4)


def test_the_backend_is_read_from_tes_debug_log():
    log = """[DEBUG    | DotProductAttention]: Disabling FlashAttention 2 for qkv_format = thd when there is padding between sequences
[DEBUG    | DotProductAttention]: Available backends = {FlashAttention=False, FusedAttention=True (sub-backend 2), UnfusedDotProductAttention=False}
[DEBUG    | DotProductAttention]: Selected backend = FusedAttention (sub-backend 2).
[INFO     | DotProductAttention]: Running with FusedAttention backend (sub-backend 2)
[DEBUG    | DotProductAttention]: Selected backend = FusedAttention (sub-backend 2).
"""
    found = upstream.backend_log(log)
    assert found["selected"] == ["FusedAttention (sub-backend 2)"]  # distinct lines, once each
    assert found["running"] == ["FusedAttention (sub-backend 2)"]
    assert found["disabled"] == ["Disabling FlashAttention 2 for qkv_format = thd when there is padding between sequences"]
    assert found["attention_precision"] == "fp8"
    assert upstream.backend_log(log.replace("sub-backend 2", "sub-backend 1"))["attention_precision"] == "bf16/fp16"
    assert upstream.backend_log("no backend lines")["attention_precision"] is None


def test_how_a_child_ended():
    assert upstream.outcome(-signal.SIGSEGV) == {"outcome": "killed", "signal": "SIGSEGV"}
    assert upstream.outcome(1) == {"outcome": "exited", "code": 1}
    assert upstream.outcome(None) == {"outcome": "timed out"}


def test_what_raised_and_where(tmp_path):
    script = tmp_path / "repro.py"
    script.write_text("import x\n\ny = 1 / 0\n")
    stderr = f'Traceback (most recent call last):\n  File "{script}", line 3, in <module>\n    y = 1 / 0\nZeroDivisionError: division by zero\n'
    assert upstream.raised(stderr, str(script)) == {
        "error": "ZeroDivisionError: division by zero",
        "line": 3,
        "source": "y = 1 / 0",
    }
    assert upstream.raised("Segmentation fault\n") == {"error": None}


@pytest.mark.slow  # child processes: a fresh interpreter each
def test_the_reports_script_meets_each_slip_in_turn_and_the_planted_crash_is_a_finding():
    """With the stand-in: the script as written stops at the GQA assertion, then at te.recipe, then
    at the mask type; mended, it reaches the stand-in's planted SIGSEGV, which is recorded with the
    backend the log had named before the crash."""
    runs = [upstream.run_script(n, timeout=120, env=FAKE_TE, device="cpu") for n in range(len(upstream.SLIPS) + 1)]
    assert runs[0]["mended"] == [] and runs[0]["code"] == 1
    assert "divisible by the number of GQA groups" in runs[0]["error"]
    assert runs[0]["source"] == "attn = DotProductAttention(num_heads, head_dim, head_dim)"
    assert runs[1]["error"] == "AttributeError: module 'transformer_engine.pytorch' has no attribute 'recipe'"
    assert "padding or padding_causal" in runs[2]["error"] and "attn(q, k, v" in runs[2]["source"]
    assert runs[3]["mended"] == [s.name for s in upstream.SLIPS]
    assert runs[3]["outcome"] == "killed" and runs[3]["signal"] == "SIGSEGV"
    assert runs[3]["backend"]["selected"] == ["FusedAttention (sub-backend 1)"]


@pytest.mark.slow  # child processes: a fresh interpreter each
def test_a_case_in_its_child_measures_out_and_grads_against_the_oracle():
    run = upstream.spawn(upstream.TeCase(RECIPE["bf16"], "different", SMALL), "cpu", 120, FAKE_TE)
    assert run["outcome"] == "exited" and run["code"] == 0, run
    assert run["versions"]["transformer-engine"] == "0.0.0+fake"
    contract = run["contract"]
    assert contract["ran"] == "forward+backward" and contract["real_within_bound"] and contract["padding_exactly_zero"]
    assert set(contract["tensors"]) == {"out", "dq", "dk", "dv"}
    assert run["te_output_shapes"] == [[SMALL.total_rows("q"), SMALL.heads * SMALL.head_dim]]  # TE flattens heads
    assert run["backend"]["selected"] == ["FusedAttention (sub-backend 1)"]


@pytest.mark.slow  # child processes: a fresh interpreter each
def test_equal_boundaries_are_judged_by_the_real_ones_and_by_the_call():
    """VERL's workaround through the stand-in: correct for the boundaries it passes; against the
    real ones its padding rows hold values, and real keys collect dO from padding queries unless
    padding's dO is zero (a loss over real tokens)."""
    run = upstream.spawn(upstream.TeCase(RECIPE["delayed-dpa"], "equal", SMALL), "cpu", 120, FAKE_TE)
    assert run["code"] == 0, run
    assert run["as_called"]["real_within_bound"] and run["as_called"]["padding_exactly_zero"]
    contract = run["contract"]
    assert contract["tensors"]["out"]["within"] and contract["tensors"]["out"]["padding_max_abs"] > 0
    assert not contract["tensors"]["dk"]["within"] and not contract["padding_exactly_zero"]
    assert run["contract_real_rows_grad"]["real_within_bound"]
    assert run["backend"]["attention_precision"] == "fp8"  # the stand-in names sub-backend 2 under fp8_dpa
    assert run["boundaries_same_object"] == [True]  # VERL's workaround: one tensor passed twice


@pytest.mark.slow  # child processes: a fresh interpreter each
def test_equal_copies_reach_te_as_separate_tensors():
    """TE#3487's case: the same values in two tensors, which TE's auto-detect compares by identity."""
    run = upstream.spawn(upstream.TeCase(RECIPE["bf16"], "equal-copies", SMALL), "cpu", 120, FAKE_TE)
    assert run["code"] == 0, run
    assert run["boundaries_same_object"] == [False]
    assert run["as_called"]["real_within_bound"] and run["contract_real_rows_grad"]["real_within_bound"]
    different = upstream.spawn(upstream.TeCase(RECIPE["bf16"], "different", SMALL), "cpu", 120, FAKE_TE)
    assert different["boundaries_same_object"] == [False]


@pytest.mark.slow  # child processes: a fresh interpreter each
def test_a_crash_and_a_refused_recipe_are_recorded_not_lost():
    crashed = upstream.spawn(upstream.TeCase(RECIPE["block"], "different", SMALL), "cpu", 120, FAKE_TE)
    assert crashed["outcome"] == "killed" and crashed["signal"] == "SIGSEGV" and crashed["case"] == "block:different"
    assert crashed["backend"]["selected"] == ["FusedAttention (sub-backend 1)"]
    refused = upstream.spawn(upstream.TeCase(RECIPE["block-dpa"], "different", SMALL), "cpu", 120, FAKE_TE)
    assert refused["code"] == 0 and refused["stage"] == "recipe"
    assert refused["error"] == "AssertionError: FP8 attention is not supported for Float8BlockScaling."


def test_children_get_tes_debug_log_and_their_path_as_given():
    """The children import varlen_workbench as installed: the repository root on their path would
    only put its folders where `import kernels` looks."""
    env = upstream.child_env({"PYTHONPATH": "/elsewhere"})
    assert env["NVTE_DEBUG"] == "1" and env["NVTE_DEBUG_LEVEL"] == "2"
    assert env["PYTHONPATH"] == "/elsewhere"


def test_the_reports_batch_draws_normal_values_in_padding_rows_too():
    """As the report's script draws every row with torch.randn; real rows stay the case's own."""
    batch, plain = upstream.report_batch(SMALL, "cpu"), pack(SMALL, "cpu")
    assert SMALL.fill is Fill.NAN  # so a padding row the runner failed to redraw would show
    for name, regions in (("q", batch.regions_q), ("k", batch.regions_k), ("v", batch.regions_k)):
        drawn, own = getattr(batch, name).detach(), getattr(plain, name).detach()
        real = regions == Region.REAL
        assert torch.equal(drawn[real], own[real])
        assert torch.isfinite(drawn[~real]).all() and 0.5 < float(drawn[~real].float().std()) < 2.0
        assert getattr(batch, name).requires_grad
    same = upstream.identical_batch(batch)
    assert (same.regions_q == Region.REAL).all() and torch.equal(same.cu_seqlens_q, batch.cu_seqlens_q_padded)
    assert same.q is batch.q and same.cu_seqlens_q is same.cu_seqlens_q_padded  # one tensor passed twice
    copies = upstream.identical_batch(batch, separate=True)  # TE#3487: equal values, separate tensors
    assert torch.equal(copies.cu_seqlens_q, copies.cu_seqlens_q_padded) and copies.cu_seqlens_q is not copies.cu_seqlens_q_padded
    assert copies.cu_seqlens_k is not copies.cu_seqlens_k_padded


def test_the_scripts_summary_line_says_how_each_run_ended():
    spec = importlib.util.spec_from_file_location("te_thd_cases", REPO / "scripts" / "te_thd_cases.py")
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    backend = upstream.backend_log("Selected backend = FusedAttention (sub-backend 1).")
    line = script.summary({"case": "block:different", "outcome": "killed", "signal": "SIGSEGV", "backend": backend})
    assert line.split()[:4] == ["block:different", "killed", "SIGSEGV", "FusedAttention"]
    line = script.summary({"mended": [], "outcome": "exited", "code": 1, "error": "AssertionError: x", "backend": backend})
    assert "script, mended: none" in line and "AssertionError: x" in line


def _run_script(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "scripts" / name), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}, cwd=REPO)


@pytest.mark.slow  # child processes: a fresh interpreter each
def test_the_cases_script_records_each_run_with_provenance(tmp_path):
    record = tmp_path / "cases.json"
    done = _run_script("te_thd_cases.py", "--device", "cpu", "--only", "block:different", "--record", str(record), env=FAKE_TE)
    assert done.returncode == 0, done.stderr
    data = read_record(record)
    assert data["partial"] is False and data["script_runs"] == [] and data["provenance"]["command"].startswith("python3 scripts/")
    (run,) = data["case_runs"]
    assert run["case"] == "block:different" and run["signal"] == "SIGSEGV"
    assert [s["name"] for s in data["slips"]] == [s.name for s in upstream.SLIPS]
    bad = _run_script("te_thd_cases.py", "--only", "nope:equal")
    assert bad.returncode == 2 and "--only ['nope:equal'] are not cases" in bad.stderr


@pytest.mark.slow  # a fresh interpreter training the toy
def test_the_training_script_records_the_loss_and_gradient_norm_of_every_step(tmp_path):
    record = tmp_path / "training.json"
    done = _run_script(
        "te_thd_training.py",
        "--only",
        "replica",
        "--steps",
        "3",
        "--bidirectional-steps",
        "2",
        "--dim",
        "32",
        "--record",
        str(record),
    )
    assert done.returncode == 0, done.stderr
    data = read_record(record)
    assert data["config"]["dim"] == 32
    runs = {(r["objective"], r["boundaries"]): r for r in data["runs"]}
    assert set(runs) == {(o, b) for o in ("causal", "bidirectional") for b in ("separate", "identical")}
    assert len(runs["causal", "separate"]["losses"]) == len(runs["causal", "separate"]["grad_norms"]) == 3
    assert runs["causal", "separate"]["losses"] == runs["causal", "identical"]["losses"]  # causal: padding follows each sequence
    assert runs["bidirectional", "separate"]["losses"] != runs["bidirectional", "identical"]["losses"]


@pytest.mark.gpu
def test_te_itself_runs_a_case_in_its_child():
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("TransformerEngine is not installed here (docs/gpu-transformer-engine.md)")
    case = SMALL.with_(head_dim=64)
    run = upstream.spawn(upstream.TeCase(RECIPE["bf16"], "different", case), "cuda", 300)
    assert run["outcome"] == "exited" and run["code"] == 0, run
    assert run["contract"]["ran"] == "forward+backward" and run["backend"]["selected"], run
