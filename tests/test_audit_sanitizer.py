"""compute-sanitizer's text output parsed (workbench.audit.sanitizer), on logs saved from H200 runs
(kept under tests/data/sanitizer/: data/gpu/logs/ holds the latest run of each row, which a re-run
replaces) and a racecheck hazard report in the tool's documented format."""

from __future__ import annotations

import json
from pathlib import Path

from workbench.audit.sanitizer import API_RETURN_CODE, load_sanitizer, parse, row_summary, status
from workbench.provenance import GPU_DATA

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
