"""Post-mortem flash-dmattn-121: its oracle, the upstream kernel harness, its diagnosis rule, cases, GPU probes and claims
(the notebook runs the whole study)."""

import importlib
import math
import sys
from dataclasses import replace

import pytest
import torch

from varlen_workbench.postmortems import flash_dmattn_121 as pm
from varlen_workbench.workbench import upstream
from varlen_workbench.workbench.postmortem import Claims, Table
from varlen_workbench.workbench.sweeps import SweepResult


def _qkv(batch=2, seqlen=24, heads=2, head_dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seqlen, heads, head_dim, generator=generator, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_dense_reference_matches_sdpa(causal):
    q, k, v = _qkv()
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 1, 24, 24, generator=generator) < 0.6
    mask[..., 0] = True  # no fully masked row: SDPA's semantics coincide
    bias = torch.randn(2, 1, 24, 24, generator=generator, dtype=torch.float64)
    out, lse = pm.dense_reference(q, k, v, mask, bias, causal)
    attn = bias.masked_fill(~mask, -math.inf)
    if causal:
        attn = attn.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), -math.inf)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn
    )
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-12)
    scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * 8**-0.5 + attn
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-12)


def test_dense_reference_rows_without_keys_are_zero_with_zero_gradient():
    q, k, v = (t.requires_grad_() for t in _qkv(batch=1, heads=1))
    mask = torch.ones(1, 1, 24, 24, dtype=torch.bool)
    mask[:, :, 3] = False
    out, lse = pm.dense_reference(q, k, v, mask)
    out.sum().backward()
    assert torch.equal(out[0, 3], torch.zeros_like(out[0, 3])) and torch.isneginf(lse[0, 0, 3])
    assert torch.equal(q.grad[0, 3], torch.zeros_like(q.grad[0, 3]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_mask_patterns():
    case = pm.MaskCase("t", "leading", amount=5, seqlen=64, block_n=32)
    mask = case.mask()[0, 0]
    assert not mask[:5, :32].any() and mask[:5, 32:].all() and mask[5:].all()
    padded = pm.MaskCase("t", "left_pad", amount=7, batch=2, seqlen=16).mask()
    assert padded[0].all() and not padded[1, :, :, :7].any() and padded[1, :, :, 7:].all()
    right = pm.MaskCase("t", "right_pad", amount=7, batch=2, seqlen=16).mask()
    assert right[0].all() and not right[1, :, :, 9:].any() and right[1, :, :, :9].all()
    self_seeing = pm.MaskCase("t", "left_pad_self", amount=7, batch=2, seqlen=16).mask()
    assert torch.equal(self_seeing[1, 0, :7, :7], torch.eye(7, dtype=torch.bool)) and torch.equal(
        self_seeing[:, :, 7:], padded[:, :, 7:]
    )
    assert pm.MaskCase("t", "none").mask() is None


def test_padding_rows_real_rows_and_the_loss_mask():
    case = pm.MaskCase("t", "left_pad", amount=5, batch=2, seqlen=16, causal=True, loss_mask=True)
    assert case.padding_rows()[1].tolist() == [True] * 5 + [False] * 11 and not case.padding_rows()[0].any()
    assert torch.equal(case.real_query_rows(), ~case.padding_rows())
    d_out = case.inputs("cpu")["d_out"]
    assert (d_out[1, :5] == 0).all() and (d_out[1, 5:] != 0).any() and (d_out[0] != 0).any()
    rows = pm.MaskCase("t", "rows", amount=3, seqlen=16).real_query_rows()
    assert rows[0].tolist() == [False] * 3 + [True] * 13  # a row with no visible key is no row a loss reads


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(pattern="diagonal"), "pattern"),
        (dict(pattern="left_pad"), "batch >= 2"),
        (dict(pattern="right_pad"), "batch >= 2"),
        (dict(pattern="random", amount=2.0), "0..1"),
        (dict(pattern="rows", loss_mask=True), "padded pattern"),
    ],
)
def test_mask_case_rejects_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        pm.MaskCase("bad", **fields)


