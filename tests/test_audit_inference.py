"""Adapters inferred from a varlen function's parameter names (varlen_workbench.workbench.audit.adapters.varlen).

Fakes with the exact signatures of FlashAttention-4's flash_attn.cute.flash_attn_varlen_func
(4.0.0b36: `qv` fourth, windows with None for unbounded, seqused_q/k, (out, lse) on request) and
of a user's own function, computed by the fp64 oracle; the real signatures of torch's
varlen_attn, our kernel and our cuDNN-ragged function.
"""

from __future__ import annotations

import pytest
import torch
from test_audit import oracle

from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.workbench.audit import Verdict, adapt, audit, detect
from varlen_workbench.workbench.audit.adapters import REGISTER_EXAMPLE, AdapterRefused
from varlen_workbench.workbench.audit.adapters.cudnn_ragged import cudnn_ragged_attention
from varlen_workbench.workbench.audit.adapters.varlen import infer
from varlen_workbench.workbench.audit.checks import Finding
from varlen_workbench.workbench.audit.snippets import torch_snippet
from varlen_workbench.workbench.layout import Case
from varlen_workbench.workbench.reference import reference_attention

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
    out, lse = reference_attention(
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
        return_lse=True,
        compute_dtype=q.dtype,
        validate=False,
    )
    return (out, lse.float()) if return_lse else out


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
    ours = infer(varlen_attention)
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


# -- self-attention: one set of boundaries for q and k ----------------------------------------------


def self_attn(q, k, v, cu_seqlens, max_seqlen, causal=False, softmax_scale=None):
    """Training code's self-attention: one cu_seqlens and one max_seqlen for q and k."""
    return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal, scale=softmax_scale)


def self_attn_scale_dropped(q, k, v, cu_seqlens, max_seqlen, is_causal=False, scale=None):
    """The same with `scale` taken and never passed on: always 1/sqrt(D)."""
    return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=is_causal)


def self_attn_oracle(q, k, v, cu_seqlens, max_seqlen, causal=False, softmax_scale=None):
    return oracle(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal, scale=softmax_scale)


SELF_ATTENTION_CHECKS = ["real-accuracy", "tail-rows", "custom-scale", "causal-unequal", "fully-masked-rows"]


def test_a_single_boundary_self_attention_is_inferred_and_unequal_layouts_are_na_with_the_reason():
    signature = infer(self_attn)
    assert signature.shared == "cu_seqlens" and signature.names["max_seqlen_k"] == "max_seqlen"
    report = audit(self_attn, budget=2, checks=SELF_ATTENTION_CHECKS)
    assert report.adapter == "contract" and report.passed and report.fuzz.tried == 2, str(report)
    assert report.verdicts() == {
        "real-accuracy": "pass",
        "tail-rows": "pass",
        "custom-scale": "pass",
        "causal-unequal": "n/a",
        "fully-masked-rows": "n/a",
    }, report.table()
    reason = "self_attn takes one cu_seqlens for q and k (self-attention): only layouts with len_q == len_k"
    assert reason in report.result("causal-unequal").evidence, report.table()


def test_a_broken_self_attention_fails_the_check_of_what_it_breaks():
    report = audit(self_attn_scale_dropped, budget=0, checks=SELF_ATTENTION_CHECKS)
    failed = {name for name, verdict in report.verdicts().items() if verdict == "FAIL"}
    assert failed == {"custom-scale"}, report.table()
    assert "scale=0.3" in report.result("custom-scale").evidence


