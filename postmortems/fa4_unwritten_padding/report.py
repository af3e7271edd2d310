"""The upstream report fa4-unwritten-padding offers: FA4's unwritten padding rows, ready to file."""

from __future__ import annotations

from varlen_workbench.postmortems.fa4_unwritten_padding.cases import AUDIT, FA4_SOURCE, REAL_CLIENT
from varlen_workbench.workbench.upstream_report import Source, UpstreamReport

_INTERFACE = f"https://github.com/{FA4_SOURCE.replace('@', '/blob/')}/flash_attn/cute/interface.py"

REPRO = """
# FlashAttention-4 varlen: the padding rows of out, dq, dk and dv are never written
import torch
from flash_attn.cute import flash_attn_varlen_func

torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = True  # torch.empty returns NaN: rows nobody writes show as NaN
device = "cuda" if torch.cuda.is_available() else "cpu"  # FA4 needs an sm90/sm100 GPU
# Two sequences of 5 and 9 tokens in slots of 8 and 12 rows (seqused: GAP rows 5-7 and 17-19), 4 spare rows (TAIL 20-23).
cu = torch.tensor([0, 8, 20], dtype=torch.int32, device=device)
used = torch.tensor([5, 9], dtype=torch.int32, device=device)
q, k, v = (torch.randn(24, 2, 64, device=device, dtype=torch.float16, requires_grad=True) for _ in range(3))
out, _ = flash_attn_varlen_func(
    q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=9, seqused_q=used, seqused_k=used
)
out.backward(torch.ones_like(out))
real = torch.zeros(24, dtype=torch.bool, device=device)
real[0:5] = real[8:17] = True
for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
    nan_rows = int(t[~real].isnan().flatten(1).all(1).sum())
    print(f"{name}: {nan_rows} of 10 padding rows NaN; real rows finite: {bool(t[real].isfinite().all())}")
"""

REPORT = UpstreamReport(
    title="flash_attn.cute varlen: rows past seqused and past cu_seqlens[-1] of out, dq, dk, dv are left uninitialised",
    file_at="https://github.com/Dao-AILab/flash-attention/issues/new",
    versions=(
        "flash-attn-4 4.0.0b36 (pip), NVIDIA H200 (sm90), torch 2.11.0+cu130",
        f"source read at the fa4-v4.0.0.beta27 tag ({FA4_SOURCE}) and in the 4.0.0b36 wheel: the same allocations",
    ),
    repro=REPRO,
    prints=tuple(f"{name}: 10 of 10 padding rows NaN; real rows finite: True" for name in ("out", "dq", "dk", "dv")),
    expected="rows that belong to no sequence (past `seqused[i]` inside slot i, past `cu_seqlens[-1]`) come back 0 "
    "in `out`, `dq`, `dk` and `dv`, or at least finite. A training step masks those rows out of its loss, but their "
    "`dq`, `dk`, `dv` still flow into the weight gradient of the QKV projection, which sums over every row.",
    actual="they keep whatever the allocator held: NaN under `fill_uninitialized_memory`, stale activations in "
    "training. In a transformers training step on the H200 (a 4-layer Llama, 256 padding rows ignored by the loss) "
    "the loss stayed right while tens of millions of weight-gradient entries were non-finite.",
    shown=f"FA4 itself on the H200, `data/gpu/{AUDIT}`, checks tail-rows and gap-rows (every TAIL and GAP row of the "
    f"four tensors non-finite, REAL rows right), and `data/gpu/{REAL_CLIENT}`; the printout above is the run of this "
    "repro as shown, on the GPU against FA4 (`data/gpu/paste-blocks-h200.json`) and on the CPU against our replica "
    "of the mechanism called as FA4 is",
    suspected=(
        Source(
            "flash_attn/cute/interface.py",
            711,
            FA4_SOURCE,
            "out = torch.empty(*q_batch_seqlen_shape, num_head, head_dim_v, ...)",
            f"{_INTERFACE}#L711",
        ),
        Source(
            "flash_attn/cute/interface.py",
            2109,
            FA4_SOURCE,
            "dq = torch.empty_like(q)  # dk, dv: lines 2114, 2119",
            f"{_INTERFACE}#L2109-L2119",
        ),
    ),
    fix="allocate `out` in `_flash_attn_fwd` and `dq`, `dk`, `dv` in `_flash_attn_bwd` with `torch.zeros` when "
    "`cu_seqlens_*` or `seqused_*` is given (one memset each), or let the kernels' epilogues store zeros on the rows "
    "of a slot past `seqused[i]` and on the rows past `cu_seqlens[-1]` (PR #2167 notes that no zero is stored there "
    "today). `flash_attn_varlen_func` takes no output buffers, so a caller cannot pass zeroed ones.",
    related=(
        "flash-attention#1228 (FA2: padding rows past `cu_seqlens[-1]` uninitialised), #2324 (FA2/FA3 gradients from "
        '`torch.empty`, closed), #2167 ("we currently don\'t store zero to the unused region for seqused_{q,k}"); '
        "NVIDIA/TransformerEngine#3205 (open) zeroes these rows around TE's FA3/FA4 call ('FA3/FA4 can leave these "
        "positions unwritten'); #2776 zeroes the gradients only when q or k has no row at all",
    ),
)
