"""Zig-zag context-parallel attention: layout, merge, and the audit's check on spawned gloo ranks."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from varlen_workbench.kernels.runtime import use_interpreter
from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.workbench.audit.checks import Verdict
from varlen_workbench.workbench.audit.context_parallel import context_parallel_check, cp_case, judge, padding_rule_study
from varlen_workbench.workbench.instruments.context_parallel import (
    LayoutError,
    ZigZag,
    check_cp_layout,
    context_parallel_attention,
    merge_partials,
    shard_thd,
    unshard_thd,
)
from varlen_workbench.workbench.layout import Case, Fill, cumulative, pack
from varlen_workbench.workbench.reference import reference_attention


@pytest.fixture
def one_rank_group():
    """A world of one, in this process: cp_size = 1 runs the whole path without spawning."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_zigzag_rows_and_local_layout():
    cu, cu_padded = cumulative([5, 3]), cumulative([8, 4])
    zigzag = ZigZag.of(cu, cu_padded, 2)  # chunks of 2 and 1 rows
    assert zigzag.rows(0, 14).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag.rows(1, 14).tolist() == [2, 3, 4, 5, 9, 10, 12, 13]  # TAIL rows stay on the last rank
    # Sequence 0 (5 real of 8): rank 0 holds positions 0-1 (real) and 6-7 (GAP); rank 1 2-3 and 4 (real), 5 (GAP).
    assert zigzag.local_cu(0)[0].tolist() == [0, 2, 3] and zigzag.local_cu(1)[0].tolist() == [0, 3, 5]
    assert zigzag.local_cu(1, halves=(0,))[0].tolist() == [0, 2, 3]
    index, cu_second, cu_second_padded = zigzag.second_halves(1)
    assert index.tolist() == [2, 3, 5] and cu_second.tolist() == [0, 1, 2] and cu_second_padded.tolist() == [0, 2, 3]


@pytest.mark.parametrize("cp_size", [2, 3])
def test_shards_tile_the_layout(cp_size):
    batch = pack(cp_case(Case((5, 0, 9), padded_q=(7, 0, 9), tail_q=4, fill=Fill.GARBAGE), cp_size), "cpu")
    cu, cu_padded = batch.cu_seqlens_q, batch.cu_seqlens_q_padded
    shards = [shard_thd(batch.q, cu, cu_padded, r, cp_size) for r in range(cp_size)]
    assert len({s.shape[0] for s in shards[:-1]}) == 1 and shards[-1].shape[0] == shards[0].shape[0] + 4
    assert torch.equal(unshard_thd(shards, cu, cu_padded, batch.q.shape[0]), batch.q.detach())


def test_layout_rule_names_the_sequence_and_the_fix():
    check_cp_layout(cumulative([8, 0, 4]), 2)
    with pytest.raises(LayoutError, match=r"sequence 1 has 6 rows .* not a multiple of 2 x cp_size = 4.*Pad each sequence"):
        check_cp_layout(cumulative([8, 6]), 2)
    with pytest.raises(ValueError, match="cp_size = 0 must be a positive int"):
        check_cp_layout(cumulative([8]), 0)


