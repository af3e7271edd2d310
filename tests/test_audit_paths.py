"""The adapters of varlen_workbench.workbench.audit.adapters for paths other than a plain varlen call, on the CPU where the path runs there.

SDPA's math backend and nested jagged tensors run on the CPU; FlexAttention runs forward only
(no CPU backward): its document mask is checked against the fp64 oracle directly, and its CPU
audit compares out alone and says so; the CUDA-only packages say so instead of failing. GPU verdicts come from data/gpu/audit-*.json.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from varlen_workbench.workbench.audit import ADAPTERS, Verdict, adapt, audit, detect
from varlen_workbench.workbench.audit.adapters import MATRIX, fsa_dense_varlen
from varlen_workbench.workbench.audit.checks import Finding
from varlen_workbench.workbench.audit.snippets import torch_snippet
from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.reference import reference_attention

SDPA = "torch.nn.functional:scaled_dot_product_attention"


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # nested SDPA logs every backend it cannot use
    yield
    logging.disable(logging.NOTSET)


def test_sdpa_math_on_a_padded_batch_is_correct_and_lets_planted_nan_through():
    report = audit(SDPA, "sdpa-math", budget=0, skip=["determinism"])
    verdicts = report.verdicts()
    assert verdicts.pop("padding-leak") == "FAIL"  # 0 * NaN: a NaN planted in a padded key reaches real rows
    assert "(nan padding)" in report.result("padding-leak").evidence
    assert {verdicts.pop(n) for n in ("tail-rows", "gap-rows", "input-validation", "lse")} == {"n/a"}
    assert set(verdicts.values()) == {"pass"}, report.table()


def test_sdpa_flash_cannot_take_a_padding_mask_so_it_is_not_applicable():
    report = audit(SDPA, "sdpa-flash", budget=3)
    assert {r.verdict for r in report.results} == {Verdict.NA} and not report.ran
    assert "takes no attn_mask" in report.results[0].evidence


def test_nested_jagged_sdpa_refusals_are_not_applicable_not_failures():
    report = audit(SDPA, "sdpa-nested", budget=4, checks=["empty-sequences", "gqa", "causal-unequal"])
    assert report.verdicts() == {"empty-sequences": "pass", "gqa": "n/a", "causal-unequal": "n/a"}


@pytest.mark.parametrize(
    "case",
    [
        Case((5, 3, 0, 7), padded_q=(8, 4, 2, 7), padded_k=(6, 3, 2, 9), tail_q=3, tail_k=2, heads=4, kv_heads=2, causal=True),
        Case((5, 3), seqlens_k=(9, 1), causal=True),
        Case((6,), seqlens_k=(0,)),
    ],
    ids=["padded-gqa-causal", "unequal-causal", "no-keys"],
)
def test_flex_document_mask_matches_the_oracle_forward(case):
    from torch.nn.attention.flex_attention import flex_attention

    call = ADAPTERS["flex-document"].wrap(flex_attention)
    batch = pack(case.with_(fill=Fill.ZEROS), "cpu")
    with torch.no_grad():
        out = call(*batch.args(), **batch.kwargs())
    torch.testing.assert_close(out, reference_attention(*batch.args(), **batch.kwargs()).to(out.dtype), atol=1e-5, rtol=1e-5)
    assert detect(flex_attention).name == "flex-document"
    impl = adapt(flex_attention, device="cpu")
    assert impl.why_not() is None and not impl.backward and "no backward on CPU" in impl.lacks["backward"]


@pytest.mark.slow  # a whole audit of compiled FlexAttention on the CPU: ~5 s
def test_flex_document_is_audited_forward_only_on_the_cpu():
    """FlexAttention has no CPU backward: the CPU audit compares out alone, says so, and still finds
    the H200 record's padding-leak (0 x NaN from NaN-filled padding)."""
    from torch.nn.attention.flex_attention import flex_attention

    report = audit(flex_attention, "flex-document", device="cpu", budget=0, checks=["real-accuracy", "gap-rows", "padding-leak"])
    assert "no backward on CPU" in report.forward_only and "forward only:" in str(report)
    assert report.verdicts() == {"real-accuracy": "pass", "gap-rows": "pass", "padding-leak": "FAIL"}, report.table()
    assert report.result("real-accuracy").evidence.endswith("(out)")
    assert report.result("gap-rows").evidence.startswith("GAP rows of out exactly 0")
    leak = report.result("padding-leak").evidence
    assert "out:" in leak and "dq:" not in leak
    # the plain-torch snippet of a forward-only path runs where the audit ran: no backward, out alone
    snippet = torch_snippet(
        adapt(flex_attention, device="cpu"), report.result("padding-leak").cases[0], Finding("padding-leak", leak)
    )
    assert "backward = False  # forward only" in snippet
    printed = []
    exec(compile(snippet, "<snippet>", "exec"), {"print": lambda *a: printed.append(" ".join(map(str, a)))})
    assert len(printed) == 1 and printed[0].startswith("out: damaged REAL rows ["), printed
    assert not printed[0].startswith("out: damaged REAL rows []"), f"the snippet shows the damage: {printed}"


