"""Post-mortem torch-varlen-176793: its building blocks, fast. The whole study (reproduce + claims)
runs in the notebook, which nbval re-executes."""

import json
import math

import pytest
import torch

from postmortems import torch_varlen_176793 as pm
from workbench import Case, Fill, pack, poisoned_memory
from workbench.registry import Registry

TINY = Case(seqlens_q=(9, 5), tail_q=2, tail_k=2, heads=1, head_dim=16, dtype="float16", fill=Fill.ZEROS)


def test_registered_with_a_conforming_notebook():
    from workbench.registry import check_notebook

    post_mortem = Registry("postmortems").get("torch-varlen-176793")
    check_notebook(post_mortem)
    assert post_mortem.meta.seed == "000_1019a3997e440af2.txt"
    assert pm.STUDY in pm.CASES and all(c.tail_q == c.tail_k for c in pm.CASES)


def test_seed_inputs_are_two_dimensional_and_unequal():
    problems = pm.seed_input_problems()
    assert problems["dims"] == {"q": 2, "k": 2, "v": 2}
    assert problems["shapes"]["q"] != problems["shapes"]["v"]  # 1024 does not split into 3 equal chunks
    assert problems["contract_error"].startswith("ValueError: q must be 3-D")


@pytest.mark.parametrize("impl, broken", [(pm.replica_varlen_attn, True), (pm.fixed_torch_style, False)])
def test_corrected_repro(impl, broken):
    with poisoned_memory():
        outcome = pm.corrected_repro(impl, seqlens=(9, 5), heads=1, head_dim=16, dtype=torch.float16, trailing=3)
    assert outcome["shapes"]["q"] == (17, 1, 16)
    assert outcome["out_real_nonfinite"] == 0 and outcome["grad_real_nonfinite"] == 0
    assert math.isnan(outcome["loss"]) is broken
    assert (outcome["out_tail_nonfinite"] == 3 * 16, outcome["grad_tail_nonfinite"] == 3 * 48) == (broken, broken)


def test_proposed_check_rejects_trailing_rows_and_needs_the_host():
    batch, no_tail = pack(TINY), pack(TINY.with_(tail_q=0, tail_k=0))
    with pytest.raises(ValueError, match=r"query has 16 tokens but cu_seq_q\[-1\] = 14"):
        pm.proposed_check(batch.q, batch.k, batch.cu_seqlens_q, batch.cu_seqlens_k)
    pm.proposed_check(no_tail.q, no_tail.k, no_tail.cu_seqlens_q, no_tail.cu_seqlens_k)
    compiled = {name: pm.compile_fullgraph(fn, no_tail) for name, fn in pm._subjects(on_gpu=False).items()}
    assert not compiled["replica + proposed check"]["ok"]
    assert compiled["replica (as upstream: no check)"]["ok"] and compiled["fixed kernel, validate=False"]["ok"]


def test_with_proposed_check_keeps_the_signature_the_adapter_reads():
    import inspect

    checked = pm.with_proposed_check(pm.replica_varlen_attn)
    assert "is_causal" in inspect.signature(checked).parameters
    assert pm.torch_style(checked, "checked").name == "checked"


def test_probe_points_record_failures_and_agreement_as_json():
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    impls = {"replica": pm.replica, "fixed": pm.varlen_attention, "broken": broken}
    points = json.loads(json.dumps(list(pm.probe_points(impls, TINY, (0, 2), device="cpu"))))
    assert [p["impl"] for p in points[:4]] == ["replica", "fixed", "broken", "replica vs fixed"]
    assert all(p["error"] == "RuntimeError: boom" for p in points if p["impl"] == "broken")
    poisoned_replica = [p for p in points if p["impl"] == "replica" and p["poisoned"] and p["pad"] == 2][0]
    assert poisoned_replica["nonfinite"]["dq"]["TAIL"] == 2 * 16 and poisoned_replica["real_within_bound"]
    # REAL rows: the replica and the fixed kernel agree (the bug is only in rows nobody writes).
    agreement = [p["real_max_abs_diff"] for p in points if p["impl"] == "replica vs fixed"]
    assert all(max(d.values()) < 1e-2 for d in agreement)
    table = pm.gpu_table({"points": points})
    assert "error: RuntimeError: boom" in table and "32/32/32/32" in table


def test_token_budget_attention_sees_rows_after_the_last_sequence_as_uncovered():
    from workbench.tinylm import SyntheticTask

    batch = SyntheticTask(seed=1).batch((5, 7), tail_align=16)
    q = torch.randn(16, 1, 16)
    with poisoned_memory():
        out = pm.token_budget_attention(
            q, q, q, batch.cu_seqlens, batch.cu_seqlens, 7, 7, cu_seqlens_q_padded=batch.cu_seqlens_padded, causal=True
        )
    assert torch.isnan(out[12:]).all() and torch.isfinite(out[:12]).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_recording_without_cuda_says_why(capsys, tmp_path):
    assert pm.main(["--record", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(RuntimeError, match="CUDA only"):
        pm.upstream()
