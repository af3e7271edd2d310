"""docs/contract.md says what the code does: its error table is what `varlen_attention` raises,
its pictures are what `region_labels` and the oracle's mask give, and its table of what each
row holds is what the kernel returns. Every code reference to the contract points at it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.kernels.varlen.backends import table
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.layout import Case, Fill, Region, pack, region_labels
from varlen_workbench.workbench.malformed import CATALOGUE, PADDED, REAL, ROWS, base_args
from varlen_workbench.workbench.plots import attention_mask

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "contract.md"
sys.path.insert(0, str(ROOT / "docs"))
import contract_errors  # noqa: E402
import contract_pictures  # noqa: E402


def doc() -> str:
    return DOC.read_text()


def block_after(marker: str) -> str:
    """The fenced block following `<!-- marker -->` in the doc."""
    text = doc()
    start = text.index(f"<!-- {marker} -->")
    return text[start:].split("```")[1]


def test_error_table_is_what_the_code_raises():
    text = doc()
    begin, end = text.index(contract_errors.BEGIN), text.index(contract_errors.END) + len(contract_errors.END)
    assert text[begin:end] == contract_errors.table(), (
        "docs/contract.md's error table is stale: run python docs/contract_errors.py"
    )


def backend_table(text: str) -> str:
    """The doc's backend table: the lines between its markers."""
    begin = text.index("<!-- backend-table:begin")
    return text[text.index("\n", begin) + 1 : text.index("<!-- backend-table:end -->")].rstrip("\n")


def test_backend_table_is_the_registrys():
    assert backend_table(doc()) == table(), (
        "docs/contract.md's backend table is stale: paste varlen_workbench.kernels.varlen.backends.table() between its markers"
    )


def test_error_table_covers_the_catalogue_and_names_the_argument():
    rows = contract_errors.rows()
    assert [r.id for r in rows] == [c.id for c in CATALOGUE]
    for row, case in zip(rows, CATALOGUE):
        assert row.exception == case.exception.__name__
        assert re.search(case.message, row.message), (case.id, row.message)
        assert case.names_argument(row.message), (case.id, row.message)
    # validate=False keeps the sync-free checks and drops the value checks
    unchecked = {r.id for r in rows if not r.without_validation}
    assert {"cu-decreasing", "real-longer-than-padded", "max-seqlen-too-small"} <= unchecked
    assert not {"cu-float", "batch-mismatch-q-k", "heads-not-multiple", "scale-nan"} & unchecked


def test_layout_diagram_is_region_labels():
    lines = {line.split()[0]: line.split()[1:] for line in block_after("layout-diagram").splitlines() if line.strip()}
    classes = {"R": Region.REAL, "G": Region.GAP, "T": Region.TAIL}
    drawn = [classes[c] for c in lines["class"]]
    computed = region_labels(torch.tensor(REAL), torch.tensor(PADDED), ROWS).tolist()
    assert drawn == computed
    assert [int(r) for r in lines["row"]] == list(range(ROWS))
    assert f"cu_seqlens_q        = {REAL}" in block_after("layout-diagram")
    call = base_args()
    assert call["q"].shape[0] == ROWS and call["cu_seqlens_q_padded"].tolist() == PADDED


def test_mask_pictures_are_the_oracles_mask():
    """Every picture is what docs/contract_pictures.py draws from the oracle, and the rule the doc
    states (bottom-right: causal j <= i + off, window i + off - left <= j <= i + off + right,
    off = len_k - len_q, causal bounding the right at 0) gives the same picture."""
    text = doc()
    assert contract_pictures.update(text) == text, "docs/contract.md's pictures are stale: run python docs/contract_pictures.py"
    drawn_kinds = set()
    for marker in contract_pictures.MARKER.finditer(text):
        len_q, len_k, causal, (left, right) = contract_pictures.parse(marker)
        block = text[marker.end() :].split("```")[1]
        rows = [line.split()[2:] for line in block.splitlines() if "query" in line]
        drawn = torch.tensor([[c == "x" for c in row] for row in rows])
        i, j = torch.arange(len_q)[:, None] + (len_k - len_q), torch.arange(len_k)[None, :]
        right = 0 if causal else right
        rule = torch.ones(len_q, len_k, dtype=torch.bool)
        rule &= j <= i + right if right >= 0 else rule
        rule &= j >= i - left if left >= 0 else rule
        assert torch.equal(drawn, rule), marker.group(0)
        drawn_kinds.add((causal, (left, right) == (0, 0), len_q > len_k, len_q < len_k))
    # causal both ways round, a zero-width window with len_q > len_k, an asymmetric one with len_q < len_k
    assert {(True, False, False, True), (True, False, True, False), (False, True, True, False)} <= drawn_kinds


