"""`varlen-workbench audit`: adapters, checks, the bad-input campaign, reports and the CLI.

Implementations here are the fp64 oracle with one planted bug each (fast: no interpreter), and
fakes with the exact signatures of torch's varlen_attn (2.10 and 2.11), FlashAttention's
flash_attn_varlen_func, a TransformerEngine THD call and a BSHD + mask callable.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.workbench.audit import ADAPTERS, Verdict, adapt, audit, detect, register_adapter
from varlen_workbench.workbench.audit.campaign import Outcome, classify, run_campaign, summarize
from varlen_workbench.workbench.cli.audit_command import parse_head_dims
from varlen_workbench.workbench.cli.main import main
from varlen_workbench.workbench.malformed import CATALOGUE, base_args, split_call
from varlen_workbench.workbench.reference import reference_attention

BY_ID = {c.id: c for c in CATALOGUE}


def oracle(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    *,
    cu_seqlens_q_padded=None,
    cu_seqlens_k_padded=None,
    causal=False,
    scale=None,
    window_size=(-1, -1),
    validate=False,
):
    """The oracle in q's dtype; validate=False: like most kernels, it trusts its metadata."""
    return reference_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_k_padded=cu_seqlens_k_padded,
        causal=causal,
        scale=scale,
        window_size=window_size,
        validate=validate,
    ).to(q.dtype)


def _layout(cu, padded):
    return cu if padded is None else padded


# -- planted bugs: each breaks exactly one promise of the contract --------------------------


def tail_unwritten(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded=None, **kw):
    """torch varlen_attn's bug: rows past the layout's end come from torch.empty."""
    out = oracle(q, k, v, cu_q, cu_k, max_q, max_k, cu_seqlens_q_padded=cu_seqlens_q_padded, **kw)
    end = int(_layout(cu_q, cu_seqlens_q_padded)[-1])
    return torch.cat([out[:end], torch.empty_like(out[end:])])


def gap_unwritten(q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded=None, **kw):
    """GAP rows come from torch.empty: only real rows are written."""
    out = oracle(q, k, v, cu_q, cu_k, max_q, max_k, cu_seqlens_q_padded=cu_seqlens_q_padded, **kw)
    layout = _layout(cu_q, cu_seqlens_q_padded)
    keep = torch.zeros(q.shape[0], dtype=torch.bool)
    for i, (a, b) in enumerate(zip(cu_q.tolist(), cu_q[1:].tolist())):
        keep[int(layout[i]) : int(layout[i]) + b - a] = True
    keep[int(layout[-1]) :] = True
    return torch.where(keep[:, None, None], out, torch.empty_like(out))


def padding_reaches_real_rows(q, *args, **kw):
    """A reduction over every row lets NaN padding reach every output (conftest's planted bug)."""
    return oracle(q, *args, **kw) + 0 * q.sum()


def top_left_causal(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, **kw):
    """Causal aligned top-left (TE's "padding_causal"): wrong whenever len_q != len_k."""
    if not causal:
        return oracle(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    out = torch.zeros_like(q)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        one = oracle(
            q[cq[i] : cq[i + 1]],
            k[ck[i] : ck[i] + min(lq, lk)],
            v[ck[i] : ck[i] + min(lq, lk)],
            torch.tensor([0, lq], dtype=torch.int32),
            torch.tensor([0, min(lq, lk)], dtype=torch.int32),
            lq,
            lk,
            causal=True,
        )
        out = torch.cat([out[: cq[i]], one, out[cq[i + 1] :]])
    return out


def gqa_interleaved(q, k, v, *args, **kw):
    """GQA with the wrong head mapping (kv head h % H_kv instead of h // group)."""
    group = q.shape[1] // k.shape[1]
    return oracle(q, k.repeat(1, group, 1), v.repeat(1, group, 1), *args, **kw)


def window_left_ignored(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), **kw):
    """A sliding window that drops its left bound: a query sees every key up to its right bound."""
    return oracle(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, window_size[1]), **kw)