def test_cuda_only_packages_are_detected_and_say_why_they_do_not_run_here():
    impl = adapt(fsa_dense_varlen, device="cpu")  # imports flash_sparse_attn through the triton_kernels stub
    assert impl.adapter.name == "fsa-varlen" and "CUDA only" in impl.why_not()
    dmattn = pytest.importorskip("flash_dmattn.flash_dmattn_triton")
    assert adapt(dmattn.triton_dmattn_func, device="cpu").adapter.name == "dmattn"
    assert {row for row, _, _ in MATRIX} >= {"ours", "torch-varlen", "flex-document", "sdpa-cudnn", "dmattn-triton"}


def test_the_plain_torch_snippet_of_a_padded_batch_path_runs():
    impl = adapt(SDPA, "sdpa-math", device="cpu")
    case = Case((3, 2), heads=1, head_dim=16, fill=Fill.NAN)
    snippet = torch_snippet(impl, case, Finding("real-accuracy", "planted NaN reaches real rows"))
    assert "workbench" not in snippet and "sdpa_kernel(SDPBackend.MATH)" in snippet
    printed = []
    exec(compile(snippet, "<snippet>", "exec"), {"print": lambda *a: printed.append(" ".join(map(str, a)))})
    # The NaN in the padded key slot of sequence 1 (length 2 in a batch padded to 3) damages its rows 3, 4.
    assert printed == [f"{n}: damaged REAL rows [3, 4], padding rows not 0 []" for n in ("out", "dq", "dk", "dv")], printed


def test_mask_adapters_carry_the_window_and_the_others_say_they_take_none():
    """SDPA with a mask expresses any window (bshd_mask is the oracle's rule per sequence, padded
    positions masked); paths whose call has no window_size are n/a for windows, with the reason."""
    from varlen_workbench.workbench.audit.adapters import bshd_mask
    from varlen_workbench.workbench.reference import visible_keys

    report = audit(SDPA, "sdpa-math", device="cpu", budget=0, checks=["sliding-window"])
    assert report.verdicts() == {"sliding-window": "pass"}, report.table()
    mask = bshd_mask([5, 2], [3, 6], 5, 6, False, "cpu", (0, 1))
    for b, (lq, lk) in enumerate(((5, 3), (2, 6))):
        assert torch.equal(mask[b, :lq, :lk], visible_keys(lq, lk, (0, 1)))
        assert not mask[b, lq:].any() and not mask[b, :, lk:].any()
    assert torch.equal(bshd_mask([4], [4], 4, 4, True, "cpu", (1, 3))[0], visible_keys(4, 4, (1, 0)))  # causal: right = 0
    for adapter in ("sdpa-nested", "flex-document", "fsa-varlen"):
        target = "varlen_workbench.workbench.audit.adapters.fsa:fsa_dense_varlen" if adapter == "fsa-varlen" else SDPA
        if adapter == "flex-document":
            target = "torch.nn.attention.flex_attention:flex_attention"
        assert "takes no window_size" in adapt(target, adapter, device="cpu").lacks["window"]


# -- flash-sparse-attn's misaligned address: the library's, not the adapter's ----------------------

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
FSA_SCRIPT = SCRIPTS / "fsa_misaligned.py"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only; nothing runs at import
    return module


