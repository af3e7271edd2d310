"""TransformerEngine's DotProductAttention as rows of the audit matrix (varlen_workbench.workbench.audit.adapters.te), on the CPU.

TE runs on the GPU machine only. Here its stand-in (tests/data/fake_te: DotProductAttention's
constructor and forward keywords, computed by the oracle from what it was built with) takes its
place, so that a factory passing the wrong heads, GQA groups, mask type or scale fails.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from types import SimpleNamespace

import pytest
import torch

from varlen_workbench.workbench.audit import adapt
from varlen_workbench.workbench.audit.adapters import MATRIX, te
from varlen_workbench.workbench.audit.isolate import Spec
from varlen_workbench.workbench.audit.matrix import ROW_PACKAGE, implementation
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.probes import probe
from varlen_workbench.workbench.provenance import REPO

FAKE_TE = REPO / "tests" / "data" / "fake_te"


@pytest.fixture
def stand_in(monkeypatch):
    """transformer_engine as tests/data/fake_te (DotProductAttention's call computed by the oracle
    from the constructor's configuration), imported the way the factory imports TE; the modules it
    builds and the recipes it is run under are recorded."""
    monkeypatch.syspath_prepend(str(FAKE_TE))
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    fake = importlib.import_module("transformer_engine.pytorch")
    built, entered = [], []

    class Recorded(fake.DotProductAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    original = fake.autocast

    def autocast(enabled=True, recipe=None, **kwargs):
        entered.append(recipe)
        return original(enabled=enabled, recipe=recipe, **kwargs)

    monkeypatch.setattr(fake, "DotProductAttention", Recorded)
    monkeypatch.setattr(fake, "autocast", autocast)
    yield SimpleNamespace(built=built, entered=entered)
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


@pytest.mark.parametrize("function", te.TE_FUNCTIONS)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_each_call_builds_its_module_from_the_calls_tensors(stand_in, function, scale):
    case = Case(seqlens_q=(5, 0, 9), padded_q=(8, 2, 12), heads=4, kv_heads=2, head_dim=16, causal=True, tail_q=3, seed=2)
    impl = adapt(function, "te-thd", "cpu")
    record = probe(impl, pack(case, "cpu"), poisoned=True, scale=scale)
    assert record.real_within_bound and record.padding_exactly_zero, record.summary()
    (module,) = stand_in.built  # one module, built for this call
    assert (module.heads, module.channels, module.groups) == (4, 16, 2)
    assert (module.qkv_format, module.attn_mask_type, module.softmax_scale) == ("thd", "padding_causal_bottom_right", scale)
    fp8 = function is te.te_dot_product_attention_fp8
    assert [(type(r).__name__, r.fp8_dpa) for r in stand_in.entered] == ([("DelayedScaling", True)] if fp8 else [])


def test_a_fresh_module_for_every_call(stand_in):
    case = Case(seqlens_q=(3, 4), heads=2, head_dim=8, causal=False)
    impl = adapt(te.te_dot_product_attention, "te-thd", "cpu")
    for _ in range(2):
        pack(case, "cpu").call(impl)
    assert len(stand_in.built) == 2 and stand_in.built[0] is not stand_in.built[1]
    assert stand_in.built[0].attn_mask_type == "padding"


def test_the_fp8_function_takes_the_same_call():
    assert inspect.signature(te.te_dot_product_attention_fp8) == inspect.signature(te.te_dot_product_attention)
    assert "softmax_scale" in inspect.signature(te.te_dot_product_attention_fp8).parameters


def test_te_rows_run_on_cuda_only_and_say_so_elsewhere():
    for function in te.TE_FUNCTIONS:
        assert "TransformerEngine runs on CUDA only" in adapt(function, "te-thd", "cpu").why_not()
        on_gpu = adapt(function, "te-thd", "cuda")
        assert on_gpu.why_not() is None and "scale" not in on_gpu.lacks and "window" in on_gpu.lacks


def test_the_matrix_rows_name_importable_targets_through_the_te_adapter():
    rows = {row: (target, adapter) for row, target, adapter in MATRIX}
    assert rows["te"] == ("varlen_workbench.workbench.audit.adapters.te:te_dot_product_attention", "te-thd")
    assert rows["te-fp8"] == ("varlen_workbench.workbench.audit.adapters.te:te_dot_product_attention_fp8", "te-thd")
    for row in ("te", "te-fp8"):
        impl = adapt(rows[row][0], rows[row][1], "cuda")
        spec = Spec.of(impl)  # what a child process rebuilds the row from
        assert spec.target == rows[row][0] and spec.adapter == "te-thd"
        assert ROW_PACKAGE[row] == "transformer-engine"
        record = {"row": row, "versions": {"transformer-engine": "2.20.2"}, "provenance": {}}
        assert implementation(record) == f"{row} (transformer-engine 2.20.2)"


def test_without_te_a_call_says_how_to_install_it():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed here")
    with pytest.raises(ModuleNotFoundError, match="scripts/te_pack.sh here, scripts/te_install.py on the GPU"):
        te.te_dot_product_attention(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8))


@pytest.mark.gpu
def test_te_itself_passes_the_contract_on_a_padded_gqa_case():
    pytest.importorskip("transformer_engine.pytorch")
    case = Case(seqlens_q=(37, 5, 100), padded_q=(48, 16, 112), heads=4, kv_heads=2, head_dim=64, dtype="bfloat16", causal=True)
    record = probe(adapt(te.te_dot_product_attention, "te-thd", "cuda"), pack(case, "cuda"), poisoned=True)
    assert record.real_finite and record.real_within_bound, record.summary()