def nondeterministic(q, *args, **kw):
    out = oracle(q, *args, **kw)
    return out + 1e-6 * torch.rand(()) * out


PLANTED = [
    (tail_unwritten, "tail-rows", "out: .* non-finite values in 4 TAIL rows"),
    (gap_unwritten, "gap-rows", "out: .* non-finite values in .* GAP rows"),
    (padding_reaches_real_rows, "padding-leak", r"\(nan padding\): out: .* non-finite REAL values"),
    (top_left_causal, "causal-unequal", "error .* > bound.*; out matches top-left aligned causal masking .* aligns bottom-right"),
    (gqa_interleaved, "gqa", "H=4/2 .* error .* > bound"),
    (nondeterministic, "determinism", "values differ"),
    (window_left_ignored, "sliding-window", r"window=\(2, 1\) .*error .* > bound"),
]


@pytest.mark.parametrize("impl, check, evidence", PLANTED, ids=[p[1] for p in PLANTED])
def test_each_check_catches_its_planted_bug(impl, check, evidence):
    report = audit(impl, "contract", budget=0, checks=[check])
    result = report.result(check)
    assert result.verdict is Verdict.FAIL, result
    assert result.evidence and __import__("re").search(evidence, result.evidence), result.evidence


def sdpa_is_causal_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, scale=None):
    """Each sequence through SDPA with is_causal: top-left aligned for every len_q, len_k (query i
    sees keys 0..i), so the rows the contract leaves without a key (len_q > len_k) see some."""
    group = q.shape[1] // k.shape[1]
    rows = []
    for a, b, c, d in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        if b == a or d == c:
            rows.append(torch.zeros_like(q[a:b]))
            continue
        qi, ki, vi = (x.transpose(0, 1) for x in (q[a:b], k[c:d].repeat_interleave(group, 1), v[c:d].repeat_interleave(group, 1)))
        rows.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=scale).transpose(0, 1))
    return torch.cat([*rows, torch.zeros_like(q[int(cu_q[-1]) :])])


def causal_ignored(q, *args, causal=False, **kw):
    return oracle(q, *args, **kw)


def test_the_top_left_hint_comes_only_where_out_matches_top_left_alignment():
    """Both causal checks of len_q != len_k give the hint, on either side of len_q = len_k; a causal
    failure of another cause (the mask dropped) gets none."""
    report = audit(sdpa_is_causal_per_sequence, budget=0, checks=["real-accuracy", "causal-unequal", "fully-masked-rows"])
    assert report.verdicts() == {"real-accuracy": "pass", "causal-unequal": "FAIL", "fully-masked-rows": "FAIL"}, report.table()
    for name in ("causal-unequal", "fully-masked-rows"):
        assert "; out matches top-left aligned causal masking" in report.result(name).evidence, report.table()
    report = audit(causal_ignored, "contract", budget=0, checks=["causal-unequal", "fully-masked-rows"])
    assert report.verdicts() == {"causal-unequal": "FAIL", "fully-masked-rows": "FAIL"}, report.table()
    assert not any("top-left" in r.evidence for r in report.results), report.table()


def test_a_failing_window_case_replays_with_its_window():
    """The failing case carries its window (Case.window): a post-mortem notebook from the audit
    replays it, and probing it alone shows the same failure."""
    from varlen_workbench.workbench.audit import layout_findings
    from varlen_workbench.workbench.audit.notebook import reproductions
    from varlen_workbench.workbench.layout import pack
    from varlen_workbench.workbench.probes import probe

    report = audit(window_left_ignored, "contract", budget=0, checks=["sliding-window"])
    [(label, finding, case, _)] = reproductions(report)
    assert (label, finding, case.window) == ("sliding-window", None, (2, 1))
    impl = adapt(window_left_ignored, "contract")
    record = probe(impl, pack(case, impl.device), poisoned=True)
    assert [f.check for f in layout_findings(record)] == ["real-accuracy"]


