"""What sdpa-cudnn-masked-rows offers upstream: the audit's sliding-window failure on cuDNN is this page's
mechanism, which pytorch#177842 reports; so not a new issue but a comment there, with a sliding-window
repro and the question a maintainer can answer (does the fix give these rows 0?)."""

from __future__ import annotations

from varlen_workbench.postmortems.sdpa_cudnn_masked_rows.cases import CUDNN_FILL, META, PT
from varlen_workbench.workbench.upstream_report import Source, UpstreamReport

REPRO = """
# cuDNN SDPA: a query row that a sliding-window boolean mask leaves without a key is not 0
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"  # cuDNN needs a GPU
q = torch.randn(1, 2, 6, 64, device=device, dtype=torch.float16)  # 6 queries
k, v = (torch.randn(1, 2, 3, 64, device=device, dtype=torch.float16) for _ in range(2))  # 3 keys
# Window (left 2, right 1) aligned bottom-right, as FlashAttention has it: query i sees keys i - 3 - 2 .. i - 3 + 1.
i, j = torch.arange(6, device=device)[:, None], torch.arange(3, device=device)[None, :]
mask = (j >= i - 5) & (j <= i - 2)  # rows 0 and 1 see no key
for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    print(f"{backend.name}: max |out| on the rows without a key = {out[..., :2, :].abs().max().item():.3f}")
"""

REPORT = UpstreamReport(
    title="(a comment on pytorch#177842) a sliding-window boolean mask that leaves rows without a key hits the same "
    "finite fill on cuDNN",
    file_at=f"{PT}/issues/177842",
    versions=("torch 2.11.0+cu130 with its bundled cuDNN 9.19, NVIDIA H200 (sm90)", "not run on 2.12 or later"),
    repro=REPRO,
    prints=(
        "CUDNN_ATTENTION: max |out| on the rows without a key = 2.131",
        "MATH: max |out| on the rows without a key = 0.000",
    ),
    expected="0 on the rows that see no key, as the math and memory-efficient backends return (`_safe_softmax`, "
    "pytorch#131060/#133882), with no gradient into the keys they must not see.",
    actual=f"cuDNN fills the boolean mask's `False` with the finite {CUDNN_FILL:g}, so on a row where every key is "
    "masked every score moves by the same constant and the row attends every key slot. A sliding window produces such "
    "rows whenever it is aligned bottom-right over more queries than keys. Please check that the fix of #177868 "
    "gives them 0, and consider this layout as a regression test.",
    shown="the H200 audit's sliding-window check on the cuDNN backend (torch 2.11.0+cu130, `data/gpu/audit-sdpa-cudnn.json`: "
    "out error 0.596 on a 300-query, 257-key sequence under window (37, 5)); our replica of the fill on a CPU "
    "reproduces that error, and every row it gets wrong is a row the window leaves without a key (the cell below); "
    "the printout is this repro as shown on a CPU, with the replica standing in for cuDNN (this page's paste-block "
    "battery); cuDNN given a float mask of -65504 returns the boolean mask's result bit for bit "
    "(`data/gpu/sdpa-cudnn-masked-rows-h200.json`)",
    suspected=(
        Source(
            "aten/src/ATen/native/transformers/attention.cpp",
            None,
            "the diff of pytorch#140837 (2024-11)",
            "return at::where(attn_mask->logical_not(), -65504.0, ...);  // convert_boolean_attn_mask_cudnn",
            f"{PT}/pull/140837",
        ),
    ),
    fix="fill with `-inf` as for the other backends once cuDNN handles it (the comment above the function calls the "
    "finite fill a workaround), or return 0 on rows whose mask row is all `False`, as `_safe_softmax` does for math.",
    related=(
        f"{META.id} (the page this comment comes from): the same rows from empty key sequences and bottom-right causal masks",
    ),
)
