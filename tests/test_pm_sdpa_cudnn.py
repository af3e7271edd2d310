"""Post-mortem sdpa-cudnn-masked-rows: its layouts, its replica, its GPU probe's code path, and
claims that fail when the facts change."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from varlen_workbench.postmortems import sdpa_cudnn_masked_rows as pm
from varlen_workbench.workbench.layout import Case


@pytest.fixture(scope="module")
def results():
    return pm.reproduce()


@pytest.mark.parametrize(
    ("lengths_q", "lengths_k", "causal", "keyless"),
    [
        ((3, 2), (0, 5), False, [0, 1, 2]),  # an empty key sequence: all its queries
        ((4,), (2,), True, [0, 1]),  # bottom-right causal, len_q > len_k: the first len_q - len_k rows
        ((5, 3), (9, 7), True, []),  # more keys than queries: every row sees one
    ],
)
def test_keyless_rows(lengths_q, lengths_k, causal, keyless):
    assert pm.keyless_rows(Case(lengths_q, seqlens_k=lengths_k, causal=causal)) == keyless


def test_the_replica_differs_from_math_only_on_rows_without_key():
    q, k, v, mask = pm.padded_inputs(pm.UNEQUAL, "cpu")
    replica = pm.cudnn_mask_replica(q.float(), k.float(), v.float(), attn_mask=mask)
    math = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    no_key = ~mask.any(-1).expand(math.shape[:-1])
    assert torch.allclose(replica[~no_key], math[~no_key], atol=1e-3)
    assert (replica[no_key] - math[no_key]).abs().max() > 0.1


def test_the_record_is_read_back_and_a_missing_check_is_named():
    record = pm.audit_record("sdpa-cudnn")
    check = pm.recorded_check(record, "fully-masked-rows")
    assert check["verdict"] == "FAIL" and set(check["errors"]) == set(pm.TENSORS)
    assert check["errors"]["out"][0] == pytest.approx(2.35)
    with pytest.raises(KeyError, match="no check 'no-such-check'"):
        pm.recorded_check(record, "no-such-check")


def test_the_gpu_probe_runs_its_torch_path_on_a_cpu():
    """gpu_probes' points on the CPU: math runs and gives keyless rows 0, cuDNN and efficient are refused."""
    points = pm.probe_points(torch.device("cpu"), {"tiny": ((3, 4), (0, 2))})
    by = {(p["dtype"], p["backend"], p["mask"]): p for p in points}
    math = by[("float16", "MATH", "bool")]
    assert math["keyless_rows"] == 5 and math["keyless_out_max_abs"] == 0.0 and math["deterministic"]
    assert math["vs_unmasked"] > 0.1  # the pad-token padding makes unmasked attention differ from 0
    assert "error" in by[("float16", "CUDNN_ATTENTION", "bool")]
    assert pm.gpu_probes("cpu") == {"skipped": "gpu_probes needs a CUDA device, got 'cpu'"}


def test_every_claim_holds(results):
    failed = [v.claim for v in pm.claims.check(results) if not v.holds]
    assert not failed


def test_the_replica_claim_fails_when_the_record_disagrees(results):
    changed = copy.deepcopy(results.recorded)
    label = pm.FULLY.label()
    error, bound, ratio = changed[label]["sdpa-cudnn"]["errors"]["dv"]
    changed[label]["sdpa-cudnn"]["errors"]["dv"] = (error * 1.1, bound, ratio)
    verdict = pm.claims.verdict(dataclasses.replace(results, recorded=changed), "SDPA given the additive mask")
    assert not verdict.holds


def test_the_math_claim_fails_when_a_keyless_row_is_not_zero(results):
    mechanism = copy.deepcopy(results.mechanism)
    mechanism[pm.UNEQUAL.label()]["math_max_abs"] = 1e-3
    assert not pm.claims.verdict(dataclasses.replace(results, mechanism=mechanism), "torch's math backend").holds


def test_the_audit_matrix_links_the_cudnn_cells_to_this_page():
    """The two sdpa-cudnn FAIL cells this page explains link to it from the matrix, and only they."""
    from varlen_workbench.workbench.audit.judgements import judgements, postmortem_links
    from varlen_workbench.workbench.audit.matrix import fails, load_matrix
    from varlen_workbench.workbench.audit.render import matrix_html
    from varlen_workbench.workbench.registry import Registry

    records = load_matrix()
    mine = {cell for cell, judged in judgements().items() if judged.postmortem == pm.META.id}
    assert mine == {("sdpa-cudnn", "fully-masked-rows"), ("sdpa-cudnn", "causal-unequal")}
    assert mine <= {(row, check) for row, check, _ in fails(records)}
    assert pm.META.id in Registry().ids()
    assert postmortem_links("sdpa-cudnn", "determinism") == [] and postmortem_links("sdpa-math", "fully-masked-rows") == []
    assert matrix_html(records).count(f'<a href="{pm.META.id}.html">{pm.META.id}</a>') == 2


def test_the_gpu_table_shows_a_probe_record():
    points = pm.probe_points(torch.device("cpu"), {"tiny": ((3, 4), (0, 2))})
    shown = str(pm.gpu_table({"probes": {"points": points}}))
    assert shown.count("\ntiny ") == len(points) and "FLASH_ATTENTION" in shown and "No viable backend" in shown


def test_the_default_backend_claim_fails_when_a_call_ran_another_backend(results):
    assert pm.claims.verdict(results, "With no backend asked for").holds
    changed = copy.deepcopy(results.default_backend)
    changed[0]["settings"][0]["backward"] = "EFFICIENT_ATTENTION"
    assert not pm.claims.verdict(dataclasses.replace(results, default_backend=changed), "With no backend asked for").holds
    assert not pm.claims.verdict(dataclasses.replace(results, default_backend=[]), "With no backend asked for").holds


def test_the_gpu_mechanism_claim_fails_when_minus_inf_leaves_a_row_non_zero(results):
    assert pm.claims.verdict(results, "On the H200, SDPA unpinned").holds
    gpu = copy.deepcopy(results.gpu)
    point = next(p for p in gpu["probes"]["points"] if p["mask"] == "float -inf")
    point["keyless_out_max_abs"] = 0.5
    assert not pm.claims.verdict(dataclasses.replace(results, gpu=gpu), "On the H200, SDPA unpinned").holds