def test_the_oracle_passes_every_check():
    report = audit(reference_attention, budget=0)
    assert [r.name for r in report.results if r.verdict is not Verdict.PASS] == ["input-validation"]
    assert report.passed and report.ran and report.validation == "validates"
    # head dim 20 (of q and k, of v) and float64 are legal for the oracle: accepted with the right answer, not n/a.
    assert report.result("input-validation").evidence == "33/36 clear errors, 3 accepted correctly"


# -- adapters -------------------------------------------------------------------------------


def varlen_attn_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature; FlashAttention-2's mechanism: out = empty_like(q), covered rows written."""
    return tail_unwritten(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)


CALLS: list[dict] = []


def varlen_attn_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    """torch 2.11's signature: causal is window_size=(-1, 0) (there is no causal flag), scale keyword-only."""
    CALLS.append({"window_size": window_size, "scale": scale})
    return oracle(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size, scale=scale)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn 2's signature, computed by the oracle, trusting its metadata as FA does (a
    negative window bound is unbounded, a non-int one truncated, as its C++ takes them);
    return_attn_probs=True gives (out, softmax_lse, S_dmask)."""
    assert dropout_p == 0.0
    left, right = window_size
    window = (max(int(left), -1), max(int(right), -1))
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = oracle(*args, causal=causal, scale=softmax_scale, window_size=window)
    if not return_attn_probs:
        return out
    kwargs = dict(causal=causal, scale=softmax_scale, window_size=window, compute_dtype=q.dtype, validate=False)
    return out, reference_attention(*args, **kwargs, return_lse=True)[1].float(), None


def te_dot_product_attention(
    query_layer,
    key_layer,
    value_layer,
    attention_mask=None,
    qkv_format=None,
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    cu_seqlens_q_padded=None,
    cu_seqlens_kv_padded=None,
    max_seqlen_q=None,
    max_seqlen_kv=None,
    attn_mask_type=None,
    window_size=None,
):
    """DotProductAttention.forward's keywords; THD output flattened to (tokens, heads * dim), as TE returns it."""
    assert qkv_format == "thd" and attn_mask_type in ("padding", "padding_causal_bottom_right"), attn_mask_type
    out = reference_attention(
        query_layer,
        key_layer,
        value_layer,
        cu_seqlens_q,
        cu_seqlens_kv,
        max_seqlen_q,
        max_seqlen_kv,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_k_padded=cu_seqlens_kv_padded,
        causal=attn_mask_type == "padding_causal_bottom_right",
    ).to(query_layer.dtype)
    return out.flatten(1)


