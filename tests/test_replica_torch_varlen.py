"""The replica of torch varlen_attn's padding bug: broken exactly where upstream is, right elsewhere.

Under poisoned memory every row the kernels never write is NaN, so "TAIL rows are NaN, REAL rows
match the fp64 oracle" is a deterministic statement about which rows are written.
"""

import inspect

import pytest
import torch

from varlen_workbench.kernels.replicas.torch_varlen import replica_varlen_attn
from varlen_workbench.workbench.audit import adapt
from varlen_workbench.workbench.instruments.poison import poisoned_memory
from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.probes import probe

# Through the same adapter that drives torch's own varlen_attn (2.10 or 2.11+ signature).
replica = adapt(replica_varlen_attn, "torch-varlen")

TENSORS = ("out", "dq", "dk", "dv")

CASES = [
    pytest.param(
        Case(seqlens_q=(18, 36, 64), tail_q=2, tail_k=2, heads=2, head_dim=32, dtype="float16"), id="seed-layout/8-fp16"
    ),
    pytest.param(
        Case(seqlens_q=(70, 5), tail_q=9, tail_k=3, heads=2, head_dim=16, dtype="float32", causal=True),
        id="causal-fp32-multiblock",
    ),
    pytest.param(
        Case(
            seqlens_q=(9, 20),
            seqlens_k=(30, 4),
            tail_q=1,
            tail_k=5,
            heads=4,
            kv_heads=2,
            head_dim=32,
            dtype="bfloat16",
            causal=True,
        ),
        id="gqa-cross-bf16-causal",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_poisoned_tail_is_nan_and_real_rows_match_oracle(case):
    record = probe(replica, pack(case), poisoned=True)
    for name in TENSORS:
        rows = case.tail_q if name in ("out", "dq") else case.tail_k
        heads = case.heads if name in ("out", "dq") else (case.kv_heads or case.heads)
        # Every element of every TAIL row: the kernels never touch them.
        assert record.nonfinite[name]["TAIL"] == rows * heads * case.head_dim, name
    assert record.real_finite
    assert record.real_within_bound, {n: str(e) for n, e in record.errors.items()}


def test_without_tail_rows_the_replica_is_correct_even_poisoned():
    record = probe(replica, pack(CASES[0].values[0].with_(tail_q=0, tail_k=0)), poisoned=True)
    assert record.nonfinite_in("REAL") == 0 and record.nonfinite_in("TAIL") == 0
    assert record.real_within_bound


def test_nan_comes_from_memory_not_from_inputs():
    """Padding inputs hold zeros here: the NaN in every TAIL row can only be the poisoned allocation."""
    case = Case(seqlens_q=(12, 7), tail_q=4, tail_k=4, heads=1, head_dim=16, fill=Fill.ZEROS)
    record = probe(replica, pack(case), poisoned=True, reference=False)
    for name in TENSORS:
        assert torch.isnan(record.tensors[name][-4:]).all(), name
        assert torch.isfinite(record.tensors[name][:-4]).all(), name


def test_torch_style_call_shape_and_errors():
    batch = pack(Case(seqlens_q=(5, 6), tail_q=1, tail_k=1, heads=2, kv_heads=1, head_dim=16))
    q, k, v = (t.detach() for t in (batch.q, batch.k, batch.v))
    args = (batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        replica_varlen_attn(q, k, v, *args)
    out = replica_varlen_attn(q, k, v, *args, True, enable_gqa=True)  # is_causal positional, as in 2.10
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="query must be 3-D"):
        replica_varlen_attn(q.flatten(1), k, v, *args)
    assert list(inspect.signature(replica_varlen_attn).parameters)[:8] == [
        "query",
        "key",
        "value",
        "cu_seq_q",
        "cu_seq_k",
        "max_q",
        "max_k",
        "is_causal",
    ]


def test_poisoned_runs_are_deterministic():
    batch = pack(CASES[0].values[0])
    first, second = (probe(replica, batch, poisoned=True, reference=False) for _ in range(2))
    for name in TENSORS:
        assert torch.equal(first.tensors[name].nan_to_num(nan=7.0), second.tensors[name].nan_to_num(nan=7.0)), name


def test_custom_ops_compile_without_graph_breaks():
    """Like upstream (a custom op, no host read), the replica traces into one graph."""
    batch = pack(Case(seqlens_q=(5, 6), tail_q=2, tail_k=2, heads=1, head_dim=16))
    torch._dynamo.reset()
    compiled = torch.compile(replica_varlen_attn, fullgraph=True, backend="eager")
    with poisoned_memory():
        out = compiled(*(t.detach() for t in (batch.q, batch.k, batch.v)), batch.cu_seqlens_q, batch.cu_seqlens_k, 6, 6)
    torch._dynamo.reset()
    assert torch.isnan(out[-2:]).all() and torch.isfinite(out[:-2]).all()


def _seqused(
    q, k, v, cu_q, cu_k, max_q, max_k, *, cu_seqlens_q_padded, cu_seqlens_k_padded, causal=False, window_size=(-1, -1), scale=None
):
    """The replica called as FlashAttention-4 is with padding between sequences: slot starts as
    boundaries, the real lengths as seqused."""
    return replica_varlen_attn(
        q, k, v, cu_seqlens_q_padded, cu_seqlens_k_padded, max_q, max_k, causal, scale=scale, window_size=window_size,
        enable_gqa=True, seqused_q=cu_q.diff(), seqused_k=cu_k.diff(),
    )  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        Case((5, 0, 9), seqlens_k=(7, 3, 9), tail_q=2, tail_k=1, heads=2, head_dim=16, dtype="float16", window=(3, 1)),
        Case((9, 20), tail_q=3, tail_k=3, heads=4, kv_heads=2, head_dim=16, dtype="float16", causal=True, window=(4, 0)),
    ],
    ids=["window-cross-empty", "window-causal-gqa"],
)
def test_windows_are_attended_as_the_contract_says(case):
    """window_size (FlashAttention's (left, right), bottom-right aligned): REAL rows right, rows with no key 0."""
    record = probe(replica, pack(case), poisoned=True)
    assert record.real_finite and record.real_within_bound, {n: str(e) for n, e in record.errors.items()}
    assert record.nonfinite_in("TAIL") > 0  # the bug stays where it is


def test_seqused_leaves_the_rest_of_each_slot_unwritten():
    """With seqused, sequence i uses the first seqused[i] rows of its slot: the rows past it (GAP) and past
    the last slot (TAIL) are never written, REAL rows are right."""
    case = Case((5, 3, 9), padded_q=(8, 4, 12), padded_k=(8, 4, 12), tail_q=2, tail_k=2, heads=2, head_dim=16, dtype="float16")
    record = probe(_seqused, pack(case), poisoned=True)
    for name in TENSORS:
        rows = {"GAP": 3 + 1 + 3, "TAIL": 2}
        assert {r: record.nonfinite[name][r] for r in rows} == {r: n * 2 * 16 for r, n in rows.items()}, name
    assert record.real_finite and record.real_within_bound, {n: str(e) for n, e in record.errors.items()}
    with pytest.raises(ValueError, match="seqused_q and seqused_k together"):
        batch = pack(case)
        replica_varlen_attn(batch.q, batch.k, batch.v, *batch.args()[3:], seqused_q=batch.cu_seqlens_q.diff())
