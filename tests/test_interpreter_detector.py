"""The bf16 `tl.dot` detector (varlen_workbench.kernels.interpreter) against what the installed Triton really does.

Every assertion is phrased against an independent observation, so the tests hold under the
interpreter (where triton 3.6 has the bug), natively on a GPU, and on a future Triton that fixes
the interpreter, and fail if the detector and reality ever disagree.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

import varlen_workbench.kernels.interpreter
from varlen_workbench.kernels.interpreter import (
    BLOCK,
    bf16_dot_is_broken,
    check_dot,
    dot_operands,
    dot_upcast_needed,
    interpreter_bf16_dot_is_broken,
    triton_dot,
)
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.postmortems.triton_interpreter_bf16_dot.probes import (
    SINGLE_BLOCK_MAX_SEQLEN,
    bit_pattern_gap,
    native_dots,
    report,
    single_block_attention,
)
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.probes import probe

ROOT = Path(__file__).resolve().parent.parent


# The CPU (interpreted) always; CUDA (compiled) where there is one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _dot_matches_torch(dtype: torch.dtype, device: str | None = None) -> bool:
    """An observation independent of `check_dot`: allclose against torch's fp64 product."""
    a, b = dot_operands(dtype, device)
    return torch.allclose(triton_dot(a, b).double().cpu(), a.double().cpu() @ b.double().cpu(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_and_fp16_dots_are_correct(dtype):
    check = check_dot(dtype)
    assert check.correct, check
    assert check.relative < 1e-5
    assert _dot_matches_torch(dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_detector_matches_an_independent_observation(device):
    assert bf16_dot_is_broken(device) == (interpreted(device) and not _dot_matches_torch(torch.bfloat16, device))


def test_detector_reports_the_interpreter_bug_as_orders_of_magnitude():
    if not interpreter_bf16_dot_is_broken():
        pytest.skip("this Triton's interpreter computes bf16 tl.dot correctly (fixed upstream)")
    assert check_dot(torch.bfloat16, "cpu").relative > 1e6


def test_bug_is_the_product_of_raw_bit_patterns():
    if not interpreter_bf16_dot_is_broken():
        pytest.skip("no bf16 dot bug in this interpreter: nothing to explain")
    assert bit_pattern_gap() == 0.0


def test_workaround_makes_bf16_dot_correct():
    check = check_dot("bfloat16", upcast=True)
    assert check.correct and check.relative < 1e-5, check


@pytest.mark.parametrize("device", DEVICES)
def test_upcast_is_needed_for_bf16_only_and_exactly_when_broken(device):
    assert dot_upcast_needed(torch.bfloat16, device) == bf16_dot_is_broken(device)
    assert not dot_upcast_needed(torch.float16, device)
    assert not dot_upcast_needed(torch.float32, device)


def test_detector_runs_once():
    bf16_dot_is_broken("cpu")
    before = interpreter_bf16_dot_is_broken.cache_info()
    bf16_dot_is_broken("cpu")
    after = interpreter_bf16_dot_is_broken.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)


def test_compiled_answers_false_without_launching_anything(monkeypatch):
    """Where kernels compile (CUDA tensors), no dot is run to answer: a launch here would raise."""
    if interpreted("cuda"):
        pytest.skip("TRITON_INTERPRET=1 before triton's import: kernels on CUDA tensors are interpreted here")

    def no_launch(*args, **kwargs):
        raise AssertionError("a dot was launched to answer for compiled kernels")

    monkeypatch.setattr(varlen_workbench.kernels.interpreter, "check_dot", no_launch)
    monkeypatch.setattr(varlen_workbench.kernels.interpreter, "interpreter_bf16_dot_is_broken", no_launch)
    assert not bf16_dot_is_broken("cuda") and not dot_upcast_needed(torch.bfloat16, "cuda")


def test_the_interpreters_report_on_any_machine():
    """`report("cpu")`: the interpreter's answer, in this process (no child process, whatever ran before)."""
    found = report("cpu")
    assert found["interpreted"] is True and found["device"] == "cpu"
    assert found["checks"]["float16"]["correct"] and found["checks"]["float32"]["correct"]
    assert found["workaround"]["correct"]
    # The detector's verdict is what its own check observed, and the mechanism explains it.
    assert found["bf16_dot_is_broken"] == (not found["checks"]["bfloat16"]["correct"])
    if found["bf16_dot_is_broken"]:
        assert found["bit_pattern_gap"] == 0.0


@pytest.mark.slow  # a fresh interpreter (torch, Triton, the project compiled): seconds; the full suite runs it
def test_the_interpreters_report_from_a_shell():
    """`WORKBENCH_DEVICE=cpu python -m varlen_workbench.postmortems.triton_interpreter_bf16_dot.probes`, with triton imported first."""
    env = os.environ | {"WORKBENCH_DEVICE": "cpu"}
    code = "import triton, runpy; runpy.run_module('varlen_workbench.postmortems.triton_interpreter_bf16_dot.probes', run_name='__main__')"
    child = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    printed = json.loads(child.stdout)
    assert printed["interpreted"] is True and printed["device"] == "cpu"
    assert printed["bf16_dot_is_broken"] == (not printed["checks"]["bfloat16"]["correct"])


# The dot kernel compiled in this process (after interpreted launches of it above); in the fast
# loop the post-mortem's compile claim (tests/test_pm_interpreter.py) checks the same two kernels,
# here each field is checked.
@pytest.mark.slow
def test_native_compilation_drops_the_upcast_branch():
    off, on = native_dots()[False], native_dots()[True]
    # Flag off: bf16 goes straight to the tensor cores, no conversion in the IR.
    assert off.operand_type == "bf16" and off.conversions == 0
    assert off.mma and all("bf16" in op for op in off.mma) and off.fma == 0
    # Flag on: two widening conversions, an fp32 dot on scalar FMAs ("ieee": no TF32).
    assert on.operand_type == "f32" and on.conversions == 2
    assert not on.mma and on.fma > 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: check_dot("int8"), "dtype = 'int8'"),
        (lambda: check_dot(torch.int32), "dtype = torch.int32"),
        (lambda: triton_dot(torch.zeros(8, BLOCK), torch.zeros(BLOCK, BLOCK)), "a has shape"),
        (lambda: triton_dot(torch.zeros(BLOCK, BLOCK), torch.zeros(BLOCK, BLOCK, dtype=torch.float16)), "share dtype"),
    ],
)
def test_bad_arguments_get_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# One padded, causal GQA case with NaN in its padding: small enough for the interpreter.
CASE = Case(seqlens_q=(21, 40, 3), padded_q=(24, 40, 8), tail_q=3, heads=2, kv_heads=1, head_dim=32, causal=True)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_single_block_attention_is_right_in_fp32_and_fp16(dtype):
    record = probe(single_block_attention, pack(replace(CASE, dtype=dtype)), backward=False)
    assert record.real_within_bound, record.errors
    assert record.padding_exactly_zero


def test_single_block_attention_in_bf16_is_finite_and_wrong_exactly_when_the_detector_says_so():
    batch = pack(replace(CASE, dtype="bfloat16"))
    raw = probe(single_block_attention, batch, backward=False)
    fixed = probe(partial(single_block_attention, upcast=True), batch, backward=False)
    assert raw.real_finite and raw.padding_exactly_zero
    assert raw.real_within_bound == (not bf16_dot_is_broken()), raw.errors
    assert fixed.real_within_bound, fixed.errors


def test_single_block_attention_refuses_long_sequences():
    batch = pack(Case(seqlens_q=(SINGLE_BLOCK_MAX_SEQLEN + 1,), heads=1, head_dim=16))
    with pytest.raises(ValueError, match="max_seqlen_q = 129 exceeds SINGLE_BLOCK_MAX_SEQLEN"):
        batch.call(single_block_attention)