def sdpa_bshd(q, k, v, mask):
    """The textbook padded-batch attention: SDPA with a boolean mask (NaN on fully masked rows)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], enable_gqa=True
    )
    return out.transpose(1, 2)


def sdpa_bshd_guarded(q, k, v, mask):
    """The same, with masked keys zeroed and fully masked rows set to 0: what the contract asks."""
    seen_keys, live_rows = mask.any(1)[:, :, None, None], mask.any(-1)[:, :, None, None]
    q, k, v = torch.where(live_rows, q, 0), torch.where(seen_keys, k, 0), torch.where(seen_keys, v, 0)
    safe = mask | ~mask.any(-1, keepdim=True)  # fully masked rows attend anything, then are zeroed
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=safe[:, None], enable_gqa=True
    )
    return out.transpose(1, 2) * live_rows


def test_adapters_are_detected_from_signatures():
    from torch.nn.attention.varlen import varlen_attn

    assert detect(varlen_attention).name == "ours"
    assert detect(varlen_attn).name == "torch-varlen"  # torch's own: CUDA only, its dtypes
    # Fakes of a library's signature are called by the same names; only the library's own
    # function carries what its signature cannot say (device, dtypes).
    for fake in (reference_attention, varlen_attn_210, varlen_attn_211, flash_attn_varlen_func):
        assert detect(fake).name == "contract", fake
    assert detect(te_dot_product_attention).name == "te-thd"
    with pytest.raises(ValueError, match=r"no adapter recognises .*sdpa_bshd.*`bshd` is never guessed"):
        detect(sdpa_bshd)
    with pytest.raises(ValueError, match=r"adapter='nope' is not registered; known adapters: .*torch-varlen"):
        adapt(reference_attention, "nope")
    with pytest.raises(ValueError, match=r"target 'varlen_workbench.workbench:nothing_here'.*has no attribute 'nothing_here'"):
        adapt("varlen_workbench.workbench:nothing_here")
    with pytest.raises(ValueError, match=r"must look like module:function"):
        adapt("varlen_workbench.workbench.reference.reference_attention")


def test_torch_varlen_on_cpu_is_not_applicable_with_the_reason():
    from torch.nn.attention.varlen import varlen_attn

    report = audit(varlen_attn, device="cpu", budget=5)
    assert {r.verdict for r in report.results} == {Verdict.NA} and report.fuzz is None and not report.ran
    assert "CUDA only" in report.results[0].evidence and "NOTHING RAN" in str(report)


def _runnable_here(name: str):
    """The adapter as it is, except the CUDA-only limit: fakes of CUDA-only functions run on CPU."""
    adapter = ADAPTERS[name]
    return dataclasses.replace(
        adapter, lacks=lambda fn, device: {k: v for k, v in adapter.lacks_for(fn, device).items() if k != "run"}
    )


def test_torch_210_adapter_finds_the_tail_bug_and_knows_what_210_lacks():
    report = audit(varlen_attn_210, _runnable_here("torch-varlen"), budget=0, dtype="float16")
    verdicts = report.verdicts()
    assert verdicts["tail-rows"] == "FAIL" and "non-finite values in 4 TAIL rows" in report.result("tail-rows").evidence
    assert verdicts["gap-rows"] == verdicts["gqa"] == "n/a"
    assert "enable_gqa" in report.result("gqa").evidence and "no padded layout" in report.result("gap-rows").evidence
    assert verdicts["real-accuracy"] == verdicts["causal-unequal"] == verdicts["fully-masked-rows"] == "pass"
    rows = {r["id"]: r for r in report.result("input-validation").rows}
    assert rows["scale-nan"]["outcome"] == "n/a" and "2.10" in rows["scale-nan"]["evidence"]
    assert rows["padded-decreasing"]["outcome"] == "n/a"
    # The fake trusts cu_seqlens and ignores max_seqlen: on the campaign's layout without TAIL
    # rows (so the TAIL bug cannot pose as a bad-input finding) that is the oracle's answer.
    assert rows["max-seqlen-too-small"]["outcome"] == Outcome.CORRECT.value
    assert report.validation == "no validation" and report.passed is False  # failed: tail-rows, not validation
    assert "input-validation" not in report.failed
    assert rows["dtype-unsupported"]["outcome"] != "n/a"  # torch declares fp16/bf16 only


def test_torch_211_adapter_passes_causal_as_a_window_and_scale_by_keyword():
    CALLS.clear()
    report = audit(
        varlen_attn_211, _runnable_here("torch-varlen"), budget=0, dtype="float16", checks=["causal-unequal", "tail-rows"]
    )
    assert report.verdicts() == {"causal-unequal": "pass", "tail-rows": "pass"}
    assert {"window_size": (-1, 0), "scale": None} in CALLS
    positional, _ = split_call(base_args(padded=False, kv_heads=4))
    adapt(varlen_attn_211, _runnable_here("torch-varlen"))(*positional, scale=0.5)
    assert CALLS[-1] == {"window_size": (-1, -1), "scale": 0.5}
    # A window goes as it is; with causal its right side is 0 (FlashAttention's rule), since
    # varlen_attn 2.11 has no causal flag to combine it with.
    CALLS.clear()
    report = audit(varlen_attn_211, _runnable_here("torch-varlen"), budget=0, dtype="float16", checks=["sliding-window"])
    assert report.verdicts() == {"sliding-window": "pass"}, report.table()
    assert [c["window_size"] for c in CALLS] == [(2, 1), (0, 0), (-1, 1), (3, 0)]  # one call per case


def test_flash_attn_adapter_on_a_fake_of_its_signature():
    report = audit(flash_attn_varlen_func, budget=0, dtype="float16")
    verdicts = report.verdicts()
    assert verdicts.pop("gap-rows") == "n/a" and verdicts.pop("input-validation") == "no validation"
    assert report.passed  # validation is graded apart: it never fails the audit
    assert set(verdicts.values()) == {"pass"}, verdicts  # lse included: return_attn_probs=True asks for it
    rows = {r["id"]: r["outcome"] for r in report.result("input-validation").rows}
    # The fake trusts its metadata: a list crashes deep inside (AttributeError: an accident, not
    # a refusal); a short max_seqlen is ignored, which gives the oracle's answer; a negative
    # scale is valid mathematics, computed right.
    assert rows["cu-not-tensor"] == Outcome.CRASH.value
    assert rows["max-seqlen-too-small"] == rows["scale-negative"] == Outcome.CORRECT.value


def test_te_adapter_maps_thd_keywords_and_bottom_right_causal():
    report = audit(te_dot_product_attention, budget=0)
    verdicts = report.verdicts()
    assert verdicts.pop("custom-scale") == "n/a" and "constructor" in report.result("custom-scale").evidence
    assert verdicts.pop("sliding-window") == "n/a" and "window_size" in report.result("sliding-window").evidence
    assert verdicts.pop("lse") == "n/a" and "no return_lse keyword" in report.result("lse").evidence
    assert set(verdicts.values()) == {"pass", "validates"}, report.table()
    rows = {r["id"]: r for r in report.result("input-validation").rows}
    assert rows["scale-nan"]["outcome"] == "n/a" and "constructor" in rows["scale-nan"]["evidence"]
    assert rows["cu-decreasing"]["outcome"] == Outcome.CLEAR.value  # named cu_seqlens_k: the oracle validates


def test_bshd_adapter_catches_sdpa_letting_masked_nan_through_and_passes_a_guarded_one():
    report = audit(sdpa_bshd, "bshd", budget=0)
    verdicts = report.verdicts()
    assert verdicts.pop("tail-rows") == verdicts.pop("gap-rows") == verdicts.pop("input-validation") == "n/a"
    assert verdicts.pop("custom-scale") == "n/a"  # sdpa_bshd takes no scale keyword
    assert verdicts.pop("lse") == "n/a"  # nor gives an lse
    # Masked scores are -inf, but probability 0 times a NaN value at a padded position is NaN.
    assert verdicts.pop("padding-leak") == "FAIL" and "(nan padding): out:" in report.result("padding-leak").evidence
    assert set(verdicts.values()) == {"pass"}, report.table()  # torch >= 2.5 SDPA gives 0 on fully masked rows
    guarded = audit(sdpa_bshd_guarded, "bshd", budget=4)
    assert guarded.passed, str(guarded)


def test_a_user_adapter_in_a_few_lines():
    def self_attention(x_q, x_k, x_v, boundaries, longest, causal):
        return oracle(x_q, x_k, x_v, boundaries, boundaries, longest, longest, causal=causal)

    @register_adapter(
        "test-self-attention", lacks={"unequal": "self-attention only: one cu_seqlens", "padded": "no padded layout"}
    )
    def wrap(fn):
        def call(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            *,
            cu_seqlens_q_padded=None,
            cu_seqlens_k_padded=None,
            causal=False,
            scale=None,
        ):
            return fn(q, k, v, cu_seqlens_q, max_seqlen_q, causal)

        return call

    try:
        report = audit(
            self_attention, "test-self-attention", budget=10, checks=["real-accuracy", "causal-unequal", "tail-rows", "gqa"]
        )
        assert report.verdicts() == {"real-accuracy": "pass", "causal-unequal": "n/a", "tail-rows": "pass", "gqa": "pass"}
        assert report.result("causal-unequal").evidence == "self-attention only: one cu_seqlens"
        assert report.fuzz.tried == 10 and not report.fuzz.failures
    finally:
        ADAPTERS.pop("test-self-attention")
    with pytest.raises(ValueError, match="already registered"):
        register_adapter("ours")(lambda fn: fn)


# -- the bad-input campaign -----------------------------------------------------------------


def _raises(exc):
    def impl(*args, **kwargs):
        raise exc

    return impl


def _list_tolerant_oracle(q, k, v, cu_q, cu_k, *args, **kwargs):
    as_tensor = [torch.as_tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]
    return oracle(q, k, v, *as_tensor, *args, **kwargs)


@pytest.mark.parametrize(
    "impl, case, outcome",
    [
        (_raises(ValueError("cu_seqlens_k is not monotonic")), "cu-decreasing", Outcome.CLEAR),
        # Any exception type naming the argument is a clear error (torch's own C++ checks raise RuntimeError).
        (_raises(RuntimeError("cu_seqlens_q must have dtype int32")), "cu-float", Outcome.CLEAR),
        (_raises(ValueError("bad metadata")), "cu-decreasing", Outcome.VAGUE),
        (_raises(RuntimeError("CUDA error: an illegal memory access was encountered")), "cu-decreasing", Outcome.CRASH),
        (_raises(IndexError("index 9 is out of bounds")), "cu-decreasing", Outcome.CRASH),
        (lambda q, *a, **kw: None, "cu-decreasing", Outcome.NO_OUTPUT),
        (lambda q, *a, **kw: torch.full_like(q, math.nan), "cu-decreasing", Outcome.SILENT_NAN),
        (lambda q, *a, **kw: torch.zeros_like(q), "cu-decreasing", Outcome.ACCEPTED),  # no answer to be wrong about
        (lambda q, *a, **kw: torch.zeros_like(q), "cu-not-tensor", Outcome.SILENT_WRONG),  # compared with fp64
        (_list_tolerant_oracle, "cu-not-tensor", Outcome.CORRECT),  # a list that gives the right answer
        (oracle, "scale-negative", Outcome.CORRECT),  # valid mathematics
    ],
    ids=[
        "clear",
        "clear-runtime-error",
        "vague",
        "crash-cuda",
        "crash-accident",
        "no-output",
        "silent-nan",
        "accepted",
        "silent-wrong",
        "list-correct",
        "negative-scale",
    ],
)
def test_campaign_classifies_what_an_implementation_does(impl, case, outcome):
    adapted = adapt(impl, "contract")
    assert classify(adapted, BY_ID[case], base_args(tail=False))[0] is outcome


def test_campaign_accepts_the_implementations_own_argument_names():
    adapted = adapt(varlen_attn_210, _runnable_here("torch-varlen"))
    outcome, evidence = classify(adapted, BY_ID["cu-decreasing"], base_args(padded=False, kv_heads=4))
    assert outcome is Outcome.CRASH or outcome is Outcome.SILENT_WRONG or outcome is Outcome.SILENT_NAN, evidence

    def refuses_by_its_own_name(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        raise ValueError("cu_seq_k must be non-decreasing")

    named = adapt(refuses_by_its_own_name, _runnable_here("torch-varlen"))
    assert classify(named, BY_ID["cu-decreasing"], base_args(padded=False, kv_heads=4))[0] is Outcome.CLEAR


def test_campaign_of_our_kernel_is_all_clear_errors():
    rows = run_campaign(adapt(varlen_attention), "float32")
    assert {r["outcome"] for r in rows} == {Outcome.CLEAR.value}, [r for r in rows if r["outcome"] != "clear error"]
    assert len(rows) == len(CATALOGUE) and {r["head_dim"] for r in rows} == {"16"}
    assert "head_dim" not in summarize(rows)[1]


def test_campaign_grades_validation_at_a_head_dim_the_implementation_runs():
    """Our FA4 path refuses head_dim 16 before it looks at the boundaries: at 16 every case would
    grade that refusal. The campaign moves its base calls to the first head dim the path runs."""

    @functools.wraps(varlen_attention)
    def head_dim_64_only(q, *args, **kwargs):
        if q.shape[-1] != 64:
            raise ValueError(f"head_dim {q.shape[-1]}: this path takes head dim 64 only")
        return varlen_attention(q, *args, **kwargs)

    rows = run_campaign(adapt(head_dim_64_only), "float32")
    moved = [r["id"] for r in rows if r["outcome"] != Outcome.CLEAR.value and "head_dim 16" in r["evidence"]]
    assert {r["head_dim"] for r in rows} == {"64"} and not moved
    assert sum(r["outcome"] == Outcome.CLEAR.value for r in rows) >= len(CATALOGUE) - 2, rows  # head-dim cases aside
    assert "(at head_dim 64: it refuses 16)" in summarize(rows)[1]


# -- reports and the command line -----------------------------------------------------------


def test_cli_audit_exit_codes_and_record(tmp_path, capsys):
    record = tmp_path / "audit.json"
    assert (
        main(
            [
                "audit",
                "varlen_workbench.workbench.reference:reference_attention",
                "--budget",
                "3",
                "--checks",
                "real-accuracy,input-validation",
                "--record",
                str(record),
            ]
        )
        == 0
    )
    data = json.loads(record.read_text())
    assert data["passed"] and data["fuzz"]["tried"] == 3 and data["provenance"]["torch"] == torch.__version__
    assert [c["name"] for c in data["checks"]] == ["real-accuracy", "input-validation"] and len(data["checks"][1]["rows"]) == len(
        CATALOGUE
    )
    assert "PASSED" in capsys.readouterr().out

    assert main(["audit", "test_audit:tail_unwritten", "--adapter", "contract", "--budget", "0", "--checks", "tail-rows"]) == 1
    assert "FAILED: tail-rows" in capsys.readouterr().out
    assert (
        main(["audit", "torch.nn.attention.varlen:varlen_attn", "--device", "cpu", "--budget", "0", "--checks", "tail-rows"]) == 2
    )
    assert main(["audit", "no_such_module_xyz:f"]) == 2
    assert "cannot import module 'no_such_module_xyz'" in capsys.readouterr().err
    assert main(["audit", "varlen_workbench.workbench.reference:reference_attention", "--checks", "tail-rows,nope"]) == 2
    assert "--checks / --skip name unknown checks ['nope']" in capsys.readouterr().err


def test_cli_audit_runs_on_the_device_asked_in_this_process(tmp_path, monkeypatch):
    """`--device cpu` where the default device is CUDA (made so here, with or without a GPU): the
    audit runs in this process, starts no Python child, makes every tensor on the CPU, and its
    record's provenance is the CPU's."""
    import subprocess
    import sys

    from torch.overrides import TorchFunctionMode

    from varlen_workbench.kernels import _compat

    asked = _compat.default_device
    # Every module that imported the default device gets CUDA. Read with vars(): a lazy module
    # (`instruments`) would otherwise resolve the name now, from a module already patched.
    askers = [module for module in list(sys.modules.values()) if vars(module).get("default_device") is asked]
    for module in askers:
        monkeypatch.setattr(module, "default_device", lambda: torch.device("cuda"))
    popen = subprocess.Popen

    def no_python_child(args, *rest, **kwargs):
        assert sys.executable not in list(map(str, args if isinstance(args, (list, tuple)) else [args])), args
        return popen(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", no_python_child)

    class Devices(TorchFunctionMode):
        """The device type of every tensor a torch function returns."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen |= {
                t.device.type for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)
            }
            return out

    record = tmp_path / "audit.json"
    target = "varlen_workbench.workbench.reference:reference_attention"
    with Devices() as devices:
        argv = [
            "audit",
            target,
            "--device",
            "cpu",
            "--budget",
            "2",
            "--checks",
            "real-accuracy,gap-rows",
            "--record",
            str(record),
        ]
        assert main(argv) == 0
    assert devices.seen == {"cpu"}
    data = json.loads(record.read_text())
    assert data["device"] == "cpu" and data["fuzz"]["tried"] == 2
    assert data["provenance"]["device"].startswith("CPU (")  # the audited device's, not the default's