def test_a_self_attention_call_is_refused_when_q_and_k_boundaries_differ_and_its_snippet_names_them_once():
    signature = infer(self_attn_oracle)
    cu, other = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 5], dtype=torch.int32)
    q = torch.zeros(5, 2, 16)
    _, same = signature.arguments(q, q, cu, cu.clone(), 3, 3, None, None, True, 0.5, (-1, -1))
    assert same.pop("cu_seqlens") is cu and same == {"max_seqlen": 3, "causal": True, "softmax_scale": 0.5}
    with pytest.raises(AdapterRefused, match="takes one cu_seqlens for q and k"):
        signature.arguments(q, q, cu, other, 3, 4, None, None, False, None, (-1, -1))
    with pytest.raises(AdapterRefused, match="takes one max_seqlen for q and k"):
        signature.arguments(q, q, cu, cu, 3, 4, None, None, False, None, (-1, -1))

    case = Case((3, 2), tail_q=1, tail_k=1, heads=2, head_dim=16)
    snippet = torch_snippet(adapt(self_attn_oracle), case, Finding("tail-rows", "planted"))
    assert snippet.count("cu_seqlens=") == 1 and snippet.count("max_seqlen=") == 1, snippet
    printed = []
    exec(compile(snippet, "<snippet>", "exec"), {"print": lambda *a: printed.append(" ".join(map(str, a)))})
    assert printed == [f"{n}: damaged REAL rows [], padding rows not 0 []" for n in ("out", "dq", "dk", "dv")], printed


SCALES_SEEN: list[tuple] = []


def both_scales(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None, softmax_scale=None):
    """varlen_attention with `softmax_scale` as an alias of `scale`: passing both is an error."""
    if scale is not None and softmax_scale is not None:
        raise ValueError("pass scale or softmax_scale (its alias), not both")
    SCALES_SEEN.append((scale, softmax_scale))
    return oracle(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=scale or softmax_scale)


def test_a_function_with_scale_and_its_alias_softmax_scale_gets_scale_alone():
    assert infer(both_scales).names["scale"] == "scale"
    SCALES_SEEN.clear()
    report = audit(both_scales, budget=0, checks=["custom-scale"])
    assert report.verdicts() == {"custom-scale": "pass"}, report.table()
    assert (0.3, None) in SCALES_SEEN and all(alias is None for _, alias in SCALES_SEEN), SCALES_SEEN


# -- errors name what the user types: --flags on the command line, keywords in Python ---------------


def not_varlen(x, y, z, lengths):
    return x


def test_python_errors_name_keywords(capsys):
    with pytest.raises(ValueError) as no_adapter:
        detect(not_varlen)
    assert "Pass adapter=NAME, NAME one of" in str(no_adapter.value) and "--adapter" not in str(no_adapter.value).split("\n\n")[0]
    with pytest.raises(ValueError, match=r"^adapter='nope' is not registered"):
        adapt(not_varlen, adapter="nope")
    with pytest.raises(ValueError, match=r"^checks= / skip= name unknown checks \['nope'\]"):
        audit(users_attention, budget=0, checks=["nope"])
    with pytest.raises(ValueError, match=r"^budget=-1 must be >= 0"):
        audit(users_attention, budget=-1, checks=["real-accuracy"])
    assert "audit it with device='cuda' on a GPU" in adapt("torch.nn.attention.varlen:varlen_attn", device="cpu").why_not()


def test_command_line_errors_name_flags(capsys):
    from varlen_workbench.workbench.cli.main import main

    assert main(["audit", "test_audit_inference:not_varlen"]) == 2
    message = capsys.readouterr().err.split("\n\n")[0]
    assert "Pass --adapter NAME, NAME one of" in message and "adapter=" not in message, message
    assert main(["audit", "test_audit_inference:users_attention", "--adapter", "nope"]) == 2
    assert "varlen-workbench audit: --adapter nope is not registered" in capsys.readouterr().err
    assert main(["audit", "test_audit_inference:users_attention", "--budget", "-1", "--checks", "real-accuracy"]) == 2
    assert "varlen-workbench audit: --budget -1 must be >= 0" in capsys.readouterr().err
    assert (
        main(["audit", "torch.nn.attention.varlen:varlen_attn", "--device", "cpu", "--budget", "0", "--checks", "tail-rows"]) == 2
    )
    out = capsys.readouterr().out
    assert "audit it with --device cuda on a GPU" in out and "device='cuda'" not in out, out
