"""Post-mortem fsa-varlen-descriptors: the repacking workaround (exact on a float64 stand-in with
fsa's signature and bottom-right causal alignment), the lse bases a batch misaligns, the descriptor
recording under the interpreter, and claims that fail when the records say otherwise."""

import copy

import pytest
import torch
from triton.runtime.errors import InterpreterError

from varlen_workbench.postmortems import fsa_varlen_descriptors as pm
from varlen_workbench.postmortems.fsa_varlen_descriptors.study import contract
from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.reference import reference_attention


def float64_fsa(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False, softmax_scale=None):
    """fsa's varlen signature over the float64 reference (bottom-right causal, as fsa's block_info.py).
    It refuses the layouts fsa faults on, so a call reaching it went through the workaround."""
    starts, rows = cu_seqlens_q.tolist(), query.shape[0]
    assert all(s % 4 == 0 for s in starts) and rows % 4 == 0, f"misaligned lse bases: {starts}, {rows} rows"
    assert (cu_seqlens_q.diff() > 0).all() and (cu_seqlens_k.diff() > 0).all(), "an empty sequence"
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return reference_attention(query, key, value, *args, causal=is_causal, scale=softmax_scale, validate=False)


LAYOUTS = [
    Case((5, 3, 7), tail_q=3, tail_k=2, heads=2, head_dim=8, dtype="float64", fill=Fill.ZEROS),
    Case((5, 3), seqlens_k=(9, 7), causal=True, heads=2, head_dim=8, dtype="float64"),
    Case((3, 2, 4), seqlens_k=(3, 0, 2), causal=True, heads=2, head_dim=8, dtype="float64"),
    Case((3, 0, 4, 0), seqlens_k=(3, 2, 4, 0), heads=2, head_dim=8, dtype="float64"),
    Case((6, 1), seqlens_k=(2, 5), causal=True, heads=2, kv_heads=1, head_dim=8, dtype="float64"),
]