def test_audit_at_a_chosen_head_dim_builds_every_case_and_layout_there():
    """`head_dim`/`head_dim_v` (the CLI's --head-dim 192,128): every case the checks build and
    every layout the fuzzer draws has them, and the report says so."""
    report = audit(reference_attention, head_dim=192, head_dim_v=128, budget=2, checks=["real-accuracy", "gqa"])
    assert report.passed and report.head_dims == "192/128" and "head dim 192/128" in report.render().splitlines()[0]
    assert {(c.head_dim, c.head_dim_v) for r in report.results for c in r.cases} == {(192, 128)}
    assert report.fuzz is not None and report.fuzz.profile == "tiny d192/128" and report.fuzz.tried == 2
    assert audit(reference_attention, budget=0, checks=["gqa"]).head_dims == "32"  # the CPU default


def test_audit_head_dims_are_checked_against_what_the_adapter_declares():
    assert parse_head_dims("96") == (96, None) and parse_head_dims("192,128") == (192, 128)
    for bad in ("96,", "a", "192,128,64", "-8"):
        with pytest.raises(ValueError, match=r"--head-dim .*pass D \(e.g. 96\) or D_QK,D_V"):
            parse_head_dims(bad)
    with pytest.raises(ValueError, match=r"head_dim = 20: adapter 'ours' declares head dims 8, 16, 24, \.\.\., 256"):
        audit(varlen_attention, head_dim=20, budget=0)
    with pytest.raises(ValueError, match=r"head_dim_v = 264: adapter 'ours' declares"):
        audit(varlen_attention, head_dim=192, head_dim_v=264, budget=0)
    with pytest.raises(ValueError, match="head_dim_v = 128 needs head_dim"):
        audit(varlen_attention, head_dim_v=128, budget=0)


