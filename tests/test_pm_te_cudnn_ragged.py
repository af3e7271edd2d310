"""te-thd-2892's claim on the real cuDNN kernel (data/gpu/audit-cudnn-ragged.json): it holds on the
committed record and fails when the record or the page's tail-blind run says otherwise."""

import copy
import importlib
import math
from types import SimpleNamespace

import pytest

from varlen_workbench.postmortems import te_thd_2892 as pm
from varlen_workbench.workbench.provenance import GPU_DATA
from varlen_workbench.workbench.records import read_record

CLAIM = "On the H200, cuDNN's ragged SDPA"
CLAIMS_MODULE = importlib.import_module(
    "varlen_workbench.postmortems.te_thd_2892.claims"
)  # the package exports its Claims as `claims`


def _holds(results, record=None, monkeypatch=None) -> bool:
    if record is not None:
        monkeypatch.setattr(CLAIMS_MODULE, "read_record", lambda path: record)
    return next(v for v in pm.claims.check(results) if v.claim.startswith(CLAIM)).holds


def _tail_blind(last_loss: float):
    return SimpleNamespace(training={pm.TRAINING_RUNS[3]: [SimpleNamespace(losses=[2.0, last_loss])]})


@pytest.fixture
def record():
    return copy.deepcopy(read_record(GPU_DATA / "audit-cudnn-ragged.json"))


def test_the_claim_holds_on_the_committed_record():
    assert _holds(_tail_blind(math.nan))


def test_it_fails_when_padding_reaches_real_rows(record, monkeypatch):
    next(c for c in record["checks"] if c["name"] == "padding-leak")["verdict"] = "FAIL"
    assert not _holds(_tail_blind(math.nan), record, monkeypatch)


def test_it_fails_when_the_kernel_writes_its_padding(record, monkeypatch):
    tail = next(c for c in record["checks"] if c["name"] == "tail-rows")
    tail["verdict"], tail["evidence"] = "pass", "padding rows exactly 0"
    assert not _holds(_tail_blind(math.nan), record, monkeypatch)


def test_it_fails_when_the_tail_blind_run_stays_finite():
    assert not _holds(_tail_blind(2.0))
