"""Post-mortem torch-varlen-176793: its building blocks, fast. The whole study (reproduce + claims)
runs in the notebook, which nbval re-executes."""

import json
import math
import time

import pytest
import torch

from varlen_workbench.kernels.replicas.torch_varlen import stale_memory
from varlen_workbench.postmortems import torch_varlen_176793 as pm
from varlen_workbench.postmortems.torch_varlen_176793 import gpu as pm_gpu
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.records import jsonable
from varlen_workbench.workbench.registry import Registry
from varlen_workbench.workbench.timing import CallTime

TINY = Case(seqlens_q=(9, 5), tail_q=2, tail_k=2, heads=1, head_dim=16, dtype="float16", fill=Fill.ZEROS)


def _call(fn, batch, d_out=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v))
    out = fn(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k)
    out.backward(torch.ones_like(out) if d_out is None else d_out)
    return out.detach(), q.grad, k.grad, v.grad


def test_registered_with_a_conforming_notebook():
    from varlen_workbench.workbench.registry import check_notebook

    post_mortem = Registry().get("torch-varlen-176793")
    check_notebook(post_mortem)
    assert post_mortem.meta.seed == "000_1019a3997e440af2.txt"
    assert pm.STUDY in pm.CASES and all(c.tail_q == c.tail_k for c in pm.CASES)


def test_meta_dates_follow_the_issue_and_its_links():
    assert pm.META.reported == "2026-03-07"  # the issue's own date, not a later PR's
    dated = pm.META.timeline
    report = next(link for link in dated if link.label.startswith("pytorch#176793"))
    assert report.date == pm.META.reported and report.url == pm.STATUS.reference
    assert {link.status for link in dated if "ValueError" in link.label or "resubmitted" in link.label} == {"closed, not merged"}
    assert pm.META.revised >= max(link.date for link in dated)


def test_seed_inputs_are_two_dimensional_and_unequal():
    problems = pm.seed_input_problems()
    assert problems["dims"] == {"q": 2, "k": 2, "v": 2}
    assert problems["shapes"]["q"] != problems["shapes"]["v"]  # 1024 does not split into 3 equal chunks
    assert problems["contract_error"].startswith("ValueError: q must be 3-D")


@pytest.mark.parametrize("impl, broken", [(pm.replica_varlen_attn, True), (pm.fixed_torch_style, False)])
def test_corrected_repro(impl, broken):
    with poisoned_memory():
        outcome = pm.corrected_repro(impl, seqlens=(9, 5), heads=1, head_dim=16, dtype=torch.float16, trailing=3)
    assert outcome["shapes"]["q"] == (17, 1, 16)
    assert outcome["out_real_nonfinite"] == 0 and outcome["grad_real_nonfinite"] == 0
    assert math.isnan(outcome["loss"]) is broken
    assert (outcome["out_tail_nonfinite"] == 3 * 16, outcome["grad_tail_nonfinite"] == 3 * 48) == (broken, broken)


def test_stale_memory_is_finite_deterministic_and_scoped():
    with pytest.raises(ValueError, match="finite scale > 0"):
        with stale_memory(scale=math.inf):
            pass
    outcomes = []
    for _ in range(2):
        with stale_memory(seed=3):
            outcomes.append(pm.corrected_repro(pm.replica_varlen_attn, seqlens=(9, 5), heads=1, head_dim=16, dtype=torch.float16))
    assert outcomes[0] == outcomes[1] and math.isfinite(outcomes[0]["loss"])
    assert outcomes[0]["out_tail_nonfinite"] == outcomes[0]["grad_tail_nonfinite"] == 0
    with poisoned_memory():  # outside the block, poisoning shows again: the state was restored
        assert math.isnan(
            pm.corrected_repro(pm.replica_varlen_attn, seqlens=(9, 5), heads=1, head_dim=16, dtype=torch.float16)["loss"]
        )


def test_check_your_run_table_names_the_unwritten_rows():
    batch = pack(TINY)
    with poisoned_memory():
        out, dq, dk, dv = _call(pm.replica_varlen_attn, batch)
    report = pm.tail_rows_report(out, {"dq": dq, "dk": dk, "dv": dv}, batch.cu_seqlens_q, batch.cu_seqlens_k)
    assert [r[:3] for r in report.rows] == [(name, "2", "32") for name in ("out", "dq", "dk", "dv")]


def test_workarounds_keep_real_rows_and_zero_the_tail_under_a_loss_mask():
    batch = pack(TINY)
    d_out = pm._masked_grad_out(batch)
    with poisoned_memory():
        base = _call(pm.replica_varlen_attn, batch, d_out)
        results = {name: _call(fn, batch, d_out) for name, fn in pm.workarounds(pm.replica_varlen_attn).items()}
    real = 14
    for name, tensors in results.items():
        for got, want in zip(tensors, base):
            assert torch.allclose(got[:real].float(), want[:real].float(), atol=2e-3), name
        tails = [t[real:] for t in tensors]
        assert all(bool((t == 0).all()) for t in tails) is (name != "as is"), name


