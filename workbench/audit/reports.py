"""Upstream reports, ready to file, for audit-matrix findings that no post-mortem covers: the matrix
page renders each under "Report it upstream", and the paste-block battery runs its repro as shown."""

from __future__ import annotations

from varlen_workbench.workbench.upstream_report import Source, UpstreamReport

NESTED_REPRO = """
# SDPA on jagged nested tensors raises when every query sequence is empty
import torch
import torch.nn.functional as F


def jagged(lengths, heads=2, dim=64):  # (batch, heads, jagged length, dim) from packed rows and their lengths
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    values = torch.randn(int(offsets[-1]), heads, dim)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets).transpose(1, 2)


key, value = jagged([3, 2]), jagged([3, 2])
for lengths in ([0, 2], [0, 0]):  # one empty query sequence, then both
    try:
        out = F.scaled_dot_product_attention(jagged(lengths), key, value)
        print(f"queries {lengths}: output values {tuple(out.values().shape)}")
    except RuntimeError as error:
        print(f"queries {lengths}: RuntimeError: {error}")
"""

_MESSAGE = "to_padded_tensor: at least one constituent tensor should have non-zero numel"

NESTED_NO_REAL_QUERY = UpstreamReport(
    title="scaled_dot_product_attention on jagged nested tensors raises 'to_padded_tensor: at least one constituent "
    "tensor should have non-zero numel' when every query sequence is empty",
    file_at="https://github.com/pytorch/pytorch/issues/new",
    versions=("torch 2.13.0 (CPU)", "torch 2.11.0+cu130 on an NVIDIA H200: the same error, raised at the same line"),
    repro=NESTED_REPRO,
    prints=("queries [0, 2]: output values (2, 2, 64)", f"queries [0, 0]: RuntimeError: {_MESSAGE}"),
    expected="an empty output (values of shape (0, 2, 64)), as with one empty query sequence among others: a packed "
    "batch whose query rows are all padding (a decode step with nothing to do, a pipeline stage's empty micro-batch) "
    "has nothing to compute.",
    actual="`RuntimeError: to_padded_tensor: ...`. With no query row, the flash and memory-efficient kernels are "
    "refused (sequence length 0), the math fallback converts the jagged tensors to strided nested tensors and pads "
    "them, and padding a nested tensor whose every constituent is empty raises this error (`to_padded_tensor`'s own "
    "check).",
    shown="this repro, run as shown on a CPU (the paste-block battery); on the H200 the audit's no-real-query check "
    "raised it at `jagged_scaled_dot_product_attention`, `sdpa.py:917` (`data/gpu/audit-sdpa-nested.json`)",
    suspected=(
        Source(
            "torch/nested/_internal/sdpa.py",
            917,
            "torch 2.13.0 wheel (the record names the same line in 2.11.0)",
            "attn_out = torch._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)[0]",
        ),
        Source(
            "torch/nested/_internal/sdpa.py",
            905,
            "torch 2.13.0 wheel",
            "def get_strided_layout_nested_tensor(jagged_layout_nt):  # the MATH branch's conversion, before the call",
        ),
    ),
    fix="in `jagged_scaled_dot_product_attention`, return before choosing a backend when the query has no row "
    "(`query.values().shape[0] == 0`): an empty jagged output with the query's offsets and the value's head dim, "
    "which is what every backend computes for it.",
    related=(
        "pytorch#174939 (dense SDPA on zero-sized tensors crashed; PRs #174950 and #175000 proposed returning an empty "
        "output), a different path",
    ),
)

REPORTS = (NESTED_NO_REAL_QUERY,)