@pytest.mark.parametrize("backend", ["triton", "torch"])  # the contract, whichever backend computes
def test_what_each_row_holds(backend):
    """The doc's table, on a layout with every kind of row: GAP and TAIL rows holding NaN, a
    causal sequence with queries that see no key, an empty key sequence, and a sequence whose
    real keys no query sees; outputs and gradients in NaN-poisoned memory."""
    case = Case(
        seqlens_q=(3, 5, 2, 0),
        seqlens_k=(3, 3, 0, 2),
        padded_q=(4, 6, 2, 1),
        padded_k=(4, 3, 1, 2),
        tail_q=2,
        tail_k=1,
        causal=True,
        heads=2,
        head_dim=16,
        fill=Fill.NAN,
    )
    batch = pack(case)  # the kernels' device: the interpreter on CPU, natively on CUDA
    with poisoned_memory(cuda_prefill_mb=64):
        out, lse = varlen_attention(*batch.args(), **batch.kwargs(), return_lse=True, backend=backend)
        (out.sum() + lse[lse.isfinite()].sum()).backward()
    out, lse = out.detach().cpu(), lse.detach().cpu()
    q, k = batch.q.detach().cpu(), batch.k.detach().cpu()
    dq, dk, dv = (t.grad.cpu() for t in (batch.q, batch.k, batch.v))
    regions_q, regions_k = batch.regions("q"), batch.regions("k")
    sees = attention_mask(batch).any(dim=1)  # which query rows see a key
    real_q, blind_q = (regions_q == Region.REAL) & sees, (regions_q == Region.REAL) & ~sees
    assert blind_q.sum() == 2 + 2  # two causal queries of sequence 1, both of sequence 2
    padding_q = regions_q != Region.REAL
    zero_rows = lambda t, rows: bool((t[rows] == 0).all())
    assert zero_rows(out, blind_q | padding_q) and zero_rows(dq, blind_q | padding_q)
    assert bool(torch.isneginf(lse[:, blind_q | padding_q]).all())
    assert bool(out[real_q].isfinite().all() and lse[:, real_q].isfinite().all() and dq[real_q].isfinite().all())
    seen_k = attention_mask(batch).any(dim=0)
    padding_k, unseen_k = regions_k != Region.REAL, (regions_k == Region.REAL) & ~seen_k
    assert unseen_k.sum() == 2  # the last sequence's keys: it has no query
    for grad in (dk, dv):
        assert zero_rows(grad, padding_k | unseen_k) and bool(grad[~(padding_k | unseen_k)].isfinite().all())
    # lse: the natural log of the sum of exp(scale * q.k) over the visible keys
    scale = case.head_dim**-0.5
    row, start_k = int(batch.cu_seqlens_q_padded[0]), int(batch.cu_seqlens_k_padded[0])
    scores = scale * q[row, 0].double() @ k[start_k : start_k + 1, 0].double().T  # query 0 sees key 0 only
    assert torch.allclose(lse[0, row].double(), torch.logsumexp(scores, 0), atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])  # the contract, whichever backend computes
def test_what_each_row_holds_under_a_window(backend):
    """The Windows section, on each backend: REAL query rows whose window holds no key (len_q > len_k
    under a zero-width window, an empty key side) give out 0, lse -inf, dq 0; keys no window
    reaches give dk = dv = 0; GAP and TAIL rows stay exactly 0; NaN padding and poisoned memory."""
    case = Case(
        seqlens_q=(5, 4, 2),
        seqlens_k=(3, 6, 0),
        padded_q=(6, 4, 3),
        padded_k=(4, 7, 1),
        tail_q=2,
        tail_k=1,
        heads=2,
        head_dim=16,
        fill=Fill.NAN,
        window=(0, 0),
    )
    batch = pack(case)
    with poisoned_memory(cuda_prefill_mb=64):
        out, lse = batch.call(varlen_attention, return_lse=True, backend=backend)
        (out.sum() + lse[lse.isfinite()].sum()).backward()
    out, lse = out.detach().cpu(), lse.detach().cpu()
    dq, dk, dv = (t.grad.cpu() for t in (batch.q, batch.k, batch.v))
    regions_q, regions_k = batch.regions("q"), batch.regions("k")
    mask = attention_mask(batch)
    assert torch.equal(mask[:5, :3], contract_pictures.mask(5, 3, window=(0, 0)))  # the doc's third window picture
    sees = mask.any(dim=1)
    blind_q = (regions_q == Region.REAL) & ~sees
    # sequence 0: queries 0, 1 (diagonal j = i - 2); sequence 1: none (j = i + 2); sequence 2: both (no key)
    assert blind_q.nonzero().flatten().tolist() == [0, 1, 10, 11]
    padding_q, real_q = regions_q != Region.REAL, (regions_q == Region.REAL) & sees
    for t in (out, dq):
        assert bool((t[blind_q | padding_q] == 0).all()) and bool(t[real_q].isfinite().all())
    assert bool(torch.isneginf(lse[:, blind_q | padding_q]).all()) and bool(lse[:, real_q].isfinite().all())
    seen_k = mask.any(dim=0)
    unseen_k = (regions_k == Region.REAL) & ~seen_k
    assert unseen_k.nonzero().flatten().tolist() == [4, 5]  # sequence 1's keys 0, 1: no diagonal reaches them
    for grad in (dk, dv):
        zero = (regions_k != Region.REAL) | unseen_k
        assert bool((grad[zero] == 0).all()) and bool(grad[~zero].isfinite().all())
    # out of a row with one visible key is that key's value (softmax over one score is 1)
    v = batch.v.detach().cpu()
    assert torch.allclose(out[2], v[0], atol=1e-6)  # sequence 0's query 2 sees key 0


def test_code_references_point_to_the_document():
    """No code cites the DESIGN.md that is not in the repository; the README links the doc."""
    stale = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("kernels", "workbench", "postmortems")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "DESIGN.md" in line or "(DESIGN:" in line
    ]
    assert not stale, f"cite docs/contract.md instead: {stale}"
    assert "docs/contract.md" in (ROOT / "README.md").read_text()
    assert "docs/contract.md" in (ROOT / "kernels" / "contract.py").read_text()
