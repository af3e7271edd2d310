"""The real-client check (varlen_workbench.workbench.instruments.realclient) and the transformers integration it drives (varlen_workbench.kernels.hf)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from varlen_workbench.kernels import caches, hf
from varlen_workbench.kernels.varlen import varlen_attention
from varlen_workbench.workbench.instruments import realclient as rc
from varlen_workbench.workbench.records import load_records, write_record
from varlen_workbench.workbench.reference import per_document_sdpa

SIZE = rc.SIZES["cpu"]
ROOT = Path(__file__).resolve().parent.parent


def test_pack_is_what_the_flattening_collator_gives():
    from transformers import DataCollatorWithFlattening

    inputs = rc.pack(SIZE)
    rows = sum(SIZE.documents)
    ids = inputs["input_ids"][0].tolist()
    features, start = [], 0
    for n in SIZE.documents:
        features.append({"input_ids": ids[start : start + n]})
        start += n
    expected = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features, return_tensors="pt")
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(inputs[name][:, :rows], expected[name]), name
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert torch.equal(inputs[name], expected[name].to(torch.int32)), name
    assert inputs["max_length_q"] == expected["max_length_q"]
    assert (inputs["labels"][0, rows:] == -100).all() and inputs["input_ids"].shape[1] == rows + SIZE.tail


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    """No metadata remembered from another test's forward."""
    monkeypatch.setattr(caches, "LAST", caches.Memo())


def _layout(**kwargs):
    return hf.step_metadata(kwargs.pop("batch", 1), kwargs.pop("q", 8), kwargs.pop("k", 8), torch.device("cpu"), **kwargs)


def test_layout_from_cu_seq_lens_leaves_tail_rows_out():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    layout = _layout(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=3, max_length_k=3, position_ids=torch.zeros(1, 8))
    assert layout.cu_seqlens_q is cu and layout.max_seqlen_q == 3 and layout.given[2] is None
    assert (layout.total_q, layout.total_k) == (8, 8) and layout.padding_to_fill()  # rows 5-7: TAIL


def test_layout_from_cu_seq_lens_without_max_lengths_reads_them():
    cu = torch.tensor([0, 3, 5], dtype=torch.int64)
    layout = _layout(cu_seq_lens_q=cu, max_length_q=torch.tensor(3))
    assert layout.cu_seqlens_k.tolist() == [0, 3, 5] and layout.cu_seqlens_k.dtype == torch.int32
    assert (layout.max_seqlen_q, layout.max_seqlen_k) == (3, 3)


def test_layout_from_position_ids_restarting_per_document():
    layout = _layout(position_ids=torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]]))
    assert layout.cu_seqlens_q.tolist() == [0, 3, 5, 8] and layout.max_seqlen_k == 3 and not layout.padding_to_fill()
    with pytest.raises(ValueError, match="must start every document at 0"):
        _layout(position_ids=torch.tensor([[4, 5, 0, 1, 0, 1, 2, 3]]))


@pytest.mark.parametrize("four_d", [False, True])
def test_layout_from_right_padding_is_the_padded_layout(four_d):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    if four_d:  # transformers 4.x: an additive causal mask, the dtype's minimum where masked
        visible = mask[:, None, None, :] & torch.ones(4, 4, dtype=torch.bool).tril()
        mask = torch.zeros(2, 1, 4, 4).masked_fill(~visible, torch.finfo(torch.float32).min)
    layout = _layout(batch=2, q=4, k=4, attention_mask=mask, position_ids=torch.arange(4)[None].expand(2, 4))
    assert layout.cu_seqlens_q.tolist() == [0, 3, 7] and layout.cu_seqlens_q_padded.tolist() == [0, 4, 8]
    assert layout.has_gaps() == (True, True)
    with pytest.raises(ValueError, match="pads on the left"):
        _layout(batch=2, q=4, k=4, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))


def test_a_mask_without_padding_is_a_plain_batch():
    layout = _layout(batch=2, q=3, k=3, attention_mask=torch.ones(2, 3))
    assert layout.cu_seqlens_q.tolist() == [0, 3, 6] and layout.given[2] is None and not layout.padding_to_fill()


