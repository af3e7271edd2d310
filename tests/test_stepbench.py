"""The training-step benchmark (varlen_workbench.workbench.bench.stepbench) on the CPU: the batches it builds, what
transformers hands the swap from them, the CPU smoke run (ours by default, there the torch backend,
and pinned to the Triton kernel, interpreted, against padded SDPA, within a bound of a float64
step), and its record as the performance page reads it (varlen_workbench.workbench.bench.step_report)."""

from __future__ import annotations

import math

import pytest
import torch

from varlen_workbench.kernels import hf
from varlen_workbench.workbench.bench import step_record as names
from varlen_workbench.workbench.bench import step_report as br
from varlen_workbench.workbench.bench import stepbench as sb
from varlen_workbench.workbench.instruments import realclient
from varlen_workbench.workbench.instruments.tinylm import dense_attention
from varlen_workbench.workbench.records import write_record

SHAPE = sb.SHAPES["cpu"]
CPU = torch.device("cpu")


def test_the_gpu_shape_is_the_issues_model_and_batch():
    shape = sb.SHAPES["h200"]
    s = shape.size
    assert (s.layers, s.hidden, s.intermediate, s.heads, s.kv_heads, s.head_dim, s.vocab) == (8, 2048, 5632, 16, 4, 128, 32000)
    assert (shape.lengths, shape.dtype, s.tail) == ((64, 4096), "bfloat16", 0)
    documents = s.documents
    assert sum(documents) == 16384 and max(documents) <= 4096 and min(documents[:-1]) >= 64  # the last is cut to fit