def test_upstream_is_the_installed_release_in_fp16_under_the_interpreter():
    assert pm.upstream_version() == pm.UPSTREAM_VERSION
    assert pm.upstream_dtype() == "float16"
    module = pm.upstream_module()
    assert module.__file__.endswith("flash_dmattn/flash_dmattn_triton.py") and "site-packages" in module.__file__
    assert module.triton_dmattn_func is pm.upstream_triton_func()


def test_the_reports_snippet_raises_on_the_release():
    errors = pm.upstream_call_errors()
    assert (
        errors["the report's snippet as written"].startswith("TypeError") and "scale" in errors["the report's snippet as written"]
    )
    assert (
        errors["softmax_scale, attn_bias=None"].startswith("RuntimeError")
        and "gradient" in errors["softmax_scale, attn_bias=None"]
    )


def test_predicted_nan_rows_from_the_mask_alone():
    leading = pm.MaskCase("t", "leading", amount=5, seqlen=96, block_n=64)
    assert pm.predict_upstream_nan_rows(leading)[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    beyond = pm.MaskCase("t", "leading", amount=5, seqlen=96, block_n=32)  # keys 32-63 still visible: no NaN
    assert not pm.predict_upstream_nan_rows(beyond).any()
    padded = pm.MaskCase("t", "left_pad", amount=10, batch=2, seqlen=32, causal=True)
    assert pm.predict_upstream_nan_rows(padded).sum(-1).tolist() == [0, 10]
    assert not pm.predict_upstream_nan_rows(replace(padded, causal=False)).any()  # padding queries then see real keys
    assert not pm.predict_upstream_nan_rows(pm.SEED).any()


def test_upstream_run_nan_rows_match_the_prediction_and_poison_the_whole_item():
    case = pm.MaskCase("t", "left_pad", amount=6, batch=2, seqlen=64, head_dim=16, causal=True, dtype="float16")
    run = pm.upstream_run(case)
    assert torch.equal(pm.observed_upstream_nan_rows(run), pm.predict_upstream_nan_rows(case))
    assert pm.observed_upstream_nan_grad_items(run).tolist() == pm.predict_upstream_nan_grad_items(case).tolist() == [False, True]
    assert run.tensors["dv"][0].isfinite().all() and run.nan_rows("dv") == 64 and run.summary()["nonfinite"]["dv"] == 64 * 16
    fixed = pm.upstream_run(replace(case, pattern="left_pad_self", loss_mask=True))
    assert fixed.all_finite and fixed.all_within


def test_a_length_off_the_backward_block_poisons_dk_dv_of_every_item_and_nothing_else():
    case = pm.MaskCase("t", "none", batch=2, seqlen=40, head_dim=16, dtype="float16")
    assert pm.predict_upstream_nan_grad_items(case).tolist() == [True, True] and not pm.predict_upstream_nan_rows(case).any()
    run = pm.upstream_run(case)
    assert run.finite("out") and run.finite("dq") and pm.observed_upstream_nan_grad_items(run).tolist() == [True, True]
    assert not pm.predict_upstream_nan_grad_items(replace(case, seqlen=64)).any()


def test_upstream_coverage_is_bit_identical_under_poisoned_memory():
    case = pm.MaskCase("t", "none", seqlen=64, head_dim=16, causal=True, dtype="float16")
    plain, poisoned = pm.upstream_run(case), pm.upstream_run(case, poisoned=True)
    assert plain.all_finite and poisoned.poisoned and all(torch.equal(plain.tensors[g], poisoned.tensors[g]) for g in pm.GRADS)


def test_run_measures_the_guard_within_bound_and_the_patch_outside():
    case = pm.MaskCase("t", "leading", amount=4, seqlen=32, head_dim=16, block_m=16, block_n=16)
    fixed, patched = pm.run(case, "guard"), pm.run(case, "patch")
    assert fixed.all_finite and fixed.all_within
    assert patched.finite("dv") and not patched.finite("lse") and patched.error_ratio("dv") > 1
    with pytest.raises(ValueError, match="variant"):
        pm.run(case, "nan_to_num")


def test_patch_as_written_error_names_isfinite():
    assert "isfinite" in pm.patch_as_written_error()


def test_packed_equivalent_holds_the_dense_values():
    batch, d_out = pm.packed_equivalent()
    x = pm.PADDED.inputs()
    pad, n = int(pm.PADDED.amount), pm.PADDED.seqlen
    assert batch.cu_seqlens_q.tolist() == [0, n, n, 2 * n - pad]
    assert batch.cu_seqlens_q_padded.tolist() == [0, n, n + pad, 2 * n]
    assert torch.equal(batch.q.detach(), x["q"].reshape(-1, 1, pm.PADDED.head_dim)) and d_out.shape == batch.q.shape
    with pytest.raises(ValueError, match="PADDED"):
        pm.packed_equivalent(pm.REPLICA_CASES[1])


def test_successor_import_fails_on_the_undeclared_triton_kernels_and_the_stub_lets_it_import():
    assert "triton_kernels" in pm.successor_import_error()
    saved = {
        name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith(("triton_kernels", "flash_sparse_attn"))
    }
    meta_path = list(sys.meta_path)
    try:
        flash_sparse_attn = pm.import_successor()
        assert flash_sparse_attn.__version__ == pm.SUCCESSOR_VERSION and "triton_kernels" in upstream.stubbed()
        with pytest.raises(ImportError, match="triton_kernels is not installed"):
            sys.modules["triton_kernels.matmul_ogs"].matmul_ogs()
    finally:
        sys.meta_path[:] = meta_path
        for name in [n for n in sys.modules if n.startswith(("triton_kernels", "flash_sparse_attn"))]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_gpu_probes_refuse_the_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        pm.gpu_probes("cpu")


def _fake_monitor(norms: dict[str, list[float]]):
    """A GradientHealth fed the given per-parameter gradient norms, one optimizer step per entry."""
    from varlen_workbench.workbench.instruments.health import GradientHealth

    model = torch.nn.Module()
    for name in norms:
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(1)))
    monitor = GradientHealth(model)
    for step in range(len(next(iter(norms.values())))):
        for name, values in norms.items():
            getattr(model, name).grad = torch.tensor([values[step]])
            monitor._on_grad(getattr(model, name))
        monitor.step(0.0)
    monitor.close()
    return monitor


