"""The upstream reports fsa-varlen-descriptors offers, ready to file: the unwritten TAIL rows, and the
misaligned lse descriptor of the backward."""

from __future__ import annotations

from varlen_workbench.postmortems.fsa_varlen_descriptors.cases import (
    AUDITS,
    BACKWARD_SOURCE,
    FORWARD_SOURCE,
    FSA_SOURCE,
    MISALIGNED_H200,
    PREPROCESS_FILE,
    ROWS,
)
from varlen_workbench.postmortems.fsa_varlen_descriptors.upstream import VERSION
from varlen_workbench.workbench.upstream_report import Source, UpstreamReport

_TRACKER = "https://github.com/HKUSTDial/flash-sparse-attention/issues/new"
_WHEEL = f"flash-sparse-attn {VERSION} wheel"
_VERSIONS = (
    f"flash-sparse-attn {VERSION} (pip), NVIDIA H200 (sm90), torch 2.11.0+cu130, triton 3.6.0",
    "the same on the CPU with torch 2.13.0 and triton 3.6.0 under `TRITON_INTERPRET=1`",
)
_DENSE = ROWS["flash_dense_attn_varlen_func"]

TAIL_REPRO = """
# flash-sparse-attn 2.0.6 varlen: rows past cu_seqlens_q[-1] of out and dq are never written
import torch
from flash_sparse_attn import flash_dense_attn_varlen_func

torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = True  # torch.empty returns NaN: rows nobody writes show as NaN
device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: only under the Triton interpreter
cu = torch.tensor([0, 4, 12], dtype=torch.int32, device=device)  # 2 sequences in rows 0-11; rows 12-15 spare (TAIL)
q, k, v = (torch.randn(16, 2, 64, device=device, dtype=torch.float16, requires_grad=True) for _ in range(3))
out = flash_dense_attn_varlen_func(q, k, v, cu, cu, 8, 8)
out.backward(torch.ones_like(out))
for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
    print(f"{name}: rows 12-15 NaN {bool(t[12:].isnan().all())}; rows 0-11 finite {bool(t[:12].isfinite().all())}")
"""

TAIL_ROWS = UpstreamReport(
    title="Varlen forward and backward leave the rows of out and dq past cu_seqlens_q[-1] uninitialised",
    file_at=_TRACKER,
    versions=_VERSIONS,
    repro=TAIL_REPRO,
    prints=(
        "out: rows 12-15 NaN True; rows 0-11 finite True",
        "dq: rows 12-15 NaN True; rows 0-11 finite True",
        "dk: rows 12-15 NaN False; rows 0-11 finite True",
        "dv: rows 12-15 NaN False; rows 0-11 finite True",
    ),
    expected="the rows of `out` and `dq` past `cu_seqlens_q[-1]` come back 0, as those of `dk` and `dv` already do "
    "(they are copied from zero-initialised accumulators). Packed batches padded to a static shape have such rows; "
    "`dq` on them flows into the weight gradient of the projection that made `q`, whatever the loss reads.",
    actual="they keep whatever the allocator held: NaN under `fill_uninitialized_memory`, stale values otherwise.",
    shown=f"the library itself, this repro run as shown on a CPU under the Triton interpreter (this page's paste-block "
    f"battery); on the H200 the one audit batch that reached the end of its backward, the no-real-query check's, "
    f"returned its TAIL rows of `out` and `dq` non-finite (`data/gpu/{AUDITS[_DENSE]}`)",
    suspected=(
        Source("flash_sparse_attn/ops/triton/flash_dense_fwd.py", 876, _WHEEL, "out = torch.empty_like(query, dtype=out_dtype)"),
        Source("flash_sparse_attn/ops/triton/flash_dense_bwd.py", 854, _WHEEL, "dq = torch.empty_like(query, dtype=dout.dtype)"),
        Source("flash_sparse_attn/ops/triton/flash_sparse_fwd.py", 886, _WHEEL, "out = torch.empty_like(query, ...)"),
        Source("flash_sparse_attn/ops/triton/flash_sparse_bwd.py", 871, _WHEEL, "dq = torch.empty_like(query, ...)"),
    ),
    fix="allocate `out` and `dq` with `torch.zeros` in `_flash_dense_attn_varlen_forward/_backward` (and the sparse "
    "twins), or zero their rows past `cu_seqlens_q[-1]` after the kernels; each program writes only its sequence's "
    "rows, so no kernel visits these.",
    related=(
        f"the dense forward and backward read the same in the repository ({FORWARD_SOURCE}, {BACKWARD_SOURCE})",
        "the same class of bug in FlashAttention-4 (flash-attention, fa4-unwritten-padding) and torch's `varlen_attn` "
        "(pytorch#176793)",
    ),
)

