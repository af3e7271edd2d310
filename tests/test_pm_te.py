"""Post-mortem te-thd-2892: the contract and TE's recipe on our kernel, VERL's workaround, tail rows,
FP8 scales, TE's pad_between_seqs auto-detect as transcribed, the toy's training, and the claims."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from varlen_workbench.kernels._compat import default_device
from varlen_workbench.kernels.runtime import interpreted
from varlen_workbench.kernels.varlen import varlen_attention, varlen_attention_triton
from varlen_workbench.postmortems import te_thd_2892 as pm
from varlen_workbench.postmortems.te_thd_2892.training import boundary_runs, global_grad_norms, on_device, train_bidirectional
from varlen_workbench.workbench.instruments.health import GradientHealth
from varlen_workbench.workbench.instruments.tinylm import IGNORE, PAD_TOKEN, SyntheticTask, dense_attention
from varlen_workbench.workbench.layout import Region, pack
from varlen_workbench.workbench.postmortem import Results
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.reference import reference_attention


def ignores_padded_layout(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    """A backend that reads memory by the real boundaries (the FlashAttention-2 path TE
    disables when padding sits between sequences)."""
    kwargs.pop("cu_seqlens_q_padded"), kwargs.pop("cu_seqlens_k_padded")
    return reference_attention(q, k, v, cu_q, cu_k, max_q, max_k, compute_dtype=q.dtype, **kwargs)


def test_te_docstring_example_through_our_kernel():
    record = pm.layout_contract()
    assert pm.TE_DOCSTRING.padded_lengths("q") == pm.TE_DOCSTRING.padded_lengths("k") == (4, 4, 5)  # [0, 4, 8, 13]
    assert record.tensors["out"].shape == (13, 2, 16) and record.tensors["dk"].shape == (13, 2, 16)
    assert (record.regions_q == Region.REAL).sum() == 9  # cu_seqlens_q = [0, 3, 5, 9]
    assert record.real_finite and record.padding_exactly_zero and record.real_within_bound


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_te_recipe_on_our_kernel(dtype):
    result = pm.te_recipe(varlen_attention_triton, (5, 9, 3, 12), dtype=dtype, seed=1)
    assert sum(result.pads) > 0, "the drawn layout must contain padding between sequences"
    assert result.te_passes, result.te_error
    assert result.within_bound, [str(c) for c in result.checks.values()]
    assert result.padding_max_abs == 0.0


def test_te_recipe_catches_a_backend_that_ignores_the_padded_layout():
    result = pm.te_recipe(ignores_padded_layout, (5, 9, 3, 12), seed=1)
    assert not result.te_passes and not result.within_bound


def test_te_recipe_rejects_dtypes_without_te_tolerance():
    with pytest.raises(ValueError, match="dtype = 'float32': TE's recipe states tolerances"):
        pm.te_recipe(varlen_attention, (4, 4), dtype="float32")


@pytest.mark.parametrize("causal", [False, True])
def test_workaround_and_the_right_call(causal):
    case = pm.padding_case(0.2, causal=causal)
    # Non-causal: padding keys steal softmax mass. Causal: padding at a sequence's end is never visible.
    assert pm.workaround_error(case).within is causal
    assert pm.contract_error(case).within  # real cu_seqlens + cu_seqlens_padded: always right


def test_workaround_error_grows_with_padding():
    sweep = pm.workaround_sweep(dense_attention)
    errors = [c.error for _, c in sweep[False]]
    assert sweep[False][0][1].within and not any(c.within for f, c in sweep[False] if f > 0)
    assert errors == sorted(errors)
    assert all(c.within for _, c in sweep[True])


def test_padding_case_and_padded_batch():
    assert pm.padding_case(0.2, causal=True, seqlens=(24, 5)).padded_q == (30, 6)
    assert pm.padding_case(0.2, causal=True, seqlens=(24, 5), align=16).padded_q == (32, 16)
    with pytest.raises(ValueError, match="fraction = 1.0 must be in"):
        pm.padding_case(1.0, causal=True)
    with pytest.raises(ValueError, match="align = 0 must be >= 1"):
        pm.padding_case(0.1, causal=True, align=0)
    batch = pm.padded_batch(SyntheticTask(seed=0), (12, 6), 0.5)
    assert batch.cu_seqlens.tolist() == [0, 12, 18] and batch.cu_seqlens_padded.tolist() == [0, 24, 36]
    assert batch.padding_fraction == pytest.approx(0.5)
    assert (batch.tokens[12:24] == PAD_TOKEN).all() and (batch.targets[11:24] == IGNORE).all()
    assert (batch.tokens[:12] != PAD_TOKEN).all()
    with pytest.raises(ValueError, match="fraction = 1.0 must be in"):
        pm.padded_batch(SyntheticTask(), (4,), 1.0)


def test_tail_blind_backend_leaves_the_tail_unwritten_and_zero_tail_mends_it():
    case = pm.Case((6, 5), padded_q=(6, 9), heads=2, head_dim=16, causal=True, fill=pm.Fill.ZEROS)
    blind = probe(pm.tail_blind(dense_attention), pack(case, "cpu"), poisoned=True)
    tail = blind.regions_q == Region.GAP  # the last sequence's padding: a tail in the backend's eyes
    assert torch.isnan(blind.tensors["out"][tail]).all() and torch.isnan(blind.tensors["dq"][tail]).all()
    assert blind.real_within_bound  # real rows are exact: the damage is what is not written
    mended = probe(pm.zero_tail(pm.tail_blind(dense_attention)), pack(case, "cpu"), poisoned=True)
    assert mended.padding_exactly_zero and mended.real_within_bound
    for name in ("out", "dq", "dk", "dv"):
        real = mended.regions(name) == Region.REAL
        assert torch.equal(mended.tensors[name][real], blind.tensors[name][real])


def test_training_the_causal_toy():
    runs = pm.train_three_ways(steps=12)
    correct, workaround, end, blind, zeroed = (runs[name][0] for name in pm.TRAINING_RUNS)
    assert workaround.losses == correct.losses  # causal masking hides padding at a sequence's end exactly
    assert end.losses == pytest.approx(correct.losses, rel=1e-5)
    assert not math.isfinite(blind.final_loss) and math.isfinite(blind.losses[0])
    assert zeroed.losses == pytest.approx(end.losses, rel=1e-5)
    chain = runs[pm.TRAINING_RUNS[3]][1].causal_chain()
    assert chain.origin.step == 0 and chain.first_parameter == "norm.weight"


def test_boundary_runs_are_the_toys_own_and_take_any_attention():
    """The runs a TE-backed toy is compared with: train_three_ways' first two, through `attention`."""
    three = pm.train_three_ways(steps=4)
    calls = []

    def seen(q, *args, **kwargs):
        calls.append((q.shape[-1], kwargs["causal"], int(kwargs["cu_seqlens_q"][-1]) == q.shape[0]))
        return dense_attention(q, *args, **kwargs)

    runs = boundary_runs(seen, steps=4)
    for name in pm.TRAINING_RUNS[:2]:
        assert runs[name][0].losses == three[name][0].losses
    # 2 layers x 4 steps x 2 runs, each then judged on held-out data (2 layers) with the correct
    # boundaries; the workaround trains with real boundaries ending at the last row (cu_seqlens =
    # cu_seqlens_padded), the correct run with boundaries before it.
    assert len(calls) == 2 * (2 * 4 + 2) and {c[:2] for c in calls} == {(16, True)}
    assert [c[2] for c in calls] == [False] * 10 + [True] * 8 + [False] * 2
    wide = train_bidirectional(2, attention=seen, dim=64)
    assert set(wide) == {"correct", "workaround"} and {c[:2] for c in calls[20:]} == {(32, False)}


