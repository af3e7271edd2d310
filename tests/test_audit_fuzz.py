"""The audit's layout fuzzer: what it draws, how it shrinks, and 50 layouts of our Triton kernel."""

from __future__ import annotations

import importlib
import random
import time

import pytest
import torch
from test_audit import oracle, tail_unwritten, varlen_attn_210, window_left_ignored

from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.workbench.audit import adapt, fuzz
from varlen_workbench.workbench.audit.fuzz import PROFILES, candidates, random_case, run_layout, size
from varlen_workbench.workbench.audit.snippets import torch_snippet
from varlen_workbench.workbench.layout import Case, pack
from varlen_workbench.workbench.probes import probe


def test_layouts_are_seeded_and_stay_within_what_the_adapter_can_express():
    full, torch_like = adapt(tail_unwritten, "contract"), adapt(varlen_attn_210, "torch-varlen", device="cpu")
    draws = [random_case(random.Random(7), full, PROFILES["tiny"]) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = random.Random(0)
    cases = [random_case(rng, full, PROFILES["tiny"]) for _ in range(400)]
    assert all(c.total_rows("q") and c.total_rows("k") for c in cases)
    seen = lambda pred: sum(bool(pred(c)) for c in cases)
    assert seen(lambda c: c.padded_q is not None) and seen(lambda c: c.tail_q) and seen(lambda c: c.kv_heads)
    assert seen(lambda c: 0 in c.seqlens_q) and seen(lambda c: 1 in c.seqlens_q) and seen(lambda c: c.seqlens_k is not None)
    assert seen(lambda c: c.causal) and len({c.fill for c in cases}) == 6 and len({c.dtype for c in cases}) == 3
    rng = random.Random(0)
    limited = [random_case(rng, torch_like, PROFILES["native"]) for _ in range(400)]
    assert not any(c.padded_q or c.padded_k or c.kv_heads for c in limited)  # no padded layout, no GQA before 2.12
    # Windows only where the implementation takes window_size (torch 2.10's varlen_attn and a
    # **kw pass-through do not): zero-width and one-sided ones among them.
    assert not any(c.windowed for c in cases + limited)
    windowed = [random_case(rng, adapt(oracle, "contract"), PROFILES["tiny"]) for _ in range(400)]
    assert seen(lambda c: c.windowed) == 0 and 0.25 < sum(c.windowed for c in windowed) / 400 < 0.55
    assert any(0 in c.window for c in windowed) and any(c.windowed and -1 in c.window for c in windowed)
    assert {c.dtype for c in limited} == {"bfloat16"} and max(c.total_rows("q") for c in limited) > 1000


def test_shrinking_reaches_a_local_minimum_that_still_fails():
    impl = adapt(tail_unwritten, "contract")
    result = fuzz(impl, 25, seed=3)
    assert result.tried == 25 and result.failing_layouts > 0
    failure = {f.check: f for f in result.failures}["tail-rows"]
    assert size(failure.case) < size(failure.original)
    assert [f.check for f in run_layout(impl, failure.case)] == ["tail-rows"]
    smaller = [c for c in candidates(failure.case, impl, PROFILES["tiny"]) if size(c) < size(failure.case)]
    assert not any(any(f.check == "tail-rows" for f in run_layout(impl, c)) for c in smaller)
    # One TAIL row of q, and the one row of k a probe needs.
    assert (failure.case.total_rows("q"), failure.case.total_rows("k"), failure.case.heads) == (1, 1, 1)


def test_reproduction_snippets_run_and_show_the_failure(capsys):
    result = fuzz(adapt(tail_unwritten, "contract"), 10, seed=3)
    failure = result.failures[0]
    replay = failure.replay
    assert 'adapt("test_audit:tail_unwritten", adapter="contract", device="cpu")' in replay and "case = Case(seqlens_q=" in replay
    exec(compile(replay, "<replay>", "exec"), {})
    assert "tail-rows: out:" in capsys.readouterr().out
    # The snippet for an upstream issue: plain torch, the function imported from its module.
    plain = failure.snippet
    assert "workbench" not in plain and "from test_audit import tail_unwritten" in plain
    exec(compile(plain, "<snippet>", "exec"), {})
    printed = capsys.readouterr().out
    tail = failure.case.total_rows("q") - sum(failure.case.padded_lengths("q"))
    assert (
        f"out: damaged REAL rows [], padding rows not 0 {list(range(failure.case.total_rows('q') - tail, failure.case.total_rows('q')))}"
        in printed
    )


def test_the_shrinker_drops_an_unrelated_empty_sequence():
    from varlen_workbench.workbench.audit.fuzz import shrink
    from varlen_workbench.workbench.layout import Case, Fill

    impl = adapt(tail_unwritten, "contract")
    case = Case((3, 0), seqlens_k=(3, 0), tail_q=2, heads=1, head_dim=16, fill=Fill.ZEROS)
    finding = next(f for f in run_layout(impl, case) if f.check == "tail-rows")
    small, _, _ = shrink(impl, case, finding, PROFILES["tiny"], budget=0)  # no greedy budget: the last pass alone
    assert small.batch == 1 and small.seqlens_q == (3,)


def test_time_limit_stops_the_fuzzer_and_says_so():
    result = fuzz(adapt(tail_unwritten, "contract"), 10_000, time_limit=0.5)
    assert 0 < result.tried < 10_000 and "time limit" in result.stopped_early
    with pytest.raises(ValueError, match=r"budget=-1 must be >= 0"):
        fuzz(adapt(tail_unwritten, "contract"), -1)


# The first 50 layouts of seed 2026 draw every feature of the tiny profile (each fill, dtype, head
# dim and batch size, GQA, GAP and TAIL rows of q and k, empty and 1-row sequences, unequal k,
# causal, zero-width and one-sided windows) and 97% of the feature pairs that 200 draw, at a
# quarter of the interpreter's time; the 1,000-layout run of our kernel is native
# (data/gpu/audit-ours.json).
@pytest.mark.slow
def test_our_kernel_survives_50_fuzzed_layouts():
    start = time.perf_counter()
    result = fuzz(adapt(varlen_attention_triton), 50, seed=2026, profile=PROFILES["tiny"])
    assert result.tried == 50 and not result.stopped_early
    assert result.failures == [], "\n\n".join(f.snippet for f in result.failures)
    print(f"{result.summary()} ({time.perf_counter() - start:.0f} s)")


def test_fp32_one_key_gradient_is_within_the_floored_bound():
    """The fuzzer's find that fixed varlen_workbench.workbench.bounds: with one key dk is exactly 0 in fp64, and
    the kernel's fp32 rounding (~1 ulp) must not fail a bound of 3 x max(PyTorch's 0 error, 1 ulp)."""
    record = probe(varlen_attention_triton, pack(Case((1,), heads=1, head_dim=16)))
    assert record.real_within_bound, record.errors


@pytest.mark.slow  # three worker processes, each importing the audit: ~7 s; the fast loop fuzzes in one
def test_workers_split_the_same_layouts_and_find_the_same_failures():
    impl = adapt("varlen_workbench.workbench.reference:reference_attention")
    one, two = fuzz(impl, 12, seed=5), fuzz(impl, 12, seed=5, workers=2)
    assert one.tried == two.tried == 12 and one.failures == two.failures == []
    leaky = adapt(tail_unwritten, "contract")
    with pytest.raises(ValueError, match="not importable as 'module:function'"):
        fuzz(adapt(lambda *a, **k: None, "contract"), 4, workers=2)
    assert (
        fuzz(leaky, 8, seed=3).failing_layouts
        == fuzz(adapt("test_audit:tail_unwritten", "contract"), 8, seed=3, workers=2).failing_layouts
    )


def test_a_window_bug_is_shrunk_and_reproduced_in_plain_torch(capsys):
    """A window that drops its left bound: the fuzzer finds it, shrinks it to a small windowed
    layout, and the plain-torch snippet shows damaged REAL rows for it and none for the oracle."""
    result = fuzz(adapt("test_audit:window_left_ignored", "contract"), 20, seed=1)
    failure = next(f for f in result.failures if f.check == "real-accuracy")
    case = failure.case
    assert case.windowed and case.window[0] >= 0 and case.total_rows("q") + case.total_rows("k") <= 12, case
    assert "window=" in failure.replay and f"window = {case.window}" in failure.snippet
    exec(compile(failure.snippet, "<snippet>", "exec"), {})
    printed = capsys.readouterr().out
    assert "out: damaged REAL rows []" not in printed and "out: damaged REAL rows [" in printed, printed
    finding = run_layout(adapt(window_left_ignored, "contract"), case)[0]
    right = torch_snippet(adapt("test_audit:oracle", "contract"), case, finding)
    exec(compile(right, "<snippet>", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.count("damaged REAL rows [], padding rows not 0 []") == 4, printed


def value_features_past_qk_dropped(q, k, v, *args, **kwargs):
    """Assumes v has q and k's head dim: out's features past it come back 0."""
    out = oracle(q, k, v, *args, **kwargs)
    return torch.cat([out[..., : q.shape[-1]], torch.zeros_like(out[..., q.shape[-1] :])], dim=-1)


def test_a_value_head_dim_bug_is_drawn_at_the_audits_head_dims_and_reproduced_in_plain_torch(capsys):
    """At `--head-dim 16,24` every layout has v of 24: a bug of v's own head dim is found, kept
    through shrinking (v of q's head dim would hide it), and shown by the plain-torch snippet."""
    profile = PROFILES["tiny"].at_head_dim(16, 24)
    assert all(random_case(random.Random(i), adapt(oracle, "contract"), profile).head_dim_v == 24 for i in range(20))
    result = fuzz(adapt("test_audit_fuzz:value_features_past_qk_dropped", "contract"), 4, seed=0, profile=profile)
    failure = next(f for f in result.failures if f.check == "real-accuracy")
    assert (failure.case.head_dim, failure.case.head_dim_v) == (16, 24) and "D, D_v = 16, 24" in failure.snippet
    assert result.profile == "tiny d16/24"
    exec(compile(failure.snippet, "<snippet>", "exec"), {})
    assert "out: damaged REAL rows [" in capsys.readouterr().out
    finding = run_layout(adapt(value_features_past_qk_dropped, "contract"), failure.case)[0]
    exec(compile(torch_snippet(adapt("test_audit:oracle", "contract"), failure.case, finding), "<snippet>", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.count("damaged REAL rows [], padding rows not 0 []") == 4, printed


@pytest.mark.slow  # a worker process importing the audit, then 32 layouts and shrinking in it: ~10 s
def test_progress_reports_the_layouts_so_far_with_failures_as_drawn(monkeypatch):
    """What a caller killed at its deadline keeps: every PROGRESS_SECONDS (0 here: every chunk)
    the layouts tried so far, each check's first failure as drawn, marked partial; once more
    when the search ends, before shrinking (which a kill may cut)."""
    fuzz_module = importlib.import_module(
        "varlen_workbench.workbench.audit.fuzz"
    )  # the package exports the function by that name

    monkeypatch.setattr(fuzz_module, "PROGRESS_SECONDS", 0)
    heard: list = []
    result = fuzz(
        adapt("test_audit:tail_unwritten", "contract"), 2 * fuzz_module.CHUNK, seed=3, isolate=True, progress=heard.append
    )
    assert [p.tried for p in heard] == [fuzz_module.CHUNK, 2 * fuzz_module.CHUNK, result.tried]
    assert heard[-1].partial.startswith("search ended, shrinking under way") and heard[0].partial.startswith("search under way")
    first = {f.check: f for f in heard[-1].failures}["tail-rows"]
    assert first.case == first.original and first.shrink_probes == 0  # as drawn
    assert {f.check for f in result.failures} == set(first.check for first in heard[-1].failures)
    assert not result.partial and result.to_dict()["search_seconds"] <= result.seconds
    assert "partial" in heard[0].to_dict() and "partial" not in result.to_dict()


def test_shrinking_stops_at_its_stop_time():
    """With a time limit the fuzzer ends within time_limit + SHRINK_SECONDS + PROBE_GRACE: past
    `stop_at`, neither the greedy pass nor the pass that drops unneeded sequences probes."""
    from varlen_workbench.workbench.audit.fuzz import shrink
    from varlen_workbench.workbench.layout import Case, Fill

    impl = adapt(tail_unwritten, "contract")
    case = Case((3, 0), seqlens_k=(3, 0), tail_q=2, heads=1, head_dim=16, fill=Fill.ZEROS)
    finding = next(f for f in run_layout(impl, case) if f.check == "tail-rows")
    assert shrink(impl, case, finding, PROFILES["tiny"], stop_at=time.time() - 1) == (case, finding, 0)
