"""Post-mortem fa4-unwritten-padding: the workaround's row mask, the FA4-shaped replica, and claims
that fail when the records say otherwise."""

import copy

import pytest
import torch

from varlen_workbench.postmortems import fa4_unwritten_padding as pm
from varlen_workbench.workbench.layout import Region, region_labels


@pytest.fixture(scope="module")
def results():
    return pm.reproduce()


@pytest.mark.parametrize(
    ("starts", "used", "rows"),
    [
        ([0, 4, 8, 13], [3, 2, 4], 15),  # the contract's example: GAP rows in every slot, 2 TAIL rows
        ([0, 3, 3, 7], None, 9),  # an empty sequence, no seqused, TAIL rows
        ([0, 5, 8], [0, 3], 8),  # a sequence that uses none of its slot
    ],
)
def test_real_rows_is_the_contract_layout(starts, used, rows):
    """FA4's layout (cu_seqlens = slot starts, seqused = real lengths) read as the contract's REAL rows."""
    cu_padded = torch.tensor(starts, dtype=torch.int32)
    lengths = cu_padded.diff() if used is None else torch.tensor(used, dtype=torch.int32)
    cu_real = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    seqused = None if used is None else lengths
    expected = region_labels(cu_real, cu_padded, rows) == Region.REAL
    assert torch.equal(pm.real_rows(cu_padded, rows, seqused).flatten(), expected)


def test_the_replica_takes_fa4s_call_seqused_included():
    """FA4's call shape over the replica: slot starts as cu_seqlens, real lengths as seqused; the rows of a
    slot past seqused (GAP) and past the last slot (TAIL) come back unwritten, as FA4 leaves them, and lse
    comes back only when asked for. qv (MLA) is refused."""
    from varlen_workbench.workbench.instruments.poison import poisoned_memory
    from varlen_workbench.workbench.layout import pack

    b = pack(pm.TAIL.with_(seqlens_q=(5, 3), padded_q=(8, 4), padded_k=(8, 4), tail_q=2, tail_k=2))
    kwargs = dict(
        cu_seqlens_q=b.cu_seqlens_q_padded, cu_seqlens_k=b.cu_seqlens_k_padded, max_seqlen_q=b.max_seqlen_q,
        max_seqlen_k=b.max_seqlen_k, seqused_q=b.cu_seqlens_q.diff(), seqused_k=b.cu_seqlens_k.diff(),
    )  # fmt: skip
    with poisoned_memory():
        out, lse = pm.replica_flash_attn_varlen_func(b.q, b.k, b.v, **kwargs)
        _, with_lse = pm.replica_flash_attn_varlen_func(b.q, b.k, b.v, **kwargs, return_lse=True)
    real = b.regions_q == Region.REAL
    assert lse is None and with_lse is not None and with_lse.shape == (b.q.shape[1], b.q.shape[0])
    assert out[real].isfinite().all() and out[~real].isnan().all()
    with pytest.raises(ValueError, match="qv"):
        pm.replica_flash_attn_varlen_func(b.q, b.k, b.v, qv=b.q, **kwargs)


def test_every_claim_holds(results):
    assert all(v.holds for v in pm.claims.check(results))


def test_the_audit_claim_fails_when_a_real_row_goes_non_finite(results):
    changed = copy.deepcopy(results)
    tail = next(c for c in changed.audit["checks"] if c["name"] == "tail-rows")
    tail["evidence"] += "; out: 4 non-finite values in 1 REAL rows"
    assert not pm.claims.verdict(changed, "On the H200").holds


def test_the_training_claim_fails_when_fa4s_gradients_are_finite(results):
    changed = copy.deepcopy(results)
    for run in changed.real_client["runs"]:
        run["nonfinite"] = 0
    assert not pm.claims.verdict(changed, "In a real transformers training step").holds


def test_the_workaround_claim_fails_without_the_workaround(results):
    changed = copy.deepcopy(results)
    changed.workaround = {case: results.replica[pm.TAIL] for case in pm.CASES}
    assert not pm.claims.verdict(changed, "The workaround").holds


def test_a_claim_is_named_by_one_unambiguous_prefix(results):
    with pytest.raises(KeyError, match=r"[2-9] claims start with"):
        pm.claims.verdict(results, "")
    with pytest.raises(KeyError, match="0 claims start with"):
        pm.claims.verdict(results, "no claim says this")


def _named(check: str) -> str:
    return check.replace("fuzz:", "fuzzer: ")


def test_the_pages_pass_fail_sentence_lists_every_fail_of_its_record(results):
    """The page once said 'four checks fail ... every check of REAL rows passes' while its record held
    eight FAILs, padding-leak's 1,536 non-finite REAL values among them: the sentence is read off the
    record, names each of its FAILs and passes, and the executed page shows that sentence."""
    import json

    from varlen_workbench.workbench.provenance import REPO

    text = pm.audit_summary(results)
    failed = results.audit["failed"]
    assert len(failed) == 8 and {"padding-leak", "fuzz:real-accuracy"} <= set(failed)
    for check in failed:
        assert _named(check) in text, check
    passing = [c["name"] for c in results.audit["checks"] if c["verdict"] == "pass"]
    assert f"* **Pass:** {', '.join(passing)}." in text
    real = text.split("\n")[2]
    assert real.startswith("* **padding-leak, fuzzer: real-accuracy**: on REAL rows; only with NaN planted in the padding")
    nb = json.loads((REPO / "notebooks" / "fa4-unwritten-padding.ipynb").read_text())
    shown = [
        "".join(o["data"]["text/markdown"])
        for c in nb["cells"]
        if c["cell_type"] == "code" and "pm.audit_summary(results)" in "".join(c["source"])
        for o in c["outputs"]
        if "text/markdown" in o.get("data", {})
    ]
    assert shown == [text], "the executed page shows the sentence the record gives: re-execute the notebook"
    prose = " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "four checks fail" not in prose and "every check of REAL rows passes" not in prose


def test_a_new_fail_in_the_record_reaches_the_sentence_and_breaks_the_claim(results):
    changed = copy.deepcopy(results)
    gqa = next(c for c in changed.audit["checks"] if c["name"] == "gqa")
    gqa.update(verdict="FAIL", evidence="q=[5, 3] H=4 D=64 bfloat16 (zeros padding): out: error 3 > bound 0.01")
    text = pm.audit_summary(changed)
    assert "* **gqa**: not judged yet." in text and "gqa" not in text.split("* **Pass:**")[1]
    assert not pm.claims.verdict(changed, "On the H200").holds