def test_training_summary_and_deviation():
    nan = float("nan")
    runs = {
        pm.TRAIN_VARIANTS[0]: _fake_monitor({"a": [nan, nan], "b": [nan, nan]}),
        pm.TRAIN_VARIANTS[1]: _fake_monitor({"a": [nan, nan], "b": [1.0, nan]}),
        pm.TRAIN_VARIANTS[2]: _fake_monitor({"a": [1.0, 1.5], "b": [2.0, 2.0]}),
        pm.TRAIN_VARIANTS[3]: _fake_monitor({"a": [1.0, 1.0], "b": [2.0, 2.0]}),
    }
    summary = pm.training_summary(runs)
    assert summary[pm.TRAIN_VARIANTS[0]]["nonfinite_at_step0"] == 2 and summary[pm.TRAIN_VARIANTS[1]]["nonfinite_at_step0"] == 1
    assert summary[pm.TRAIN_VARIANTS[2]]["first_nonfinite_step"] is None
    assert pm.training_deviation(runs) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="pad"):
        pm.train_health(pm.TRAIN_SEQLEN)


def _broken_results():
    empty = pm.upstream_run(pm.MaskCase("t", "none", seqlen=16, head_dim=16, dtype="float16"))
    empty.tensors = {n: torch.full_like(t, float("nan")) for n, t in empty.tensors.items()}
    return pm.Results(
        device=None,
        upstream_version="1.2.2",
        upstream_dtype="float16",
        call_errors={"the report's snippet as written": "no error", "softmax_scale, attn_bias=None": "no error"},
        upstream={c.name: empty for c in pm.UPSTREAM_CASES},
        seed_poisoned=empty,
        sweep=SweepResult(axes={"density": [0.1]}, records=[{"density": 0.1, "seqlen": 64, "ok": False}]),
        coverage=[pm.Coverage("x", False, True)],
        replica={},
        nan_do={},
        nan_do_oracle_nonfinite={},
        isfinite_error="no error",
        isfinite_in_triton=True,
        ours=None,
        training={"pad": 24, "variants": {}, "deviation": 0.0},
        successor_import="ok",
        gpu=None,
    )


