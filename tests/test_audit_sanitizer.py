"""compute-sanitizer's text output parsed (varlen_workbench.workbench.audit.sanitizer), on logs saved from H200 runs
(kept under tests/data/sanitizer/: data/gpu/logs/ holds the latest run of each row, which a re-run
replaces) and a racecheck hazard report in the tool's documented format."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from varlen_workbench.workbench.audit.sanitizer import API_RETURN_CODE, load_sanitizer, parse, row_summary, status
from varlen_workbench.workbench.provenance import GPU_DATA, REPO

LOGS = Path(__file__).parent / "data" / "sanitizer"
DONE = "sdpa-cudnn: q=[37, 0, 100, 64] H=4/2 D=64 bfloat16 causal forward+backward in 21.0 s"
RACE = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at 0x1a0 in race.cu:12:sumKernel(int*, int*)
=========     and Read access at 0x1c0 in race.cu:15:sumKernel(int*, int*) [4 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


def _log(name: str) -> str:
    return (LOGS / f"{name}.log").read_text()


def test_a_device_error_gives_the_summary_count_its_kind_and_first_frame():
    run = parse(_log("sdpa-cudnn-initcheck"), "initcheck", DONE)
    assert run.errors == 44832 and run.completed and not run.aborted
    assert run.kinds == {"Uninitialized __global__ memory read": 20}  # the print limit: 20 shown
    assert run.first.startswith(
        "Uninitialized __global__ memory read of size 16 bytes: at void at::native::vectorized_gather_kernel"
    )
    assert status(run.to_dict()) == (44832, f"44832 errors; first: {run.first}")


def test_a_host_api_error_names_the_copy_and_its_size():
    run = parse(_log("torch-varlen-initcheck"), "initcheck", "torch-varlen: ... forward+backward in 12.4 s")
    assert run.errors == 256 and run.kinds == {"Host API memory access error": 20}
    assert "of size 105,472 bytes" in run.first and run.first.endswith("on access by cudaMemcpy source")


def test_errors_that_abort_the_program_count_and_a_program_that_never_ran_does_not():
    flex = parse(_log("flex-document-memcheck"), "memcheck", "RuntimeError: CUDA error: unspecified launch failure")
    assert flex.errors == 203 and flex.aborted and not flex.completed
    assert flex.first.endswith(
        "at triton_tem_fused_flex_attention_0+0x13e0 in chlqawz55tn5vkvoulid7e7cbze4vggx2yurbizq3jonc3ssio5d.py:383"
    )
    assert status(flex.to_dict())[1].startswith("203 errors, then the program aborted; first: Invalid __global__ read")
    missing = parse(_log("dmattn-triton-initcheck"), "initcheck", "ValueError: cannot import module 'flash_dmattn'")
    assert missing.errors == 0 and missing.aborted  # "0 errors" about a program that did not run
    assert status(missing.to_dict()) == (None, "did not complete: ValueError: cannot import module 'flash_dmattn'")


def test_racecheck_counts_hazard_errors():
    clean = parse(_log("ours-racecheck"), "racecheck", "ours: ... forward+backward in 8.2 s")
    assert clean.errors == 0 and clean.kinds == {} and status(clean.to_dict()) == (0, "0 errors")
    race = parse(RACE, "racecheck", "forward+backward in 1.0 s")
    assert race.errors == 1 and race.kinds == {"Error: Race reported between Write access": 1}
    assert race.first.endswith(": and Read access at 0x1c0 in race.cu:15:sumKernel(int*, int*) [4 hazards]")


def test_a_row_is_clean_only_when_every_tool_counts():
    done = "ours: ... forward+backward in 8.2 s"
    clean = {tool: parse(_log("ours-racecheck"), tool, done).to_dict() for tool in ("initcheck", "memcheck", "racecheck")}
    assert row_summary(clean)[0::2] == ("clean", 0)
    timed_out = {**clean, "initcheck": {"tool": "initcheck", "errors": None, "why": "timed out after 240 s"}}
    verdict, evidence, _ = row_summary(timed_out)
    assert verdict == "not run" and "initcheck: not run: timed out after 240 s" in evidence
    assert row_summary({}) == ("not run", "no compute-sanitizer record", None)


def test_a_run_killed_past_its_limit_keeps_the_reports_it_printed_but_no_count():
    text = _log("sdpa-cudnn-initcheck")
    killed = parse(text[: text.index("ERROR SUMMARY")], "initcheck")  # no summary: the tool never finished
    assert killed.errors is None and killed.kinds == {"Uninitialized __global__ memory read": 20}
    run = {**killed.to_dict(), "why": "timed out after 549 s"}
    assert status(run) == (
        None,
        f"not run through: timed out after 549 s, 20 reports printed before it; first: {killed.first}",
    )
    assert status({**run, "kinds": {}}) == (None, "not run: timed out after 549 s")


def test_api_return_codes_are_not_memory_errors():
    run = parse(_log("cudnn-ragged-memcheck"), "memcheck", "cudnn-ragged: ... forward+backward in 30.1 s")
    assert run.errors == 34 and run.completed and all(kind.startswith(API_RETURN_CODE) for kind in run.kinds)
    errors, line = status(run.to_dict())
    assert errors is None and line.startswith("34 reports, the printed ones CUDA API return codes, not memory errors")
    assert row_summary({"memcheck": run.to_dict()})[0] == "not run"  # the matrix script runs it again


def test_a_per_row_record_takes_precedence_over_the_earlier_single_record(tmp_path):
    for path in [GPU_DATA / "audit-sanitizer.json"]:
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "logs").mkdir()
    run = parse(_log("sdpa-cudnn-memcheck"), "memcheck", DONE).to_dict()
    (tmp_path / "sanitizer-sdpa-cudnn.json").write_text(
        json.dumps({"row": "sdpa-cudnn", "tools": {"memcheck": run}, "provenance": {}})
    )
    loaded = load_sanitizer(tmp_path)
    assert loaded["sdpa-cudnn"] == {"memcheck": run}
    assert loaded["ours"]["initcheck"]["why"] == "no log"  # the earlier record's logs are not in tmp_path


def test_a_reduced_program_completes_and_says_what_it_gave_up():
    program = "\n".join(
        [
            "sdpa-efficient: reduced: without GQA (the layout with it was refused: SDPA backend EFFICIENT_ATTENTION ...)",
            "sdpa-efficient: q=[37, 0, 100, 64] k=[40, 5, 100, 64] H=4 D=64 bfloat16 causal forward+backward in 3.1 s",
        ]
    )
    run = parse(_log("ours-racecheck"), "memcheck", program)
    assert run.completed and run.reduced == ["without GQA (the layout with it was refused: SDPA backend EFFICIENT_ATTENTION ...)"]
    assert status(run.to_dict()) == (0, f"0 errors; {run.reduced[0]}")
    forward = parse(
        _log("ours-racecheck"), "initcheck", "x: reduced: forward only: the backward raises E: e\nx: q=[3] forward only in 1.0 s"
    )
    assert forward.completed and status(forward.to_dict())[1] == "0 errors; forward only: the backward raises E: e"


# scripts/audit_sanitize.py's `watch` on the CPU, with functions that refuse GQA or whose backward raises.
def _attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    from varlen_workbench.workbench.reference import reference_attention

    return reference_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw).to(q.dtype)


def refuses_gqa(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    from varlen_workbench.workbench.audit import AdapterRefused

    if q.shape[1] != k.shape[1]:
        raise AdapterRefused("no kernel for grouped heads")
    return _attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


class _ExtraGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("function _ExtraGradient returned a gradient different than None at position 5")


def backward_raises(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    return _ExtraGradient.apply(_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw))


def test_the_sanitizer_program_runs_what_the_row_can_and_says_so():
    from varlen_workbench.workbench.audit import adapt
    from varlen_workbench.workbench.layout import Case

    spec = importlib.util.spec_from_file_location("audit_sanitize", REPO / "scripts" / "audit_sanitize.py")
    assert spec and spec.loader
    sanitize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sanitize)
    case = Case((3, 0, 2), seqlens_k=(2, 1, 2), heads=2, kv_heads=1, head_dim=16, causal=True)
    said: list[str] = []
    ran, what = sanitize.watch(adapt(refuses_gqa, "contract", "cpu"), case, said.append)
    assert (ran, what) == (case.with_(kv_heads=None), "forward+backward")
    assert said == ["reduced: without GQA (the layout with it was refused: no kernel for grouped heads)"]
    said.clear()
    ran, what = sanitize.watch(adapt(backward_raises, "contract", "cpu"), case, said.append)
    assert (ran, what) == (case, "forward only") and said == [
        "reduced: forward only: the backward raises RuntimeError: function _ExtraGradient returned a gradient different "
        "than None at position 5 (the counts include that attempt)"
    ]


def test_the_earlier_flex_run_read_just_before_its_allocations_in_one_kernel():
    """audit-matrix.ipynb states this of the kept log through the check, and prints its count from it."""
    from varlen_workbench.workbench.audit.sanitizer import reads_just_before_allocations

    log = _log("flex-document-memcheck")
    assert reads_just_before_allocations(log).kinds == {"Invalid __global__ read": 20}
    with pytest.raises(AssertionError, match="not just before an allocation"):
        reads_just_before_allocations(
            log.replace("is 4 bytes before the nearest allocation", "is 4 bytes after the nearest allocation", 1)
        )
    with pytest.raises(AssertionError, match="reads in 2 kernels"):
        reads_just_before_allocations(log.replace("at triton_tem_fused_flex_attention_0+0x13e0", "at other_kernel+0x10", 1))