def test_on_device_moves_attention_and_its_gradients_and_brings_the_output_back():
    batch = pack(pm.padding_case(0.2, causal=True), "cpu")
    there = on_device(dense_attention, "cpu", torch.float64)
    out = batch.call(there)
    assert out.dtype == batch.q.dtype == torch.float32
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (batch.q, batch.k, batch.v)]
    again = batch.fresh()
    direct = again.call(reference_attention, compute_dtype=torch.float64).float()
    direct.square().sum().backward()
    assert torch.allclose(out, direct, atol=1e-6)
    for grad, t in zip(grads, (again.q, again.k, again.v)):
        assert torch.allclose(grad, t.grad, atol=1e-5)


def test_global_grad_norm_is_the_norm_of_every_gradient_together():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with GradientHealth(model) as monitor:
        for _ in range(2):
            model(torch.ones(5, 3)).square().sum().backward()
            expected = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))
            monitor.step()
            model.zero_grad()
        assert global_grad_norms(monitor)[-1] == pytest.approx(expected, rel=1e-6)
        assert len(global_grad_norms(monitor)) == 2


def test_bidirectional_toy_sees_padding_under_the_workaround():
    (run,) = pm.bidirectional_seeds(seeds=(3,), steps=3)
    # Same weights and data at step 0: only the visible padding keys differ.
    assert run.seed == 3 and run.correct.losses[0] != run.workaround.losses[0]
    assert all(math.isfinite(x) for x in run.correct.losses + run.workaround.losses)
    assert run.train_gap == run.workaround.final_loss - run.correct.final_loss