@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: c.label())
def test_the_workaround_gives_what_the_call_without_it_means(case):
    """Repacked (empty sequences dropped, queries padded at the start to a multiple of 4) through a
    float64 stand-in, out, dq, dk, dv equal the reference's on the batch as given: REAL rows to
    float64 rounding, TAIL rows of out and padding gradients exactly 0."""
    batch = pack(case, "cpu")
    inputs = [t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    expected = [t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    d_out = torch.randn(batch.q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    args = (batch.cu_seqlens_q.int(), batch.cu_seqlens_k.int(), batch.max_seqlen_q, batch.max_seqlen_k)
    out = pm.repacked(float64_fsa)(*inputs, *args, is_causal=case.causal)
    ref = reference_attention(*expected, *args, causal=case.causal)
    out.backward(d_out)
    ref.backward(d_out)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(inputs, expected, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    assert (out[int(batch.cu_seqlens_q[-1]) :] == 0).all() and (inputs[1].grad[int(batch.cu_seqlens_k[-1]) :] == 0).all()


def test_without_the_workaround_the_stand_in_refuses_the_audits_call():
    """The stand-in is strict: the bare call (the audit's real-accuracy layout) is refused."""
    batch = pack(LAYOUTS[0], "cpu")
    with pytest.raises(AssertionError, match="misaligned lse bases"):
        float64_fsa(batch.q, batch.k, batch.v, batch.cu_seqlens_q.int(), batch.cu_seqlens_k.int(), 7, 7)


def test_repack_plan_places_dummy_rows_first_and_drops_empty_sequences():
    cu_q, cu_k = torch.tensor([0, 5, 5, 8, 8]), torch.tensor([0, 2, 4, 4, 6])
    rows_q, cu_q_call, rows_k, cu_k_call, back = pm.repack_plan(cu_q, cu_k, rows_q=10, multiple=4)
    # sequence 0: 3 dummies + rows 0-4; 1: no query (dropped); 2: no key (dropped); 3: no query
    assert rows_q == [10, 10, 10, 0, 1, 2, 3, 4] and cu_q_call == [0, 8]
    assert rows_k == [0, 1] and cu_k_call == [0, 2]
    assert back == [3, 4, 5, 6, 7, 8, 8, 8, 8, 8]  # rows 5-9 (dropped, TAIL) read the zero row after the call's 8
    with pytest.raises(ValueError, match="multiple=0"):
        pm.repack_plan(cu_q, cu_k, rows_q=10, multiple=0)
    with pytest.raises(ValueError, match="one boundary list per batch"):
        pm.repack_plan(cu_q, cu_k[:-1], rows_q=10, multiple=4)


def test_a_batch_with_no_sequence_to_call_gives_zeros_and_zero_gradients():
    q = torch.randn(4, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 0, 4], dtype=torch.int32), torch.tensor([0, 3, 3], dtype=torch.int32)
    out = pm.repacked(float64_fsa)(q, k, k, cu_q, cu_k, 4, 3)
    out.sum().backward()
    assert (out == 0).all() and (q.grad == 0).all()


@pytest.mark.parametrize(
    "case", [LAYOUTS[0], LAYOUTS[4], pm.NO_QUERY.with_(dtype="float64", head_dim=8)], ids=lambda c: c.label()
)
def test_the_real_rows_workaround_zeroes_tail_rows_and_their_gradients(case):
    """(c): the call on the rows up to cu_seqlens[-1], zeros after. Through a float64 stand-in that
    leaves its TAIL rows NaN as fsa's torch.empty_like does: REAL rows equal the reference, TAIL rows of
    out and every gradient exactly 0; without the workaround the stand-in's TAIL rows are NaN."""

    def unwritten_tail(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False, softmax_scale=None
    ):
        args = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out = reference_attention(query, key, value, *args, causal=is_causal, scale=softmax_scale, validate=False)
        tail = torch.zeros(query.shape[0], dtype=torch.bool)
        tail[int(cu_seqlens_q[-1]) :] = True
        return torch.where(tail[:, None, None], torch.nan, out)

    batch = pack(case, "cpu")
    inputs = [t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    expected = [t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    args = (batch.cu_seqlens_q.int(), batch.cu_seqlens_k.int(), batch.max_seqlen_q, batch.max_seqlen_k)
    assert unwritten_tail(*expected, *args)[int(batch.cu_seqlens_q[-1]) :].isnan().all()
    out = pm.real_rows(unwritten_tail)(*inputs, *args, is_causal=case.causal)
    ref = reference_attention(*expected, *args, causal=case.causal)
    d_out = torch.randn(batch.q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out.backward(d_out)
    ref.backward(d_out)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(inputs, expected, strict=True):  # no real query: k and v outside the graph, gradient None
        torch.testing.assert_close(torch.zeros_like(got) if got.grad is None else got.grad, want.grad, rtol=1e-12, atol=1e-12)
    assert (out[int(batch.cu_seqlens_q[-1]) :] == 0).all() and (inputs[0].grad[int(batch.cu_seqlens_q[-1]) :] == 0).all()


def test_misaligned_lse_bases_of_the_audits_call():
    """The audit's first call: lse (2, 18), starts 0, 5, 8: h * 18 + start not a multiple of 4."""
    batch = pack(pm.AUDIT, "cpu")
    assert pm.misaligned_lse_bases(batch.cu_seqlens_q, 18, 2) == [(1, 0), (0, 1), (1, 1), (2, 1)]
    assert pm.misaligned_lse_bases(torch.tensor([0, 8, 12, 24]), 24, 2) == []


def test_the_contract_refuses_a_padded_layout():
    batch = pack(Case((5, 3), padded_q=(8, 4), heads=2, head_dim=8, dtype="float64"), "cpu")
    with pytest.raises(ValueError, match="no padded layout"):
        batch.call(contract(float64_fsa))


def test_the_interpreter_records_the_misaligned_lse_descriptor_and_asserts_outside_the_recording():
    """One tiny call of the library itself: inside `recorded_descriptors` the lse descriptor's
    violation is recorded (the call completes); outside, the interpreter asserts as it always does."""
    case = Case((5, 3), heads=1, head_dim=64, dtype="float16", fill=Fill.ZEROS)
    call = pm.run(pm.FUNCTIONS[0], pm.BARE, case)  # lse (1, 8): base of sequence 1 at 5 floats
    assert call.violations() == {("_bwd_preprocess_kernel", "ops/triton/flash_bwd_preprocess.py")}
    assert call.misaligned == 1 and call.zero_extent == 0 and call.probe.real_within_bound
    fsa = pm.load("cpu")
    batch = pack(case, "cpu").fresh()
    out = fsa.flash_dense_attn_varlen_func(batch.q, batch.k, batch.v, batch.cu_seqlens_q.int(), batch.cu_seqlens_k.int(), 5, 5)
    with pytest.raises(InterpreterError) as raised:  # the interpreter's wrapper around the kernel's AssertionError
        out.backward(torch.ones_like(out))
    assert isinstance(raised.value.__cause__, AssertionError) and "16-byte aligned" in str(raised.value.__cause__)


@pytest.fixture(scope="module")
def results():
    return pm.reproduce()


@pytest.mark.slow
def test_every_claim_holds(results):
    assert all(v.holds for v in pm.claims.check(results))


@pytest.mark.slow
def test_the_claims_fail_when_the_records_or_the_calls_say_otherwise(results):
    changed = copy.deepcopy(results)
    check = next(c for c in changed.audits["fsa-dense-varlen"]["checks"] if c["name"] == "gqa")
    check["verdict"], check["evidence"] = "pass", ""
    assert not pm.claims.verdict(changed, "On the H200").holds
    changed = copy.deepcopy(results)
    changed.sanitizers["fsa-sparse-varlen"]["tools"]["memcheck"]["first"] = "Invalid __global__ read: at x in scheduler.py:99"
    assert not pm.claims.verdict(changed, "compute-sanitizer").holds
    changed = copy.deepcopy(results)
    fixed = next(c for c in changed.calls if c.variant == pm.ALIGNED)
    fixed.descriptors[0]["violation"] = "base must be 16-byte aligned"
    fixed.descriptors[0]["base_mod16"] = {"4": 1}
    assert not pm.claims.verdict(changed, "Workaround (b),").holds
    changed = copy.deepcopy(results)
    changed.misaligned_h200["results"][0]["library_frames"][1] = "ops/triton/flash_dense_bwd.py:999 _bwd_dense_kernel"
    assert not pm.claims.verdict(changed, "Run alone on the H200").holds
    changed = copy.deepcopy(results)
    aligned = next(c for c in changed.misaligned_h200["results"] if c["case"] == "aligned")
    aligned["stage"] = "backward"
    assert not pm.claims.verdict(changed, "Run alone on the H200").holds
    changed = copy.deepcopy(results)
    check = next(c for c in changed.audits["fsa-sparse-varlen"]["checks"] if c["name"] == "no-real-query")
    check["evidence"] = check["evidence"].replace("dq: 256", "dq: 128")
    assert not pm.claims.verdict(changed, "The no-real-query call").holds
    changed = copy.deepcopy(results)
    bare = changed.call(pm.FUNCTIONS[1], pm.BARE, pm.NO_QUERY, poisoned=True)
    bare.probe.nonfinite["dq"]["TAIL"] = 0  # as if the backward had written dq's TAIL rows
    assert not pm.claims.verdict(changed, "Under the interpreter, in NaN-poisoned memory").holds
    changed = copy.deepcopy(results)
    fixed = changed.call(pm.FUNCTIONS[0], pm.REAL_ROWS, pm.AUDIT, poisoned=True)
    fixed.probe.nonfinite["out"]["TAIL"] = 1
    fixed.probe.max_abs["out"]["TAIL"] = float("nan")
    assert not pm.claims.verdict(changed, "Workaround (c)").holds
    changed = copy.deepcopy(results)
    changed.workaround_h200["results"][-1]["padding_exactly_zero"] = False
    assert not pm.claims.verdict(changed, "Workaround (b) on the H200").holds
    changed.workaround_h200["results"] = changed.workaround_h200["results"][:-1]  # a call missing
    assert not pm.claims.verdict(changed, "Workaround (b) on the H200").holds


def test_the_scripts_workaround_mode_runs_the_pages_workaround():
    """scripts/fsa_misaligned.py --workaround (the H200 run of the workaround) on the empty-sequences call, here."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "fsa_misaligned.py"
    spec = importlib.util.spec_from_file_location("fsa_misaligned", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    found = script.one_call(pm.load("cpu"), pm.FUNCTIONS[0], "workaround:empty", "cpu")
    assert found["stage"] == "done" and found["real_within_bound"] and found["padding_exactly_zero"], found