def test_merge_of_key_halves_is_attention_over_all_keys():
    """Two partials over disjoint keys merge to the whole; a row that sees no key in any partial
    merges to exactly 0 with lse -inf, and its gradients are exactly 0, never NaN."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(6, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu6, cu3 = cumulative([6]), cumulative([3])
    whole, whole_lse = reference_attention(q, k, v, cu6, cu6, 6, 6, return_lse=True)
    parts = [
        reference_attention(q, k[s], v[s], cu6, cu3, 6, 3, return_lse=True, validate=False) for s in (slice(0, 3), slice(3, 6))
    ]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    assert torch.allclose(out, whole) and torch.allclose(lse, whole_lse)
    masked = [torch.full((2, 2, 16), 1.0, requires_grad=True), torch.zeros(2, 2, 16, requires_grad=True)]
    lses = [torch.full((2, 2), float("-inf"), requires_grad=True) for _ in range(2)]
    out, lse = merge_partials(masked, lses)
    (out.sum() + lse.masked_fill(torch.isinf(lse), 0).sum()).backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (*masked, *lses))


def test_one_rank_is_the_kernel(one_rank_group):
    """cp_size = 1: one block, a merge of one partial: bit for bit the Triton kernel, lse included
    (the interpreter switch makes "auto" the Triton kernel on both sides)."""
    batch = pack(cp_case(Case((5, 3), padded_q=(6, 3), tail_q=2, causal=True, head_dim=16), 1), "cpu")
    cu, cu_padded = batch.cu_seqlens_q, batch.cu_seqlens_q_padded
    with use_interpreter():
        out, lse = context_parallel_attention(batch.q, batch.k, batch.v, cu, cu_padded, causal=True, return_lse=True)
        kernel_out, kernel_lse = batch.call(varlen_attention, return_lse=True)
    assert torch.equal(out, kernel_out) and torch.equal(lse, kernel_lse)


def test_wrong_shard_size_is_a_clear_error(one_rank_group):
    batch = pack(Case((4, 4), heads=2, head_dim=16), "cpu")
    with pytest.raises(ValueError, match=r"k has 6 rows on rank 0 .* pass shard_thd\(x, cu_seqlens"):
        context_parallel_attention(batch.q, batch.k[:6], batch.v, batch.cu_seqlens_q, batch.cu_seqlens_q_padded)


@pytest.mark.slow
def test_check_passes_on_two_ranks():
    result = context_parallel_check(fuzzed=1)
    assert result.verdict is Verdict.PASS, result.evidence
    assert result.evidence.startswith("gloo, 2 ranks, 3 layouts")


@pytest.mark.slow
def test_check_passes_on_three_ranks_bf16():
    result = context_parallel_check(cp_size=3, fuzzed=1, seed=1, dtype="bfloat16")
    assert result.verdict is Verdict.PASS, result.evidence


# -- planted bugs: the check must catch them (importable by name: the ranks are spawned) --------

PLANTED_CASE = Case((5, 3), padded_q=(6, 3), tail_q=3, causal=True, head_dim=16, fill=Fill.GARBAGE)


def forgets_tail(q, k, v, cu_seqlens, cu_seqlens_padded, **kwargs):
    """Writes only the sequence rows into a fresh buffer: TAIL rows on the last rank keep its contents."""
    out = context_parallel_attention(q, k, v, cu_seqlens, cu_seqlens_padded, **kwargs)
    rows = ZigZag.of(cu_seqlens.cpu(), cu_seqlens_padded.cpu(), dist.get_world_size()).sequence_rows
    full = torch.empty_like(out)
    full[:rows] = out[:rows]
    return full


def _naive_merge(outs, lses):
    lse = torch.logsumexp(torch.stack(lses), 0)  # -inf where every partial is -inf
    out = sum(torch.exp(p - lse).transpose(0, 1)[..., None] * o for p, o in zip(lses, outs))  # exp(-inf - -inf) = NaN
    return out.to(outs[0].dtype), lse


def nan_merge(*args, **kwargs):
    with mock.patch("varlen_workbench.workbench.instruments.context_parallel.merge_partials", _naive_merge):
        return context_parallel_attention(*args, **kwargs)


@pytest.mark.slow
def test_planted_nan_merge_fails():
    """(forgets_tail goes through `varlen-workbench audit`: test_workbench_audit_fails_a_planted_cp_bug.)"""
    _, ((_, findings),) = judge([cp_case(PLANTED_CASE, 2)], impl=nan_merge)
    assert "gap-rows" in {f.check for f in findings}, findings
    assert any("non-finite" in f.evidence for f in findings)


@pytest.mark.slow
def test_padding_rule_study():
    study = padding_rule_study(on_cpu=True)  # as te-thd-2892 runs it
    assert study.rule_needed and study.rows_on_no_rank == 6
    assert study.refusal.startswith("sequence 0 has 7 rows") and "Pad each sequence to a multiple of 4" in study.refusal
    # Causal and the dropped rows last in each sequence: what the held queries see is intact,
    # what the dropped queries gave the keys is lost.
    assert {f.evidence.split(": ")[1] for f in study.unchecked_findings} == {"dk", "dv"} == set(study.lost_tensors)


def test_on_cpu_ranks_interpret_on_a_gpu_machine(monkeypatch):
    """With fewer GPUs than ranks, a run needs on_cpu=True: its ranks then default to the CPU, where
    the kernels run through the Triton interpreter (over gloo); this process keeps its environment,
    and TRITON_INTERPRET is left alone."""
    import os

    from varlen_workbench.workbench.instruments import context_parallel as cp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    batch = pack(cp_case(PLANTED_CASE, 2), "cpu")
    with pytest.raises(ValueError, match="cp_size = 2 needs 2 GPUs for NCCL, and this machine has 1"):
        cp.run_context_parallel([(batch, batch.q)])
    seen = {}

    def spawn(fn, args, world_size, timeout_s):
        seen.update(backend=args[3], device=os.environ.get("WORKBENCH_DEVICE"), interpret=os.environ.get("TRITON_INTERPRET"))
        raise RuntimeError("spawned")

    monkeypatch.setattr(cp, "_spawn", spawn)
    before = {name: os.environ.get(name) for name in ("WORKBENCH_DEVICE", "TRITON_INTERPRET")}
    with pytest.raises(RuntimeError, match="spawned"):
        cp.run_context_parallel([(batch, batch.q)], on_cpu=True)
    assert seen == {"backend": "gloo", "device": "cpu", "interpret": before["TRITON_INTERPRET"]}
    assert {name: os.environ.get(name) for name in before} == before


def test_main_records_the_check_and_the_study(tmp_path, monkeypatch):
    """The record command: both results and the command that reproduces them (the runs themselves are tested above)."""
    from varlen_workbench.workbench.audit import context_parallel as audit_cp
    from varlen_workbench.workbench.audit.checks import CheckResult
    from varlen_workbench.workbench.records import read_record

    check = CheckResult(audit_cp.NAME, Verdict.PASS, "evidence")
    study = audit_cp.PaddingRuleStudy(
        2,
        "gloo",
        PLANTED_CASE,
        PLANTED_CASE,
        (),
        "refused",
        (audit_cp.Finding("real-accuracy", "rank 0 of 2: dk: error 1 > bound 0.1"),),
        6,
    )
    monkeypatch.setattr(audit_cp, "context_parallel_check", lambda **kwargs: check)
    monkeypatch.setattr(audit_cp, "padding_rule_study", lambda cp_size, **kwargs: study)
    path = tmp_path / "cp.json"
    assert audit_cp.main(["--cp-size", "2", "--record", str(path)]) == 0
    record = read_record(path)
    assert record["check"]["verdict"] == "pass" and record["padding_rule"]["rows_on_no_rank"] == 6
    assert (
        record["provenance"]["command"]
        == f"python -m varlen_workbench.workbench.audit.context_parallel --cp-size 2 --record {path}"
    )


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--cp-size", "1"], {}, "--cp-size 1: context parallelism splits sequences over at least 2 ranks"),
        (["--fuzzed", "-1"], {}, "--fuzzed -1: the number of fuzzed layouts is 0 or more"),
        (["--record", "."], {}, r"--record \. is a folder; name the JSON file"),
        ([], {"LOCAL_RANK": "0"}, "not under torchrun: it spawns its --cp-size ranks itself"),
    ],
)
def test_main_argument_errors(argv, env, message, monkeypatch, capsys):
    """Bad arguments exit 2 with the argument and the fix, before any rank starts."""
    from varlen_workbench.workbench.audit import context_parallel as audit_cp

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(audit_cp, "context_parallel_check", lambda **kwargs: pytest.fail("ran despite the bad argument"))
    with pytest.raises(SystemExit) as exit_:
        audit_cp.main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_main_refuses_more_ranks_than_gpus(monkeypatch, capsys):
    """On a GPU machine each rank needs a GPU of its own: no silent fall-back to gloo."""
    from varlen_workbench.workbench.audit import context_parallel as audit_cp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit):
        audit_cp.main(["--cp-size", "2"])
    assert "--cp-size 2: cp_size = 2 needs 2 GPUs for NCCL, and this machine has 1" in capsys.readouterr().err


# -- the audit's entry: `varlen-workbench audit` runs the check on a context-parallel target ----------

CP_TARGET = "varlen_workbench.workbench.instruments.context_parallel:context_parallel_attention"


def test_audit_calls_a_cp_target_only_through_its_check():
    """A context-parallel attention is recognised by its call and gets the context-parallel check
    by default, a single-process one every other check. Asked for anyway, the single-process
    checks and the fuzzer are n/a for a CP attention (never called in one process), and the
    context-parallel check is n/a for a single-process one; the matrix (single-process rows)
    has no column for it."""
    from varlen_workbench.workbench.audit import CHECKS, adapt, audit
    from varlen_workbench.workbench.audit.matrix import CORRECTNESS
    from varlen_workbench.workbench.audit.plain import plain_attention

    cp, plain = adapt(CP_TARGET), adapt(plain_attention, "contract")
    assert cp.adapter.name == "context-parallel"
    assert [n for n, c in CHECKS.items() if c.suits(cp)] == ["context-parallel"]
    assert [n for n, c in CHECKS.items() if c.suits(plain)] == [n for n in CHECKS if n != "context-parallel"]
    report = audit(cp, budget=20, checks=[n for n in CHECKS if n != "context-parallel"])
    assert report.fuzz is None and {r.verdict for r in report.results} == {Verdict.NA}
    assert "runs on the ranks of a process group" in report.results[0].evidence
    refused = audit(plain, budget=0, checks=["context-parallel"]).result("context-parallel")
    assert refused.verdict is Verdict.NA and "plain_attention is a single-process attention" in refused.evidence
    assert "context-parallel" not in CORRECTNESS

    def local_cp_attention(q, k, v, cu_seqlens, cu_seqlens_padded, *, causal=False, validate=True, group=None):
        return context_parallel_attention(q, k, v, cu_seqlens, cu_seqlens_padded, causal=causal, validate=validate)

    unimportable = audit(local_cp_attention, budget=0).result("context-parallel")
    assert unimportable.verdict is Verdict.NA and "not importable as 'module:function'" in unimportable.evidence


@pytest.mark.slow
def test_workbench_audit_fails_a_planted_cp_bug(capsys):
    """`varlen-workbench audit` on a CP attention that leaves TAIL rows unwritten: exit 1, the check's FAIL
    names the rank and the rows."""
    from varlen_workbench.workbench.cli.main import main

    target = f"{forgets_tail.__module__}:forgets_tail"
    assert main(["audit", target, "--adapter", "context-parallel", "--checks", "context-parallel"]) == 1
    out = capsys.readouterr().out
    assert re.search(
        r"context-parallel +FAIL +gloo, 2 ranks, .*tail-rows: rank 1 of 2: \w+: \d+ non-finite values in \d+ TAIL rows", out
    )
    assert "FAILED: context-parallel" in out