def test_gradient_health_runs():
    none = pm.health_runs(0.0, steps=3)
    assert set(none) == {"VERL workaround", "correct contract"}
    assert pm.qkv_norm_ratio(none) == 1.0  # no padding: the workaround is the right call
    some = pm.health_runs(0.5, steps=3)
    assert all(len(m.history) == 3 and set(pm.HEALTH_PARAMS) <= set(m.names.values()) for m in some.values())
    assert pm.qkv_norm_ratio(some) != 1.0
    assert pm.health_runs(0.5, steps=3) is some  # cached: the explorer reuses the notebook's runs


def test_pad_between_seqs_transcriptions():
    found = pm.auto_detect()
    assert list(found.values()) == [(True, True), (False, True), (False, True), (False, False)]
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert pm.pad_between_seqs_main(cu, cu.clone()) and not pm.pad_between_seqs_v2_12(cu, cu.clone())


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_fp8_scales_from_real_rows_survive_poisoned_padding():
    # Two sequences, each sharing its 16-row scale block with padding: the clause of FP8_CASE's three, at a third of the cost.
    study = pm.fp8_study(pm.FP8_CASE.with_(seqlens_q=(13, 5)), fills=(pm.Fill.HUGE, pm.Fill.NAN))
    assert study[("huge", "real")].within and study[("nan", "real")].within
    assert not study[("huge", "all")].within and study[("huge", "all")].ratio > 10  # real tokens rounded to 0
    assert math.isnan(study[("nan", "all")].error)


def test_fp8_zeroed_padding_leaves_the_scales_alone():
    assert pm.fp8_zero_padding_scales_equal()
    huge = pm.pack(pm.FP8_CASE.with_(fill=pm.Fill.HUGE), None, requires_grad=False)
    real, every = pm._quantized(huge, "real"), pm._quantized(huge, "all")
    assert not all(torch.equal(a.scale, b.scale) for a, b in zip(real, every))


def test_interpreter_cast_and_quantizer_rounding():
    found = pm.cast_study()
    values = found["values"]
    assert values["torch"][:5].tolist() == [128.0, -128.0, 16.0, 192.0, 1.0]  # carry, ties to even
    assert values["quantizer_matches"] and found["sample"]["quantizer_matches"]
    if interpreted(default_device()):  # Triton 3.6's interpreter: the carry is lost and ties round up
        assert values["triton"][:5].tolist() == [64.0, -64.0, 18.0, 208.0, 1.125]
    else:
        assert torch.equal(values["triton"], values["torch"]) and found["sample"]["triton_differs"] == 0


def test_rope_positions_study():
    study = pm.rope_study(pm.TE_DOCSTRING.with_(dtype="float32"))
    # [a a a 1 b b 2 2 c c c c 3]: real boundaries restart inside b and shift c by 3.
    assert study.from_padded.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert study.from_real.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
    assert study.consistent
    assert [(s.kind, s.offset, s.check.within) for s in study.sequences] == [
        ("exact", 0, True),
        ("restarted", 1, False),
        ("shifted", 3, True),
    ]


def test_claims_fail_when_facts_change():
    assert issubclass(pm.TeResults, Results)
    results = SimpleNamespace(rope=pm.rope_study(pm.TE_DOCSTRING.with_(dtype="float32")), auto_detect=pm.auto_detect())
    held = {v.claim: v.holds for v in pm.claims.check(results)}
    rope = [c for c in pm.claims.statements if c.startswith("RoPE")]
    detect = [c for c in pm.claims.statements if "auto-detect" in c or "PR #2898" in c]
    assert len(rope) == 2 and len(detect) == 2 and all(held[c] for c in rope + detect)
    # A layout without padding has nothing to restart: the corruption claim must stop holding.
    results.rope = pm.rope_study(pm.TE_DOCSTRING.with_(padded_q=None, padded_k=None, dtype="float32"))
    # A TE that compared every boundary would see the tail: the 2.12 claim must stop holding.
    results.auto_detect = {name: (True, new) for name, (_, new) in results.auto_detect.items()}
    held = {v.claim: v.holds for v in pm.claims.check(results)}
    assert not held[rope[1]] and not held[detect[0]] and held[detect[1]]
    # A claim whose results are missing fails, it does not vanish (those on TE read its records alone).
    on_records = [c for c in pm.claims.statements if "TE 2.20.2" in c]
    assert len(on_records) == 10
    assert not any(v.holds for v in pm.claims.check(SimpleNamespace()) if v.claim not in on_records)