def test_claims_fail_on_results_that_do_not_support_them():
    verdicts = pm.claims.check(_broken_results())
    assert len(verdicts) == len(pm.claims) >= 15 and not any(v.holds for v in verdicts)
    gpu = [v for v in verdicts if v.level.kind == "upstream-gpu"]
    assert len(gpu) == 3 and all("no GPU record" in v.evidence for v in gpu)


def test_tables_are_tables():
    record = {
        "probes": {
            "cases": {
                "ok case": {
                    "ok": True,
                    "nonfinite": dict.fromkeys(pm.UPSTREAM_TENSORS, 0),
                    "numel": dict.fromkeys(pm.UPSTREAM_TENSORS, 8),
                    "error_over_bound": {"out": 0.5},
                },
                "failed case": {"ok": False, "error": "RuntimeError: boom"},
            }
        }
    }
    shown = pm.gpu_table(record)
    assert isinstance(shown, Table) and shown.rows[0][-1] == "0.50" and shown.rows[1][1] == "RuntimeError: boom"
    assert pm.ratio_text(float("nan")) == "NaN"
    assert (
        pm.worst_ratio([0.1, float("nan"), 0.2]) != pm.worst_ratio([0.1, float("nan"), 0.2]) and pm.worst_ratio([0.1, 0.3]) == 0.3
    )


def test_meta_and_module_shape():
    assert pm.META.id == "flash-dmattn-121" and isinstance(pm.claims, Claims)
    assert pm.SEED.seqlen == 256 and pm.SEED.head_dim == 64 and pm.SEED.causal and pm.SEED.pattern == "none"
    assert pm.META.reported == "2025-08-24" and pm.META.timeline[0].kind == "issue"
    assert {e.kind for e in pm.claims.levels} >= {"upstream-cpu", "upstream-gpu", "replica", "ours", "toy"}
    assert not hasattr(pm, "_table") and not hasattr(pm, "_figure")


def test_report_claims_table_reads_this_run_and_says_when_the_gpu_record_is_missing():
    shown = pm.report_claims_table(_broken_results())
    assert isinstance(shown, Table) and len(shown.rows) == 5 and shown.header[1] == "flash-dmattn 1.2.2"
    assert "no GPU record" in shown.rows[1][1] and shown.rows[1][2] == "no GPU record"
    assert shown.rows[3][1] == "not shown"  # the broken coverage does not support "changes no bit"


def test_gpu_probes_run_in_order_and_record_a_failing_probe(monkeypatch):
    gpu = importlib.import_module("varlen_workbench.postmortems.flash_dmattn_121.gpu")  # where gpu_probes looks its probes up
    monkeypatch.setattr(gpu, "upstream_call_errors", lambda device: {"x": "TypeError"})
    monkeypatch.setattr(gpu, "upstream_cases", lambda dtype: ())
    monkeypatch.setattr(gpu, "_seed_runs", lambda device: {"plain": {"runs": 0}})
    monkeypatch.setattr(gpu, "successor_probe", lambda device: {"installed": False})
    monkeypatch.setattr(gpu, "speed_vs_upstream", lambda device: 1 / 0)
    found = pm.gpu_probes("cuda")
    assert [k for k in found if k not in ("upstream_version", "dtype", "seconds")] == [
        "call_errors",
        "cases",
        "seed_config_seeds",
        "successor",
        "speed",
    ]
    assert found["call_errors"] == {"ok": True, "x": "TypeError"} and found["successor"]["ok"]
    assert found["speed"] == {"ok": False, "error": "ZeroDivisionError: division by zero"}
