"""`backend="auto"`'s rule (kernels/varlen/backends/fa4.py) against the committed benchmark record: on
every workload where both backends ran, the one the rule picks is within 3% of the faster one,
judged on the medians, or on the fastest calls where the workload's own spread (a backend's
median over its fastest call) exceeds 3%."""

from __future__ import annotations

import pytest
import torch

from varlen_workbench.kernels import varlen
from varlen_workbench.kernels.runtime import use_interpreter
from varlen_workbench.kernels.varlen import backends
from varlen_workbench.kernels.varlen.backends.fa4 import fa4_is_faster_for
from varlen_workbench.kernels.varlen.backends.torch import per_document_attention
from varlen_workbench.workbench.bench.kernel_record import GUARDED_FA4, RECORD_COMMAND
from varlen_workbench.workbench.bench.workloads import workloads
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.records import load_records

TOLERANCE = 0.03


def _pairs() -> dict[str, tuple[dict, dict]]:
    """workload name -> (the Triton kernel's row, the guarded FA4 path's row), across the records."""
    rows: dict[str, dict[str, dict]] = {}
    for record in load_records("bench-h200*.json", how=RECORD_COMMAND):
        for row in record["rows"]:
            if row.get("forward_backward_ms") is not None:
                rows.setdefault(row["workload"], {})[row["impl"]] = row
    return {name: (impls["ours"], impls[GUARDED_FA4]) for name, impls in rows.items() if "ours" in impls and GUARDED_FA4 in impls}


def _picks_fa4(name: str) -> bool:
    (workload,) = [w for w in workloads() if w.name == name]
    case = workload.case
    real = case.real_lengths("q")
    gaps = any(p != r for side in "qk" for p, r in zip(case.padded_lengths(side), case.real_lengths(side)))
    return fa4_is_faster_for(case.heads // (case.kv_heads or case.heads), max(real), sum(real) / len(real), gaps)


PAIRS = _pairs()


def test_the_record_has_the_workloads_the_rule_was_read_from():
    assert len(PAIRS) >= 16, sorted(PAIRS)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_the_rule_picks_within_3_percent_of_the_faster_backend(name):
    triton, fa4 = PAIRS[name]
    spread = max(row["forward_backward_ms"] / row["forward_backward_min_ms"] - 1 for row in (triton, fa4))
    key = "forward_backward_min_ms" if spread > TOLERANCE else "forward_backward_ms"
    picked, other = (fa4, triton) if _picks_fa4(name) else (triton, fa4)
    assert picked[key] <= (1 + TOLERANCE) * other[key], (name, key, picked["impl"], picked[key], other[key])


# -- the registry ---------------------------------------------------------------------------


class Toy:
    """A backend as a contributor adds one: it takes nothing but the CPU, and computes with the torch backend."""

    name = "toy"
    label = "toy backend"
    summary = "a test's stand-in"
    takes = "CPU tensors only"
    dtypes = (torch.float32,)

    def unavailable(self, device):
        return None if device.type == "cpu" else "the toy runs on the CPU only"

    def cannot_take(self, call):
        return self.unavailable(call.q.device)

    def preference(self, call):
        return -1  # never "auto"'s pick

    def run(self, call):
        return per_document_attention(call)


def test_a_registered_backend_shows_up_everywhere_the_registry_is_read():
    from varlen_workbench.workbench.audit.adapters import ADAPTERS
    from varlen_workbench.workbench.audit.adapters.varlen import register_backend_adapters
    from varlen_workbench.workbench.bench.kernels import implementations

    backends.register(Toy())
    try:
        assert "toy" in backends.names()
        assert "ours-toy" in register_backend_adapters() and ADAPTERS["ours-toy"].dtypes == ("float32",)
        assert "ours backend=toy (toy backend)" in implementations()
        assert "| `toy` | a test's stand-in | CPU tensors only |" in backends.table().splitlines()
        batch = pack(Case((3, 5), tail_q=2, heads=2, head_dim=16, causal=True))
        toy = batch.call(varlen.varlen_attention_toy)  # the pinned callable the audit's adapter detects
        assert torch.equal(toy, batch.call(varlen.varlen_attention, backend="torch"))
        assert ADAPTERS["ours-toy"].detect(varlen.varlen_attention_toy, set())
    finally:
        backends.unregister("toy")
        ADAPTERS.pop("ours-toy", None)
    assert "toy" not in backends.names() and "ours backend=toy (toy backend)" not in implementations()


def test_a_named_backend_that_cannot_take_the_call_says_why():
    batch = pack(Case((3, 5), heads=2, head_dim=16))
    with pytest.raises(ValueError, match=r"backend = 'nope' is not one of 'auto', 'triton', 'fa4', 'torch'"):
        batch.call(varlen.varlen_attention, backend="nope")
    with pytest.raises(ValueError, match=r'backend="fa4" cannot run this call: .+\. Pass backend="auto"'):
        batch.call(varlen.varlen_attention, backend="fa4")


def test_auto_on_the_cpu_is_the_torch_backend_unless_the_interpreter_is_asked_for():
    batch = pack(Case((3, 0, 5), seqlens_k=(4, 2, 0), padded_q=(4, 2, 7), tail_q=2, heads=4, kv_heads=2, head_dim=16))
    call = backends.Call(batch.q, batch.k, batch.v, batch.step_metadata(validate=True), False, 0.25, -1, -1, False, True)
    assert backends.choose("auto", call).name == "torch"
    with use_interpreter():
        assert backends.choose("auto", call).name == "triton"
    assert backends.choose("auto", call._replace(eager=False)).name == "triton"  # traced: the custom op
    assert torch.equal(batch.call(varlen.varlen_attention), batch.call(varlen.varlen_attention, backend="torch"))


def test_the_real_client_page_says_which_backend_ours_ran_on():
    from varlen_workbench.workbench.instruments.realclient import ours_backend

    assert ours_backend("cpu") == "torch"  # the page's default run: what a user's CPU run gets
    with use_interpreter():
        assert ours_backend("cpu") == "triton"


def test_a_cpu_audit_of_ours_says_which_backend_it_audited():
    from varlen_workbench.workbench.audit import audit
    from varlen_workbench.workbench.audit.adapters.varlen import audited_backend
    from varlen_workbench.workbench.audit.matrix import implementation

    report = audit("varlen_workbench.kernels.varlen:varlen_attention", device="cpu", budget=0, checks=["tail-rows"])
    assert report.passed and report.backend == "auto: torch" and report.to_dict()["backend"] == "auto: torch"
    assert report.render().startswith(
        "audit of varlen_workbench.kernels.varlen:varlen_attention (adapter ours, backend auto: torch, cpu,"
    )
    record = {**report.to_dict(), "row": "ours"}
    assert implementation(record).endswith(", backend auto: torch)")
    cpu = torch.device("cpu")
    with use_interpreter():
        assert audited_backend("ours", cpu, "float32", 32) == "auto: triton"
    assert audited_backend("ours-triton", cpu, "float32", 32) == "triton"
    assert audited_backend("contract", cpu, "float32", 32) == ""