def test_the_fsa_script_replays_the_first_call_the_gpu_audit_made():
    """scripts/fsa_misaligned.py's 'audit' case is the layout real-accuracy packs first for fsa-varlen
    on the GPU (head dim 64, float16, TAIL rows kept, GAP rows dropped: the adapter lacks 'padded')."""
    from varlen_workbench.workbench.audit.checks import CHECKS, Context
    from varlen_workbench.workbench.layout import observing_packs

    class Packed(Exception):
        pass

    def stop(case):
        raise Packed(case)

    ctx = Context(adapt(fsa_dense_varlen, device="cpu"), "float16", head_dim=64)  # as `audit --device cuda` builds it
    with observing_packs(stop), pytest.raises(Packed) as packed:
        CHECKS["real-accuracy"].run(ctx)
    case = packed.value.args[0]
    script = _script("fsa_misaligned")
    lengths, tail_q, tail_k = script.CASES["audit"]
    assert (case.seqlens_q, case.seqlens_k, case.tail_q, case.tail_k) == (lengths, None, tail_q, tail_k)
    assert (case.heads, case.kv_heads, case.head_dim, case.dtype, case.causal) == (
        script.HEADS,
        None,
        script.HEAD_DIM,
        "float16",
        False,
    )
    assert case.padded_q is None and case.padded_k is None and case.fill == Fill.ZEROS
    # what the adapter hands on unchanged: fresh contiguous tensors at offset 0, int32 boundaries
    batch = pack(case, "cpu").fresh()
    for t in (batch.q, batch.k, batch.v):
        assert t.is_contiguous() and t.storage_offset() == 0 and t.data_ptr() % 16 == 0 and t.dtype == torch.float16
    assert batch.cu_seqlens_q.dtype == batch.cu_seqlens_k.dtype == torch.int32
    assert batch.cu_seqlens_q.tolist() == [0, 5, 8, 15] and batch.q.shape == (18, 2, 64)