def test_plain_batch_is_one_sequence_per_row_and_decoding_sees_the_cache():
    layout = _layout(batch=2, q=1, k=6)
    assert layout.cu_seqlens_q.tolist() == [0, 1, 2] and layout.cu_seqlens_k.tolist() == [0, 6, 12]


def test_the_layers_of_a_forward_share_its_metadata():
    """Every layer gets the same tensors from transformers: the same object, built once; new
    tensors (the next forward) or the same ones written in place build a new one."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    first = _layout(position_ids=positions)
    assert _layout(position_ids=positions) is first
    assert _layout(position_ids=positions.clone()) is not first
    again = _layout(position_ids=positions)
    positions[0, 3] = 3  # in place: the documents changed
    assert _layout(position_ids=positions) is not again


def test_attention_refuses_what_it_cannot_express():
    forward = hf.attention_forward(varlen_attention)
    q = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="no attention dropout"):
        forward(torch.nn.Module(), q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="soft-capping"):
        forward(torch.nn.Module(), q, q, q, None, softcap=30.0)


def test_transformers_keywords_become_the_contracts():
    seen = {}

    def varlen(q, k, v, *args, **kwargs):
        seen.update(shapes=(q.shape, k.shape), args=args, **kwargs)
        return q

    module = torch.nn.Module()
    module.is_causal = True
    query, key = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    out, weights = hf.attention_forward(varlen)(module, query, key, key, None, scaling=0.5, sliding_window=3)
    assert seen["shapes"] == ((10, 4, 16), (10, 2, 16))
    assert seen["args"][0].tolist() == [0, 5, 10] and seen["args"][2:] == (5, 5)
    assert seen["cu_seqlens_q_padded"] is None and seen["cu_seqlens_k_padded"] is None
    assert seen["causal"] is True and seen["scale"] == 0.5 and seen["window_size"] == (2, 0)  # 3 keys: itself and 2 back
    assert weights is None and torch.equal(out, query.transpose(1, 2))


def test_our_attention_gets_the_steps_metadata_and_narrower_values():
    """`varlen_attention` takes `metadata=`: the swap passes the object, not the boundaries; values
    may have another head dim than queries and keys (multi-latent attention)."""
    seen = {}

    def varlen(q, k, v, *args, metadata=None, **kwargs):
        seen.update(args=args, metadata=metadata, value=v.shape)
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1])

    query, key, value = torch.randn(1, 4, 6, 24), torch.randn(1, 2, 6, 24), torch.randn(1, 2, 6, 16)
    out, _ = hf.attention_forward(varlen)(torch.nn.Module(), query, key, value, None)
    assert seen["args"] == () and isinstance(seen["metadata"], hf.VarlenMetadata) and seen["value"] == (6, 2, 16)
    assert out.shape == (1, 6, 4, 16)


def test_register_without_transformers_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install transformers"):
        hf.register()


def test_register_makes_the_name_an_attn_implementation():
    from transformers import AttentionInterface

    assert hf.register() == hf.NAME and hf.NAME in AttentionInterface()


def test_kv_heads_repeated_for_a_function_without_gqa():
    """What torch 2.11's varlen_attn (no enable_gqa) gets: the same attention as GQA's."""
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    args = (cu, cu, 5, 5)

    def without_gqa(q, k, v, *args, **kwargs):
        assert q.shape[1] == k.shape[1] == v.shape[1]
        return per_document_sdpa(q, k, v, *args, **kwargs)

    expected = per_document_sdpa(q, k, v, *args, causal=True)
    torch.testing.assert_close(rc._repeat_kv(without_gqa)(q, k, v, *args, causal=True), expected)


FAST = ("transformers sdpa: math", "transformers sdpa, use_cache not disabled")


@pytest.fixture(scope="module")
def fast_report():
    """The check with the backends that need no interpreter: seconds."""
    return rc.check(SIZE, backends=(rc.BAR, *(rc.BY_NAME[n] for n in FAST)))


def test_bar_is_bf16_rounding_and_sdpa_meets_it(fast_report):
    report = fast_report
    assert 1e-4 < report.bar < 0.05, report.table()  # bf16 against float32: neither exact nor broken
    for memory in rc.MEMORIES:
        assert report.meets_bar(report.run("transformers sdpa: math", memory)), report.table()


def test_sdpa_with_a_kv_cache_attends_across_documents(fast_report):
    """transformers builds its packed mask only without a cache: documents then see each other."""
    run = fast_report.run("transformers sdpa, use_cache not disabled")
    assert run.finite and run.grad_error > 10 * rc.BAR_FACTOR * fast_report.bar, fast_report.table()


def test_record_round_trip(fast_report, tmp_path):
    write_record(tmp_path / rc.RECORD, fast_report.to_record(), command="test")
    (record,) = load_records(rc.RECORD, tmp_path)
    again = rc.Report.from_record(record)
    assert again.table() == fast_report.table() and again.size == fast_report.size


def test_the_committed_h200_record_reads_ours_under_todays_name():
    """Recorded when ours was the top-level package `kernels`: read back, its runs of ours are
    under the backend's name of today."""
    report = rc.load_h200()
    assert report is not None and {r.backend for r in report.runs} <= set(rc.BY_NAME)
    assert report.run(rc.OURS.name).status == "ran"


