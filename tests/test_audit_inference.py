"""Adapters inferred from a varlen function's parameter names (workbench.audit.adapters.varlen).

Fakes with the exact signatures of FlashAttention-4's flash_attn.cute.flash_attn_varlen_func
(4.0.0b36: `qv` fourth, windows with None for unbounded, seqused_q/k, (out, lse) on request) and
of a user's own function, computed by the fp64 oracle; the real signatures of torch's
varlen_attn, our kernel and our cuDNN-ragged function.
"""

from __future__ import annotations

import pytest
import torch
from test_audit import oracle

import kernels
from workbench.audit import Verdict, adapt, audit, detect
from workbench.audit.adapters import REGISTER_EXAMPLE
from workbench.audit.adapters.cudnn_ragged import cudnn_ragged_attention
from workbench.audit.adapters.varlen import infer
from workbench.audit.checks import Finding
from workbench.audit.snippets import torch_snippet
from workbench.layout import Case

FA4_CALLS: list[dict] = []


def flash_attn_varlen_func(
    q,
    k,
    v,
    qv=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    learnable_sink=None,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    score_mod=None,
    aux_tensors=None,
    return_lse=False,
):
    """FA4's signature; sequence i's real rows are [cu_seqlens[i], cu_seqlens[i] + seqused[i]) when
    seqused is given; None in window_size is unbounded (a -1 would be a bound)."""
    assert qv is None and page_table is None, "nothing after v may go by position: qv is fourth"
    assert all(w is None or w >= 0 for w in window_size), f"FA4 says unbounded with None, got {window_size}"
    FA4_CALLS.append({"seqused": seqused_q is not None, "window": window_size})

    def layout(cu, used):
        if used is None:
            return cu, None
        return torch.cat([used.new_zeros(1), used.cumsum(0)]).to(torch.int32), cu

    cu_q, padded_q = layout(cu_seqlens_q, seqused_q)
    cu_k, padded_k = layout(cu_seqlens_k, seqused_k)
    out = oracle(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_seqlen_q,
        max_seqlen_k,
        cu_seqlens_q_padded=padded_q,
        cu_seqlens_k_padded=padded_k,
        causal=causal,
        scale=softmax_scale,
        window_size=tuple(-1 if w is None else w for w in window_size),
    )
    return (out, torch.zeros(q.shape[1], q.shape[0])) if return_lse else out


def users_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=None):
    """A user's own varlen function: no padded layout, no window."""
    return oracle(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale)


def test_fa4_is_called_by_name_and_its_seqused_expresses_gap_rows():
    FA4_CALLS.clear()
    assert detect(flash_attn_varlen_func).name == "contract"  # a fake: the library's own is adapter fa4
    report = audit(flash_attn_varlen_func, budget=4, skip=["determinism"])
    assert report.passed, str(report)
    verdicts = report.verdicts()
    assert verdicts["gap-rows"] == verdicts["sliding-window"] == verdicts["tail-rows"] == "pass", report.table()
    assert any(c["seqused"] for c in FA4_CALLS), "the padded layout went as seqused"
    assert (None, None) in [c["window"] for c in FA4_CALLS] and (2, 1) in [c["window"] for c in FA4_CALLS]


def test_the_library_adapters_add_what_no_signature_says():
    def fa4(
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        seqused_q=None,
        seqused_k=None,
    ):
        raise AssertionError("not called")

    fa4.__module__ = "flash_attn.cute.interface"
    impl = adapt(fa4, device="cpu")
    assert impl.adapter.name == "fa4" and impl.adapter.dtypes == ("float16", "bfloat16")
    assert "CUDA only" in impl.why_not() and "padded" not in impl.lacks  # seqused_q and seqused_k: GAP rows expressible
    assert "takes no softmax_scale or scale" in impl.lacks["scale"] and "no window" in impl.lacks["window"]


def test_a_users_own_function_needs_no_adapter_and_what_it_lacks_is_na_with_the_reason():
    report = audit(
        users_attention, budget=3, checks=["real-accuracy", "gap-rows", "sliding-window", "causal-unequal", "custom-scale"]
    )
    assert report.adapter == "contract" and report.passed, str(report)
    assert report.verdicts() == {
        "real-accuracy": "pass",
        "gap-rows": "n/a",
        "sliding-window": "n/a",
        "causal-unequal": "pass",
        "custom-scale": "pass",
    }
    assert "users_attention has no padded layout" in report.result("gap-rows").evidence
    assert "users_attention takes no window_size" in report.result("sliding-window").evidence