@pytest.mark.slow
def test_fsa_varlen_backward_builds_a_tma_descriptor_over_lse_at_an_address_not_16_byte_aligned(tmp_path):
    """Under the interpreter every tensor descriptor of the adapter's call is checked against Triton's
    rule (base 16-byte aligned, leading strides multiples of 16 bytes): the forward's are all aligned;
    the backward preprocess kernel's lse descriptor (LSE + h * total_q + cu_seqlens_q[b], float32) is
    not, with or without TAIL rows, and is when every sequence start and the row count are multiples
    of 4 (the fixed-length function's likewise at sequence length 7, not 8). Compiled for sm_90 that
    descriptor is a tensor map read by a 1-D TMA load."""
    if importlib.util.find_spec("flash_sparse_attn") is None:
        pytest.skip("flash-sparse-attn is not installed")
    out = tmp_path / "fsa.json"
    done = subprocess.run(
        [sys.executable, str(FSA_SCRIPT), "--ptx", "--fixed", "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    calls = {(r["function"], r["case"]): r for r in results if "function" in r}
    assert len(calls) == 8
    for (function, case), r in calls.items():
        assert r["stage"] == "done", (function, case, r.get("error"))
        assert max(r["max_abs_error_vs_float64"].values()) < 1e-2  # the values are right where alignment is not enforced
        assert all(d["kernel"] for d in r["descriptors"])
        bad = [d for d in r["descriptors"] if "violation" in d]
        forward = [d for d in r["descriptors"] if d["kernel"].startswith("_fwd")]
        assert len(forward) == 4 and not any("violation" in d for d in forward)  # q, k, v, out
        (launch,) = r["preprocess_lse_bases"]
        misaligned = sorted(p for p, m in launch["base_mod16"].items() if m)
        if case in ("aligned", "fixed-8"):
            assert bad == [] and misaligned == []
            continue
        (lse,) = bad
        assert (lse["kernel"], lse["violation"]) == ("_bwd_preprocess_kernel", "base must be 16-byte aligned")
        assert lse["site"].startswith("ops/triton/flash_bwd_preprocess.py:") and lse["strides_bytes"] == [4]
        # what the hook predicts from the tensors the kernel receives is what the interpreter saw
        predicted = {}
        for m in launch["base_mod16"].values():
            predicted[str(m)] = predicted.get(str(m), 0) + 1
        assert lse["base_mod16"] == predicted
        expected = {
            "audit": ["b0 h1", "b1 h0", "b1 h1", "b2 h1"],  # 4 * (h * 18 + cu_seqlens_q[b]) % 16 != 0
            "no-tail": ["b0 h1", "b1 h0", "b2 h1"],  # 4 * (h * 15 + cu_seqlens_q[b]) % 16 != 0
            "fixed-7": ["b0 h1", "b1 h0", "b1 h1"],  # the fixed-length backward too: 4 * (b * 14 + h * 7) % 16 != 0
        }
        assert misaligned == expected[case]
    (ptx,) = [r for r in results if "target" in r]
    assert ptx["tensormaps_built_in_kernel"] == 6 and ptx["tma_loads_1d"] == 1, ptx  # lse is the only 1-D load


def test_the_fsa_script_replays_each_audit_checks_first_call_with_the_gpus_layout():
    """--checks replays the call each audit check makes first on the H200 (its native layouts, not the
    interpreter-sized ones), with the probe's keywords: the call whose error that check's cell records."""
    from varlen_workbench.postmortems.fsa_varlen_descriptors.audit import first_call  # the script's --checks replay

    function = _script("fsa_misaligned").FUNCTIONS[0]
    _, determinism, kwargs = first_call("determinism", function)
    assert (determinism.seqlens_q, determinism.heads, determinism.causal) == ((300, 1000, 77, 512), 8, True)
    assert kwargs == {"reference": False}
    _, scaled, kwargs = first_call("custom-scale", function)
    assert scaled.seqlens_q == (5, 9) and kwargs == {"scale": 0.3}
    _, empty, _ = first_call("empty-sequences", function)
    assert (empty.seqlens_q, empty.tail_q, empty.head_dim, empty.dtype) == ((3, 0, 4, 0), 0, 64, "float16")
    with pytest.raises(ValueError, match="no audit check 'no-such-check'"):
        first_call("no-such-check", function)


@pytest.mark.slow
def test_fsa_empty_sequences_call_builds_descriptors_over_no_element_and_the_others_do_not(tmp_path):
    """The empty-sequences call's forward stores the output of each empty sequence (2 sequences x 2
    heads) through a descriptor of extent 0; the tail-rows call builds none. Both break the lse rule."""
    if importlib.util.find_spec("flash_sparse_attn") is None:
        pytest.skip("flash-sparse-attn is not installed")
    out = tmp_path / "checks.json"
    done = subprocess.run(
        [sys.executable, str(FSA_SCRIPT), "--checks", "empty-sequences,tail-rows", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["function"], r["case"]) for r in results] == [
        (function, f"check {check}")
        for function in _script("fsa_misaligned").FUNCTIONS
        for check in ("empty-sequences", "tail-rows")
    ]
    for r in results:
        assert r["stage"] == "done", r.get("error")
        bad = [d for d in r["descriptors"] if "violation" in d]
        assert [(d["kernel"], d["violation"]) for d in bad] == [("_bwd_preprocess_kernel", "base must be 16-byte aligned")]
        forward_empty = [d for d in r["descriptors"] if d["kernel"].startswith("_fwd") and d.get("zero_extent")]
        if r["case"] == "check tail-rows":
            assert not any(d.get("zero_extent") for d in r["descriptors"])
            continue
        assert r["cu_seqlens_q"] == [0, 3, 3, 7, 7]
        (out_descriptor,) = forward_empty
        assert out_descriptor["zero_extent"] == out_descriptor["zero_extent_accesses"] == 4


# -- sdpa-nested's fuzzer failures: where torch's jagged SDPA sends a causal batch with an empty sequence --


def test_a_causal_nested_batch_with_an_empty_sequence_is_dispatched_to_cudnn():
    """torch's jagged SDPA tries flash, memory-efficient, math, then cuDNN: the first two refuse a
    sequence of length 0 and math refuses is_causal, so with the device checks passing (as on an
    H200) cuDNN is left for every batch the H200 fuzzer failed on; one token instead of none: flash."""
    script = _script("nested_sdpa_backend")
    for lengths in script.LAYOUTS.values():
        empty = 0 in lengths
        assert script.backend(lengths, True, "cpu") == ("CUDNN_ATTENTION" if empty else "FLASH_ATTENTION"), lengths
        assert script.backend(lengths, False, "cpu") == ("MATH" if empty else "FLASH_ATTENTION"), lengths
    assert sum(0 in lengths for lengths in script.LAYOUTS.values()) == 3
    # the script's own yardstick, where the CPU can run the call (math, not causal): within the bound
    assert max(script.errors((5, 0, 7), "cpu", causal=False).values()) < 1