def test_unknown_memory_is_refused():
    with pytest.raises(ValueError, match="memories"):
        rc.check(SIZE, memories=("stale",))


@pytest.mark.slow
def test_one_line_swap_keeps_gradients_finite_and_within_the_bar():
    """A tiny Llama through attn_implementation="varlen_contract" (backend "auto": on the CPU the torch
    backend, as a user's CPU run gets it), TAIL rows, both memories, the notebook's four layers: a
    layer's TAIL rows feed the next one's attention."""
    report = rc.check(SIZE, backends=(rc.BAR, rc.OURS))
    for memory in rc.MEMORIES:
        run = report.run(rc.OURS.name, memory)
        assert run.status == "ran" and run.nonfinite == 0 and report.meets_bar(run), report.table()


@pytest.mark.slow
def test_right_padded_batch_matches_sdpa():
    """A padding mask becomes GAP rows of the padded layout: real tokens' logits match sdpa's."""
    size = dataclasses.replace(SIZE, layers=1)
    model = rc.llama(size)
    ids = torch.randint(1, size.vocab, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    logits = {}
    for name in ("sdpa", hf.register()):
        rc.set_implementation(model, name)
        with torch.no_grad():
            logits[name] = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(logits[hf.NAME][real], logits["sdpa"][real], atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # a fresh interpreter (torch, Triton, the project compiled): seconds; the full suite runs it
def test_kernels_run_on_cpu_tensors_when_records_are_imported_first():
    """varlen_workbench.workbench.records (through provenance) imports triton before the kernels: any order works."""
    code = (
        "import varlen_workbench.workbench.records, torch\n"
        "from varlen_workbench.kernels.varlen import varlen_attention\n"
        "q = torch.randn(6, 2, 16); cu = torch.tensor([0, 2, 6], dtype=torch.int32)\n"
        "print(varlen_attention(q, q, q, cu, cu, 4, 4, causal=True, backend='triton').shape)\n"  # "auto": torch
    )
    env = {**os.environ, "WORKBENCH_DEVICE": "cpu"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_command_line_writes_a_record_with_its_command(tmp_path, capsys):
    path = tmp_path / rc.RECORD
    assert rc.main(["--backends", "transformers sdpa: math", "--record", str(path)]) == 0
    (record,) = load_records(rc.RECORD, tmp_path)
    assert record["provenance"]["command"].startswith(
        "python -m varlen_workbench.workbench.instruments.realclient --backends 'transformers sdpa: math'"
    )
    assert [r["backend"] for r in record["runs"]] == [rc.BAR.name] * 2 + ["transformers sdpa: math"] * 2
    assert "| transformers sdpa: math | poisoned |" in capsys.readouterr().out


def test_flex_attention_is_cuda_only_because_torch_has_no_cpu_backward():
    """The reason the real-client check gives for leaving FlexAttention out on a CPU, as torch states it."""
    from torch.nn.attention.flex_attention import flex_attention

    backend = rc.BY_NAME["transformers flex_attention"]
    assert backend.available(torch.device("cpu")) == backend.cuda_only
    q, k, v = (torch.randn(1, 1, 8, 16, requires_grad=True) for _ in range(3))
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, k, v).sum().backward()
