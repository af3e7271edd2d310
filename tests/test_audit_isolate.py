"""One fault costs one cell (issue 22, item 3): checks and fuzz batches in child processes.

Planted around the correct `plain_attention`, on the CPU: a function whose call on a batch with
no real query raises a sticky "CUDA" fault (every later call of its process raises too, as a
lost CUDA context does), one that kills its own process, and one that hangs. Isolated, every
other check still runs and passes, and only the cell of the call that broke says what happened.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from varlen_workbench.workbench.audit import Verdict, audit
from varlen_workbench.workbench.audit.isolate import Spec, Worker
from varlen_workbench.workbench.audit.plain import plain_attention

FAULT = "CUDA error: an illegal memory access was encountered"
_faulted = False  # this process's "context" is lost
CHECKS = ["real-accuracy", "no-real-query", "custom-scale", "gqa"]


def _no_real_query(cu_seqlens_q) -> bool:
    return int(cu_seqlens_q[-1]) == 0


def sticky_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    global _faulted
    if _faulted or _no_real_query(cu_seqlens_q):
        _faulted = True
        raise RuntimeError(FAULT)
    return plain_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def killing_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    if _no_real_query(cu_seqlens_q):
        os.kill(os.getpid(), signal.SIGKILL)
    return plain_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def hanging_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    if _no_real_query(cu_seqlens_q):
        time.sleep(600)
    return plain_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def _cells(report) -> dict[str, tuple[str, str]]:
    return {r.name: (r.verdict.value, r.evidence) for r in report.results}


def test_in_one_process_a_sticky_fault_costs_the_rest_of_the_row():
    # The planted fault is sticky in this process: every check after it fails for its sake.
    report = audit(sticky_attention, "contract", device="cpu", budget=0, checks=CHECKS, isolate=False)
    cells = _cells(report)
    assert cells["real-accuracy"][0] == "pass" and cells["no-real-query"][0] == "FAIL"
    assert cells["custom-scale"][0] == "FAIL" and FAULT in cells["custom-scale"][1], cells


def test_isolated_a_sticky_fault_costs_one_cell():
    report = audit(sticky_attention, "contract", device="cpu", budget=0, checks=CHECKS, isolate=True)
    cells = _cells(report)
    verdict, evidence = cells["no-real-query"]
    assert verdict == "FAIL" and FAULT in evidence and evidence.endswith("(context lost)"), evidence
    others = {name: cell for name, cell in cells.items() if name != "no-real-query"}
    assert all(v == "pass" and "context lost" not in e for v, e in others.values()), others


@pytest.mark.slow
def test_isolated_a_killed_process_or_a_hang_costs_one_cell():
    killed = _cells(audit(killing_attention, "contract", device="cpu", budget=0, checks=CHECKS, isolate=True))
    assert killed["no-real-query"] == ("FAIL", "its process was killed by SIGKILL"), killed
    assert all(v == "pass" for name, (v, _) in killed.items() if name != "no-real-query"), killed
    # 8 s: over 5 times the slowest of these checks on plain attention alone (1.4 s, child start excluded).
    hung = audit(hanging_attention, "contract", device="cpu", budget=0, checks=CHECKS, isolate=True, check_timeout=8)
    assert _cells(hung)["no-real-query"] == ("n/a", "not run: timed out after 8 s (the check's time limit)")
    assert all(r.verdict is Verdict.PASS for r in hung.results if r.name != "no-real-query")


@pytest.mark.slow
def test_isolated_fuzzer_resumes_after_a_sticky_fault():
    # Layouts with no real query fault; the search goes on in a fresh child after each, so
    # every layout is tried and the faults are the only findings.
    report = audit(sticky_attention, "contract", device="cpu", budget=40, checks=["real-accuracy"], isolate=True)
    fuzzed = report.fuzz
    assert fuzzed is not None and fuzzed.tried == 40 and not fuzzed.stopped_early, fuzzed.summary()
    assert {f.check for f in fuzzed.failures} == {"raises-on-valid-layout"}, fuzzed.failures
    (failure,) = fuzzed.failures
    assert sum(failure.case.real_lengths("q")) == 0 and FAULT in failure.evidence


@pytest.mark.slow  # a child killed and a fresh one started: ~4 s; the sticky-fault test keeps isolation in the fast loop
def test_a_worker_restarts_after_its_child_dies():
    from varlen_workbench.workbench.audit import adapt
    from varlen_workbench.workbench.audit.fuzz import run_layout
    from varlen_workbench.workbench.layout import Case

    impl = adapt(killing_attention, "contract", device="cpu")
    with Worker(Spec.of(impl)) as worker:
        crash = worker.call(run_layout, Case((0,), seqlens_k=(2,), tail_q=1))
        assert str(crash) == "was killed by SIGKILL"
        assert worker.call(run_layout, Case((3,))) == []  # a fresh child answers
        assert worker.starts == 2


def test_a_callable_that_cannot_be_imported_is_refused_with_the_fix():
    def local(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        return plain_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)

    with pytest.raises(ValueError, match="isolate=False"):
        audit(local, "contract", device="cpu", budget=0, checks=["gqa"], isolate=True)


def test_cuda_children_are_spawned_not_forked():
    """A forked child cannot use CUDA once its fork server has (seen on the H200): on CUDA every
    child is spawned; on the CPU the fork server keeps replacements fast."""
    spec = dict(
        target="varlen_workbench.workbench.audit.plain:plain_attention", adapter=None, adapter_name="contract", module="workbench"
    )
    assert Worker(Spec(**spec, device="cuda")).method == "spawn"
    assert Worker(Spec(**spec, device="cpu")).method == (
        "forkserver" if os.name == "posix" and os.uname().sysname == "Linux" else "spawn"
    )