def test_packed_and_padded_batches_hold_the_same_documents_and_predictions():
    documents = sb.document_tokens(SHAPE)
    packed, padded = sb.packed_inputs(documents, CPU), sb.padded_inputs(documents, CPU)
    lengths = [len(d) for d in documents]
    assert packed["cu_seq_lens_q"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert packed["max_length_q"] == max(lengths) == padded["input_ids"].shape[1]
    assert padded["input_ids"].shape[0] == len(documents)
    real = padded["attention_mask"].bool()
    assert torch.equal(padded["input_ids"][real], packed["input_ids"][0])
    # transformers shifts labels by one: both count each document's tokens after its first.
    predicted = lambda labels: int((labels[..., 1:] != -100).sum())
    assert predicted(packed["labels"]) == predicted(padded["labels"]) == sum(n - 1 for n in lengths)


def test_transformers_hands_every_layer_the_collators_keywords():
    """transformers (5.24 here) passes the model's extra keywords through to the attention function
    of every layer: the swap receives the collator's boundaries, not ones rebuilt from position_ids."""
    import transformers

    packed = sb.packed_inputs(sb.document_tokens(SHAPE), CPU)
    seen, passed = [], []

    def probe(module, query, key, value, attention_mask, **kwargs):
        passed.append(set(kwargs))
        return hf.attention_forward(recording)(module, query, key, value, attention_mask, **kwargs)

    def recording(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        seen.append((cu_seqlens_q, max_seqlen_q, kwargs["cu_seqlens_q_padded"]))
        return dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)

    transformers.AttentionInterface.register("stepbench_probe", probe)
    model = SHAPE.model(CPU)
    realclient.set_implementation(model, "stepbench_probe")
    with torch.no_grad():
        model(**packed)
    assert len(seen) == SHAPE.size.layers
    assert all({"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= p for p in passed)
    for cu, longest, padded in seen:
        assert torch.equal(cu, packed["cu_seq_lens_q"]) and longest == packed["max_length_q"] and padded is None


def test_every_batch_kind_reaches_the_swap_as_its_layout():
    documents = sb.document_tokens(SHAPE)
    cu = sb.packed_inputs(documents, CPU)["cu_seq_lens_q"]
    seen = []

    def recording(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        seen.append(
            (
                cu_seqlens_q.tolist(),
                (kwargs["cu_seqlens_q_padded"] if kwargs["cu_seqlens_q_padded"] is not None else cu_seqlens_q).tolist(),
            )
        )
        return dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)

    model = SHAPE.model(CPU)
    sb.Implementation("recording", "stepbench_test_recording", lambda: recording).select(model)
    rows, longest, plain = len(documents), max(len(d) for d in documents), sum(map(len, documents)) // sb.PLAIN_ROWS
    expected = {
        "cu_seq_lens": (cu.tolist(), cu.tolist()),
        "position_ids": (cu.tolist(), cu.tolist()),  # the boundaries rebuilt from position_ids restarting at 0
        "right-padded": (cu.tolist(), [i * longest for i in range(rows + 1)]),  # padding rows: GAP rows in place
        "plain": ([i * plain for i in range(sb.PLAIN_ROWS + 1)],) * 2,  # each row one sequence
    }
    for kind in sb.BATCH_KINDS:
        seen.clear()
        with torch.no_grad():
            model(**sb.batch_inputs(kind, documents, CPU))
        assert seen == [expected[kind]] * SHAPE.size.layers, kind
    with pytest.raises(ValueError, match="is not one of"):
        sb.batch_inputs("left-padded", documents, CPU)


def test_batch_syncs_counts_each_kind_and_none_on_a_cpu():
    model = SHAPE.model(CPU)
    impl = sb.Implementation("dense", "stepbench_test_dense", lambda: dense_attention)
    found = sb.batch_syncs(model, sb.document_tokens(SHAPE), CPU, impl)
    assert list(found) == list(sb.BATCH_KINDS)
    assert all(syncs["host_syncs"] == 0 for syncs in found.values()), found


@pytest.fixture(scope="module")
def baseline():
    """The float64 reference loss and padded SDPA's float32 row, with the model and batches."""
    model = SHAPE.model(CPU)
    documents = sb.document_tokens(SHAPE)
    packed, padded = sb.packed_inputs(documents, CPU), sb.padded_inputs(documents, CPU)
    sdpa = sb.measure(sb.BY_NAME[names.PADDED_SDPA], model, padded, CPU, iters=0, profile=True)
    return sb.reference_loss(SHAPE), sdpa, model, packed


def _leaky(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    """The packed row as one causal sequence: every document sees the ones before it."""
    whole = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    return dense_attention(q, k, v, whole, whole, q.shape[0], q.shape[0], **kwargs)


@pytest.mark.parametrize(("attention", "within"), [(dense_attention, True), (_leaky, False)])
def test_the_loss_bound_passes_the_contract_and_fails_a_leak_across_documents(baseline, attention, within):
    reference, sdpa, model, packed = baseline
    impl = sb.Implementation(f"stepbench_test_{attention.__name__}", f"stepbench_test_{attention.__name__}", lambda: attention)
    row = sb.measure(impl, model, packed, CPU, iters=0, profile=False)
    check = sb.loss_check(row.loss, sdpa.loss, reference, SHAPE)
    assert check.within is within, check


def test_the_profiled_step_counts_no_sync_on_a_cpu(baseline):
    _, sdpa, _, _ = baseline
    assert sdpa.status == "ran" and math.isfinite(sdpa.loss)
    assert sdpa.syncs["host_syncs"] == 0 and set(sdpa.syncs["by_owner"]) == {"ours", "transformers", "other"}


def test_an_implementation_that_raises_is_a_failed_row_with_its_error(baseline):
    _, _, model, packed = baseline

    def refuses(*args, **kwargs):
        raise ValueError("cannot run this call")

    row = sb.measure(sb.Implementation("refuses", "stepbench_test_refuses", lambda: refuses), model, packed, CPU, iters=0)
    assert (row.status, row.detail) == ("failed", "ValueError: cannot run this call")


@pytest.mark.slow
def test_cpu_smoke_run(baseline):
    """The harness end to end on the CPU: ours by default (the torch backend) and pinned to the Triton
    kernel (interpreted), the GPU-only implementations skipped with their reasons, every loss
    finite, ours within the bound."""
    reference, sdpa, _, _ = baseline
    found = sb.run(SHAPE, CPU, iters=0, profile=False)
    rows = {r.impl: r for r in found.rows}
    assert list(rows) == [impl.name for impl in sb.IMPLEMENTATIONS]
    for name in (names.OURS_FA4, names.BARE_FA4):
        assert rows[name].status == "skipped" and "FlashAttention-4" in rows[name].detail
    assert rows[names.VARLEN_ATTN].status == "skipped" and "CUDA only" in rows[names.VARLEN_ATTN].detail
    ran = [r for r in found.rows if r.status == "ran"]
    assert [r.impl for r in ran] == [names.DEFAULT, names.TRITON, names.PADDED_SDPA]
    assert all(math.isfinite(r.loss) for r in ran)
    assert rows[names.PADDED_SDPA].loss == sdpa.loss  # the same model and batch as the fixture's
    # On CPU tensors the default is the torch backend (a GPU's default without FlashAttention-4, the
    # Triton kernel, is tests/test_kernel_fa4.py's): each of ours within the bound of the float64 step.
    for name in (names.DEFAULT, names.TRITON):
        check = sb.loss_check(rows[name].loss, sdpa.loss, reference, SHAPE)
        assert check.within, (name, check)


def test_the_record_round_trips_and_names_what_did_not_run(tmp_path):
    found = sb.run(SHAPE, CPU, iters=0, profile=False, impls=[names.PADDED_SDPA, names.BARE_FA4, names.VARLEN_ATTN])
    path = tmp_path / "train-step.json"
    write_record(path, found.to_record(), command="test")
    record = br.load_train_step(path)
    assert record["shape"]["size"]["documents"] == list(SHAPE.size.documents) and record["padded_shape"] == [
        len(SHAPE.size.documents),
        max(SHAPE.size.documents),
    ]
    text = br.format_train_step(record)
    assert "skipped: FlashAttention-4 (CuTe DSL) runs on CUDA GPUs only" in text
    assert "not judged: the default >= 1.5x transformers sdpa, right-padded (the default was not timed)" in text


def test_the_command_line_refuses_what_it_cannot_time(capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU these would run the benchmark")
    assert sb.main(["--shape", "h200"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sb.main(["--shape", "cpu", "--iters", "5"])
    assert "time at least 20 steps" in capsys.readouterr().err


# -- reading a record (the performance page) ---------------------------------------------------


def _row(impl, median, fastest, syncs=None, status="ran", detail=""):
    return {
        "impl": impl,
        "status": status,
        "detail": detail,
        "loss": 10.4 if status == "ran" else None,
        "median_ms": median,
        "min_ms": fastest,
        "host_ms": 1.0 if median else None,
        "iters": 20 if median else 0,
        "peak_mb": 30000.0 if median else None,
        "resting_mb": 1000.0 if median else None,
        "syncs": syncs,
    }


def _syncs(forward, backward, example="kernels/hf.py(95): packed_layout"):
    """A SyncCount summary from {owner: n} per phase."""
    by_owner = {o: forward.get(o, 0) + backward.get(o, 0) for o in ("ours", "transformers", "other")}
    return {
        "host_syncs": sum(by_owner.values()),
        "by_owner": by_owner,
        "by_phase": {
            "forward": {**dict.fromkeys(by_owner, 0), **forward},
            "backward": {**dict.fromkeys(by_owner, 0), **backward},
        },
        "calls": {"stream sync": sum(by_owner.values())},
        "examples": {"ours": ["cudaStreamSynchronize", example]},
    }


SYNCS = _syncs({"ours": 1, "transformers": 1}, {"other": 1})


def _record(**overrides):
    rows = {
        names.DEFAULT: _row(names.DEFAULT, 100.0, 95.0, SYNCS),
        names.TRITON: _row(names.TRITON, 104.0, 99.0, SYNCS),
        names.OURS_FA4: _row(names.OURS_FA4, 100.5, 95.5, SYNCS),
        names.BARE_FA4: _row(names.BARE_FA4, 98.0, 96.0),
        names.VARLEN_ATTN: _row(names.VARLEN_ATTN, 99.0, 90.0),
        names.PADDED_SDPA: _row(names.PADDED_SDPA, 160.0, 150.0),
    }
    rows.update(overrides)
    return {
        "kind": "train-step",
        "shape": {"size": {"layers": 8, "documents": [4000, 3000, 9384]}},
        "padded_shape": [3, 9384],
        "rows": list(rows.values()),
        "batch_syncs": {
            "cu_seq_lens": SYNCS,
            "position_ids": _syncs({"ours": 8, "transformers": 1}, {}, "kernels/hf.py(146): packed_layout"),
            "right-padded": {"error": "ValueError: cannot"},
        },
        "provenance": {"device": "NVIDIA H200", "commit": "abc1234"},
    }


def test_ratios_are_each_peers_step_over_the_defaults():
    ratios = names.train_step_ratios(_record()["rows"])
    assert ratios[names.BARE_FA4] == {"median": 0.98, "fastest": 96.0 / 95.0}
    assert ratios[names.PADDED_SDPA] == {"median": 1.6, "fastest": 150.0 / 95.0}
    assert set(ratios) == {names.TRITON, names.OURS_FA4, names.BARE_FA4, names.VARLEN_ATTN, names.PADDED_SDPA}


def test_targets_judged_on_medians_and_fastest_steps():
    medians, fastest = br.train_step_targets(_record())
    verdicts = {t.name: (t.measured, t.met) for t in medians[:3]}
    assert verdicts == {
        f"training step: the default >= 0.97x {names.BARE_FA4}": (0.98, True),
        f"training step: the default >= 1.0x {names.VARLEN_ATTN}": (0.99, False),
        f"training step: the default >= 1.5x {names.PADDED_SDPA}": (1.6, True),
    }
    assert [t.met for t in fastest] == [True, False, True]  # 96/95, 90/95, 150/95
    assert all(t.worst_case == "3 documents, 16384 tokens packed" for t in medians[:3])
    syncs = medians[3]  # a count, judged once
    assert (syncs.measured, syncs.met, syncs.worst_case) == (8, False, "position_ids")
    assert syncs.name == "host syncs of our code per forward <= 1, every batch kind (default backend)"


def test_the_batch_kinds_table_and_examples():
    table = br.batch_syncs_table(_record())
    assert table.rows == (
        ("cu_seq_lens", "3", "1 / 1 / 1", "1 / 0", "1 / 0"),
        ("position_ids", "9", "8 / 1 / 0", "8 / 0", "1 / 0"),
        ("right-padded", "failed: ValueError: cannot", "-", "-", "-"),
    )
    text = br.format_train_step(_record())
    assert f"{names.DEFAULT}, position_ids batch, ours: cudaStreamSynchronize\n    kernels/hf.py(146): packed_layout" in text
    record = _record()
    del record["batch_syncs"]
    assert "not judged: host syncs of our code per forward" in br.format_train_step(record)


def test_a_skipped_peer_is_shown_with_its_reason_and_left_unjudged():
    why = "FlashAttention-4 is not installed here (ModuleNotFoundError: No module named 'flash_attn')"
    record = _record(**{names.BARE_FA4: _row(names.BARE_FA4, None, None, status="skipped", detail=why)})
    medians, _ = br.train_step_targets(record)
    assert [t.name for t in medians[:2]] == [
        f"training step: the default >= 1.0x {names.VARLEN_ATTN}",
        f"training step: the default >= 1.5x {names.PADDED_SDPA}",
    ]
    text = br.format_train_step(record)
    assert f"not judged: the default >= 0.97x {names.BARE_FA4} (skipped: {why})" in text
    assert f"skipped: {why}" in str(br.train_step_table(record))


def test_the_table_has_a_line_per_implementation_with_syncs_by_owner_and_phase():
    table = br.train_step_table(_record())
    assert table.header[3:6] == ("host syncs", "ours / transformers / other", "forward / backward")
    default = next(r for r in table.rows if r[0] == names.DEFAULT)
    assert default[1:6] == ("100.000 (95.000)", "-", "3", "1 / 1 / 1", "2 / 1")
    sdpa = next(r for r in table.rows if r[0] == names.PADDED_SDPA)
    assert sdpa[2] == "1.600x (1.579x)" and sdpa[3:6] == ("-", "-", "-")
    skipped = _record(**{names.BARE_FA4: _row(names.BARE_FA4, None, None, status="skipped", detail="no FA4")})
    assert next(r for r in br.train_step_table(skipped).rows if r[0] == names.BARE_FA4)[1:] == ("-",) * 7 + ("skipped: no FA4",)
    assert "on NVIDIA H200" in table.title and len(table.rows) == 6
    assert "kernels/hf.py(95): packed_layout" in br.format_train_step(_record())