LSE_REPRO = """
# flash-sparse-attn 2.0.6 varlen: the backward faults when a sequence start is not a multiple of 4
import torch
from flash_sparse_attn import flash_dense_attn_varlen_func

device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: only under the Triton interpreter
cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32, device=device)  # sequences of 5, 3 and 7 tokens, 2 heads
q, k, v = (torch.randn(15, 2, 64, device=device, dtype=torch.float16, requires_grad=True) for _ in range(3))
out = flash_dense_attn_varlen_func(q, k, v, cu, cu, 7, 7)
print("forward: ran")
try:
    out.backward(torch.ones_like(out))
    if device == "cuda":
        torch.cuda.synchronize()
    print("backward: ran")
except Exception as error:  # the H200: misaligned address; the interpreter: Triton's descriptor rule
    print(f"backward: {type(error).__name__}: {str(error).splitlines()[0]}")
"""

_PREPROCESS = f"https://github.com/{FSA_SOURCE.replace('@', '/blob/')}/{PREPROCESS_FILE}"

MISALIGNED_LSE = UpstreamReport(
    title="Varlen backward raises 'misaligned address' on Hopper when a cu_seqlens_q entry is not a multiple of 4: "
    "the lse tensor descriptor is based at LSE + h * total_q + cu_seqlens_q[b]",
    file_at=_TRACKER,
    versions=_VERSIONS,
    repro=LSE_REPRO,
    prints=("forward: ran", "backward: InterpreterError: AssertionError('base must be 16-byte aligned')"),
    expected="the backward runs for any `cu_seqlens_q`: packed batches from real data rarely have every sequence "
    "start (and, with more than one head, the row count) a multiple of 4.",
    actual="on the H200 the backward raises `RuntimeError: Triton Error [CUDA]: misaligned address` at the launch of "
    "the backward preprocess kernel, and the process loses its CUDA context; under the interpreter, Triton's "
    "assertion that a descriptor base is 16-byte aligned fails at the same descriptor. The lse base of program "
    "(b, h) is 4, 8 or 12 bytes past a 16-byte boundary exactly where `h * total_q + cu_seqlens_q[b]` is not a "
    "multiple of 4 floats.",
    shown=f"the H200, on this batch called alone under `CUDA_LAUNCH_BLOCKING=1` (`data/gpu/{MISALIGNED_H200}`, case "
    "no-tail: the fault at `flash_bwd_preprocess.py:227`, with the base of every program's lse descriptor); the "
    "printout is this repro as shown on the CPU, the library under the Triton interpreter (this page's battery)",
    suspected=(
        Source(
            PREPROCESS_FILE,
            100,
            FSA_SOURCE,
            "lse_base = seqlen_info.offset_batch_Q(LSE + head_idx * stride_lh, ..., USE_PADDED=False)",
            f"{_PREPROCESS}#L100-L109",
        ),
        Source(
            PREPROCESS_FILE,
            150,
            FSA_SOURCE,
            "lse_desc = tl.make_tensor_descriptor(base=lse_base, ...)",
            f"{_PREPROCESS}#L150-L155",
        ),
    ),
    fix="base the lse descriptor on the padded layout (`USE_PADDED=True`), as `dpsum` and `lse_log2` beside it "
    "already are, with the forward writing lse padded; or read lse through a masked pointer load instead of a "
    "descriptor. The 2.0.6 wheel has the same lines.",
    related=(
        "a batch with an empty sequence raises `illegal instruction` in the forward (descriptors of extent 0), a "
        "separate fault of the same functions",
    ),
)

REPORTS = (TAIL_ROWS, MISALIGNED_LSE)