def test_cli_audit_head_dim(tmp_path, capsys):
    record = tmp_path / "audit.json"
    argv = [
        "audit",
        "varlen_workbench.workbench.reference:reference_attention",
        "--head-dim",
        "192,128",
        "--budget",
        "1",
        "--checks",
        "real-accuracy",
    ]
    assert main([*argv, "--record", str(record)]) == 0
    data = json.loads(record.read_text())
    assert data["head_dims"] == "192/128" and data["checks"][0]["cases"][0]["head_dim_v"] == 128
    assert "head dim 192/128" in capsys.readouterr().out
    assert main(["audit", "varlen_workbench.workbench.reference:reference_attention", "--head-dim", "96,x", "--budget", "0"]) == 2
    assert "--head-dim '96,x': pass D" in capsys.readouterr().err


def test_report_table_is_fixed_width_and_campaign_rows_name_each_case():
    report = audit(tail_unwritten, "contract", budget=0, checks=["tail-rows", "input-validation"])
    lines = report.table().splitlines()
    assert lines[0].split() == ["check", "verdict", "evidence"] and set(lines[1]) == {"-"}
    assert lines[2].split()[:2] == ["tail-rows", "FAIL"] and lines[3].split()[0] == "input-validation"
    assert report.failed == ["tail-rows"]
    assert [line.split()[0] for line in report.campaign_table().splitlines()] == [c.id for c in CATALOGUE]


def test_the_verdict_table_prints_last_and_the_campaign_only_on_request(capsys):
    argv = [
        "audit",
        "test_audit:tail_unwritten",
        "--adapter",
        "contract",
        "--budget",
        "0",
        "--checks",
        "tail-rows,input-validation",
    ]
    assert main(argv) == 1
    out = capsys.readouterr().out.rstrip().splitlines()
    table = out.index(next(line for line in out if line.split()[:2] == ["check", "verdict"]))
    assert out[-1] == "FAILED: tail-rows" and [line.split()[0] for line in out[table + 2 : table + 4]] == [
        "tail-rows",
        "input-validation",
    ]
    assert f"(input-validation graded {len(CATALOGUE)} malformed calls; --campaign lists each)" in out
    assert not any(line.startswith("cu-decreasing") for line in out)
    assert main([*argv, "--campaign"]) == 1
    shown = capsys.readouterr().out.rstrip().splitlines()
    campaign = shown.index("input validation (bad-input campaign):")
    assert campaign < shown.index(out[table]) and any(line.startswith("cu-decreasing") for line in shown[campaign:])
    assert shown[-1] == "FAILED: tail-rows"