def test_claims_on_te_follow_its_records(monkeypatch):
    """The claims on TE itself read its GPU records: a crash, an unpadded output, a padding-blind block scale, a
    missing record must show."""
    import copy

    from varlen_workbench.postmortems.te_thd_2892 import on_te

    changed = {kind: copy.deepcopy(on_te.te_record(kind)) for kind in ("cases", "training", "probes")}
    changed["cases"]["script_runs"][-1] |= {"outcome": "killed", "signal": "SIGSEGV", "code": None}
    for run in changed["cases"]["case_runs"]:
        if run["case"] == "delayed:different":
            run["te_output_shapes"] = [[500, 1536]]
        if run["case"] == "bf16:equal-copies":
            run["contract"]["tensors"]["dq"]["real_error"] *= 2
    changed["training"]["runs"][5]["losses"] = [x + 1e-3 for x in changed["training"]["runs"][5]["losses"]]
    for row in changed["probes"]["gemm"][0]["result"]:
        if (row["name"], row["fill"]) == ("block", "large"):
            row["y_real_error"] *= 3
    changed["probes"]["determinism"][1]["verdict"] = "FAIL"
    monkeypatch.setattr(on_te, "te_record", lambda kind, part=None: changed[kind])
    held = {v.claim: v for v in pm.claims.check(SimpleNamespace())}
    broken = [c for c, v in held.items() if "TE 2.20.2" in c and not v.holds]
    # the script, the different boundaries, TE#3487, the causal training, the FP8 Linear, determinism
    assert len(broken) == 6, broken
    monkeypatch.undo()
    monkeypatch.setattr(on_te, "load_records", lambda pattern: [])
    unrecorded = [v for v in pm.claims.check(SimpleNamespace()) if v.unrecorded]
    assert len(unrecorded) == 10 and all("docs/gpu-transformer-engine.md" in v.evidence for v in unrecorded)


def _cp_rule(kept_findings=(), lost=("dk", "dv"), rows_on_no_rank=6):
    """A padding-rule study as padding_rule_study() returns one (the run itself: test_context_parallel)."""
    from varlen_workbench.workbench.audit.checks import Finding
    from varlen_workbench.workbench.audit.context_parallel import PaddingRuleStudy, cp_case
    from varlen_workbench.workbench.layout import Case

    broken = Case((7, 5, 10), causal=True, head_dim=16)
    unchecked = tuple(Finding("real-accuracy", f"rank 0 of 2: {name}: error 1 > bound 0.1") for name in lost)
    refusal = "sequence 0 has 7 rows in the padded layout (...), not a multiple of 2 x cp_size = 4: ... Pad each sequence to a multiple of 4"
    return PaddingRuleStudy(2, "gloo", cp_case(broken, 2), broken, tuple(kept_findings), refusal, unchecked, rows_on_no_rank)


def test_context_parallel_claims_fail_when_facts_change():
    """The 2 x cp_size claims hold on the study's answers and stop holding when one changes. No claim
    is made of NCCL on two GPUs, where nothing ran (a page claims what ran, not what is to come)."""
    from varlen_workbench.workbench.audit.checks import Finding

    statements = [c for c in pm.claims.statements if "2 x cp_size" in c]
    assert len(statements) == 2 and not any("NCCL" in c for c in pm.claims.statements)

    def verdicts(study):
        return [v for v in pm.claims.check(SimpleNamespace(cp_rule=study)) if v.claim in statements]

    split, kept = verdicts(_cp_rule())
    assert split.holds and kept.holds
    assert not verdicts(_cp_rule(lost=("out", "dk", "dv")))[0].holds  # dropped queries would harm the rows held
    assert not verdicts(_cp_rule(rows_on_no_rank=0))[0].holds
    assert not verdicts(_cp_rule(kept_findings=(Finding("gap-rows", "rank 1 of 2: dq: 3 non-finite values"),)))[1].holds


def test_every_claim_names_its_evidence_and_source_claims_their_commit():
    levels = dict(zip(pm.claims.statements, pm.claims.levels))
    assert {e.kind for e in levels.values()} == {"upstream-gpu", "source", "replica", "toy", "ours"}
    assert {e.at for e in levels.values() if e.kind == "source"} == {pm.TE_V2_12, pm.TE_MAIN}
    assert all(e.kind == "ours" for claim, e in levels.items() if "our kernel" in claim or "our all-gather" in claim)


def test_figures():
    fig = pm.plot_gradient_health(0.0)
    assert [ax.get_title() for ax in fig.axes[:2]] == ["VERL workaround", "correct contract"]
    assert "= 1.00" in fig._suptitle.get_text()
    assert len(pm.plot_contract().axes) == 2