def test_dummy_sequence_without_a_loss_mask_trains_the_padding():
    batch = pack(TINY)
    with poisoned_memory():
        _, dq, dk, dv = _call(pm.as_dummy_sequence(pm.replica_varlen_attn), batch)  # dO = 1 on every row
    tail = torch.cat([dk[14:], dv[14:]])
    assert torch.isfinite(tail).all() and tail.abs().max() > 0


def test_dummy_sequence_appends_one_boundary_on_the_device():
    seen = {}

    def spy(q, k, v, cu_q, cu_k, max_q, max_k):
        seen.update(cu_q=cu_q.tolist(), max_q=max_q)
        return torch.zeros_like(q)

    batch = pack(TINY)
    pm.as_dummy_sequence(spy)(batch.q, batch.k, batch.v, batch.cu_seqlens_q, batch.cu_seqlens_k, 9, 9)
    assert seen == {"cu_q": [0, 9, 14, 16], "max_q": 16}


def test_zero_rows_from_replaces_nan_rather_than_multiplying_it():
    x = torch.full((4, 2), math.nan)
    x[:2] = 1.0
    out = pm._zero_rows_from(x, torch.tensor(2))
    assert out.tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]


def test_sliced_pads_the_output_back_to_the_buffer():
    batch = pack(TINY)
    out, dq, _, _ = _call(pm.as_sliced(pm.replica_varlen_attn), batch)
    assert out.shape == batch.q.shape and bool((out[14:] == 0).all()) and bool((dq[14:] == 0).all())


def test_qkv_damage_is_finite_and_wrong_only_with_the_buggy_op():
    buggy = pm.qkv_damage(pm.replica_varlen_attn, seqlens=(9, 5), trailing=3, heads=1, head_dim=16)
    assert buggy["weight_grad_finite"] and buggy["dqkv_tail_nonfinite"] == 0 and buggy["weight_grad_rel_error"] > 0.1
    assert buggy["dqkv_real_max_abs_diff"] == 0.0 and buggy["correct_tail_zero"]
    fixed = pm.qkv_damage(pm.fixed_torch_style, seqlens=(9, 5), trailing=3, heads=1, head_dim=16)
    assert fixed["weight_grad_rel_error"] == 0.0 and fixed["dqkv_tail_max_abs"] == 0.0


def test_proposed_check_rejects_trailing_rows_and_host_reads_break_compile():
    batch, no_tail = pack(TINY), pack(TINY.with_(tail_q=0, tail_k=0))
    with pytest.raises(ValueError, match=r"query has 16 tokens but cu_seq_q\[-1\] = 14"):
        pm.proposed_check(batch.q, batch.k, batch.cu_seqlens_q, batch.cu_seqlens_k)
    pm.proposed_check(no_tail.q, no_tail.k, no_tail.cu_seqlens_q, no_tail.cu_seqlens_k)
    compiled = {name: pm.compile_fullgraph(fn, no_tail) for name, fn in pm._subjects().items()}
    assert {name for name, o in compiled.items() if not o["ok"]} == {
        "replica + proposed check",
        "replica + (b) slice (host sync)",
    }


def _one_call(fn, *, device=None) -> CallTime:
    """`time_call`'s record of a single call of `fn`."""
    began = time.perf_counter()
    fn()
    ms = (time.perf_counter() - began) * 1e3
    return CallTime(min_ms=ms, median_ms=ms, host_ms=ms, iters=1)


@pytest.fixture(scope="module")
def probes_json() -> str:
    """`upstream_probes` on the replica on CPU, as the JSON a record holds: run once, each test
    loads its own copy. Each workaround is timed on one call instead of `time_call`'s 23: the
    tests read the timing record's shape and ratios, not its statistics, and the 115 interpreted
    forward+backward calls were two thirds of the fixture (time_call has its own test in test_bench)."""
    tiny = TINY.with_(tail_q=0, tail_k=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pm_gpu, "time_call", _one_call)
        data = pm.upstream_probes(
            pm.replica_varlen_attn, "cpu", case=tiny, pads=(0, 2), trailing=2, prefill_mb=0, timing_case=None, on_gpu=False
        )
    return json.dumps(jsonable(data))