def test_calls_use_keywords_where_the_signature_allows():
    seen = {}

    def keyword_only(
        query, key, value, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False, softmax_scale=None
    ):
        seen.update(causal=is_causal, scale=softmax_scale)
        return oracle(
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=is_causal, scale=softmax_scale
        )

    report = audit(keyword_only, budget=0, checks=["real-accuracy", "custom-scale"])
    assert report.verdicts() == {"real-accuracy": "pass", "custom-scale": "pass"}, report.table()
    assert seen["scale"] is not None and isinstance(seen["causal"], bool)


def test_real_signatures_are_read_by_name():
    from torch.nn.attention.varlen import varlen_attn

    torch_names = infer(varlen_attn).names
    assert (torch_names["cu_seqlens_q"], torch_names["max_seqlen_k"], torch_names["scale"]) == ("cu_seq_q", "max_k", "scale")
    assert "causal" not in torch_names or torch_names["causal"] == "is_causal"  # 2.11+: causal is a (-1, 0) window
    assert "padded" in infer(varlen_attn).lacks() or "is_causal" in torch_names
    ours = infer(kernels.varlen_attention)
    assert ours.layout("q") == ours.layout("k") == "padded" and ours.lacks() == {} and ours.window_unbounded == -1
    cudnn = infer(cudnn_ragged_attention)
    assert cudnn.names["scale"] == "softmax_scale" and cudnn.lacks() == {}
    assert detect(cudnn_ragged_attention).name == "cudnn-ragged"
    assert adapt(cudnn_ragged_attention, device="cpu").why_not().startswith("cuDNN's fused attention")
    fa4 = infer(flash_attn_varlen_func)
    assert fa4.window_unbounded is None and fa4.layout("q") == "seqused"


def test_the_seqused_call_and_its_snippet_agree():
    """With a padded layout, cu_seqlens becomes the layout and seqused the real lengths; the
    plain-torch snippet spells the same call, runs, and shows no damaged row."""
    fa4 = infer(flash_attn_varlen_func)
    cu, padded = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    q = torch.zeros(9, 2, 16)
    _, kwargs = fa4.arguments(q, q, cu, cu, 3, 3, padded, padded, False, None, (-1, -1))
    assert kwargs["cu_seqlens_q"] is padded and kwargs["seqused_q"].tolist() == [3, 2] and kwargs["window_size"] == (None, None)
    _, plain = fa4.arguments(q, q, cu, cu, 3, 3, None, None, True, 0.5, (3, -1))
    assert plain["cu_seqlens_q"] is cu and "seqused_q" not in plain and plain["window_size"] == (3, None) and plain["causal"]

    impl = adapt(flash_attn_varlen_func)
    case = Case((3, 2), padded_q=(4, 4), padded_k=(5, 3), tail_q=1, heads=2, head_dim=16, window=(1, -1))
    snippet = torch_snippet(impl, case, Finding("gap-rows", "planted"))
    assert "seqused_q=used_q" in snippet and "your function's call" in snippet and "upstream" not in snippet
    printed = []
    exec(compile(snippet, "<snippet>", "exec"), {"print": lambda *a: printed.append(" ".join(map(str, a)))})
    assert printed == [f"{n}: damaged REAL rows [], padding rows not 0 []" for n in ("out", "dq", "dk", "dv")], printed


def test_when_inference_fails_the_error_shows_how_to_register_an_adapter():
    def not_varlen(x, y, z, lengths):
        return x

    with pytest.raises(ValueError) as error:
        detect(not_varlen)
    message = str(error.value)
    assert "cu_seqlens_q: one of cu_seqlens_q, cu_q, cu_seq_q" in message and REGISTER_EXAMPLE in message
    assert len(REGISTER_EXAMPLE.splitlines()) == 10


def test_the_cudnn_ragged_module_imports_without_cudnn_and_says_what_a_call_needs():
    q = torch.zeros(4, 1, 16, dtype=torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="q is on cpu; cuDNN runs on CUDA"):
        cudnn_ragged_attention(q, q, q, cu, cu, 4, 4)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        cudnn_ragged_attention(q.float(), q, q, cu, cu, 4, 4)
    report = audit(cudnn_ragged_attention, device="cpu", budget=0)
    assert not report.ran and {r.verdict for r in report.results} == {Verdict.NA}


def test_the_readme_shows_the_register_example_as_the_code_defines_it():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert REGISTER_EXAMPLE in readme