@pytest.mark.slow
def test_upstream_probes_run_on_any_torch_style_function_and_are_json(probes_json):
    record = {"probes": json.loads(probes_json)}
    assert set(record["probes"]) >= {"damage", "points", "corrected_repro", "workarounds", "timing", "capture"}
    assert record["probes"]["timing"][0]["vs_as_is"] == 1.0
    assert "(d) our fixed kernel" in str(pm.gpu_workaround_table(record))
    points = pm.gpu_points_table(record)
    assert ("poisoned", "2", "varlen_attn", "32/32/32/32") == points.rows[-3][:4]


def test_gpu_probes_say_why_without_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        pm.gpu_probes("cpu")


def test_upstream_code_reads_the_installed_source_without_docstrings():
    code = pm.upstream_code()
    assert "_flash_attention_forward" in code and "Shape legend" not in code


def test_budget_batches_have_the_trailing_rows_asked_for():
    batches, _ = pm.budget_batches(pad=5, steps=2)
    for batch in batches:
        assert batch.tokens.numel() - int(batch.cu_seqlens[-1]) == 5


@pytest.mark.slow
def test_gpu_claims_read_a_record_of_probes(probes_json):
    from types import SimpleNamespace

    from varlen_workbench.workbench.postmortem import Claims

    probes = json.loads(probes_json)
    names = list(probes["capture"]["compile_fullgraph"])
    host_reads = [n for n in names if n.endswith("proposed check") or "(b) slice" in n]
    graphs = {n: {"ok": n not in host_reads, "error": "AcceleratorError: x"} for n in names}
    probes["capture"]["cuda_graph"] = graphs
    probes["seed_repro"] = {"raised": "RuntimeError: FlashAttention only support fp16 and bf16 data type"}
    probes["timing_large"] = probes["timing"]
    gpu_claims = Claims()
    pm.register_gpu_claims(gpu_claims)
    verdicts = gpu_claims.check(SimpleNamespace(gpu={"probes": probes}, gpu_damage={"probes": probes}))
    assert not [v.evidence for v in verdicts if v.evidence.startswith("check raised")]
    assert all(v.level.kind == "upstream-gpu" for v in verdicts) and len(host_reads) == 2
    assert verdicts[0].claim.startswith("H200: the original report's code verbatim") and verdicts[0].holds
    assert [v.holds for v in verdicts if "CUDA-graph capture" in v.claim] == [True]


def _light():
    """What the keyword and window claims read of reproduce()'s results, without running the study."""
    return _with_window(pm.window_finding())


def test_our_varlen_attn_takes_the_later_keywords_and_the_page_says_what_it_does():
    """The page once said our varlen_attn does not take enable_gqa, seqused_k, block_table, num_splits:
    it takes all four; enable_gqa=True runs and the other three raise ValueError."""
    found = pm.swap_in_keywords()
    assert list(found) == list(pm.LATER_KEYWORDS)
    assert found["enable_gqa"] == "runs, matches K/V repeated per query head"
    assert all(found[k].startswith(f"ValueError: varlen_attn got {k}") for k in pm.LATER_KEYWORDS[1:])
    assert pm.claims.verdict(_light(), "our drop-in").holds
    broken = _light()
    broken.keywords = {**broken.keywords, "num_splits": "runs, matches K/V repeated per query head"}
    assert not pm.claims.verdict(broken, "our drop-in").holds
    nb = json.loads((Registry().notebooks_dir / "torch-varlen-176793.ipynb").read_text())
    prose = " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "which it does not take" not in prose and "`enable_gqa=True` runs grouped K/V" in prose


def test_the_fuzzers_real_row_failure_is_read_from_the_record_and_the_reset_gives_its_error():
    """The audit matrix's varlen_attn record: fuzzer real-accuracy on q=[73] k=[1] window (-1, 55), out error 2.73;
    FlashAttention-2's reset of the right bound, applied to the oracle, moves the keyless rows by that much."""
    import dataclasses

    w = pm.window_finding()
    assert w is not None and w.padding_rows == 0 and w.reset_applies and w.keyless_rows == 17
    assert w.recorded_out_error == pytest.approx(w.reset_error, rel=0.05)
    assert w.judgement is not None and w.judgement.mechanism == "fa2-window-bound-clamp"
    assert any("flash-attention/issues/895" in url for url, _ in w.judgement.links)
    assert pm.claims.verdict(_light(), "audit matrix, H200").holds
    off = dataclasses.replace(w, evidence=w.evidence.replace("out: error 2.73", "out: error 9.5"))
    assert not pm.claims.verdict(_with_window(off), "audit matrix, H200").holds
    text = pm.window_finding_markdown(w)
    assert w.evidence in text and w.case.label() in text and "issues/895" in text


def _with_window(window):
    from types import SimpleNamespace

    return SimpleNamespace(keywords=pm.swap_in_keywords(), window=window)
