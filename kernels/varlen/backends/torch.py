"""Per-document SDPA as a backend: `backend="torch"`, what "auto" runs on CPU tensors.

Each document's real rows go through `torch.nn.functional.scaled_dot_product_attention` on
their own, computed in float32, so nothing of one document reaches another and no padding row
reaches anything: the real rows are gathered by index before any arithmetic (NaN or inf on
padding rows never enters it), and the output is scattered back into zeros, so `out` and the
gradients of q, k and v are exactly 0 on GAP and TAIL rows. A real row that sees no key (the
causal or window mask leaves none) attends to its whole document and has its output replaced
by 0, which makes its gradient, and its share of dk and dv, exactly 0 too (no -inf - -inf
ever reaches autograd). `lse`, when asked, is a log-sum-exp of the same masked scores.

It reads the boundaries on the host (the loop over documents), so it runs eagerly only; on a
GPU it waits for the batch's check once per batch and is never "auto"'s pick. On the CPU it is,
unless the Triton interpreter is asked for (`runtime.use_interpreter()`, or TRITON_INTERPRET=1
before triton was imported): then the Triton kernel runs, as tests and audits of it do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from varlen_workbench.kernels.runtime import interpreter_forced
from varlen_workbench.kernels.varlen.backends.registry import Call


def visible_keys(len_q: int, len_k: int, window: tuple[int, int], device=None) -> torch.Tensor:
    """(len_q, len_k) bool: query i sees key j iff i + off - left <= j <= i + off + right,
    off = len_k - len_q (bottom-right aligned, FlashAttention >= 2.1), -1 = unbounded side."""
    left, right = window
    rows = torch.arange(len_q, device=device)[:, None] + (len_k - len_q)
    cols = torch.arange(len_k, device=device)[None, :]
    visible = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    return visible


def _real_rows(real: list[int], padded: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    """The indices of a side's real rows, in order; None where every row is real."""
    if padded == real and real[-1] == total:
        return None
    rows = [r for i in range(len(real) - 1) for r in range(padded[i], padded[i] + real[i + 1] - real[i])]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _gather(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return (x if rows is None else x.index_select(0, rows)).float()


def _document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: tuple[int, int], scale: float, want_lse: bool):
    """One document, (L, H, D) float32 each: (out (L_q, H, D_v), lse (H, L_q) or None)."""
    len_q, len_k, heads = q.shape[0], k.shape[0], q.shape[1]
    if len_k == 0:  # no key at all: every row sees none
        lse = q.new_full((heads, len_q), float("-inf")) if want_lse else None
        return q.new_zeros((len_q, heads, v.shape[2])), lse
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    gqa = heads != k.shape[1]
    # Plain causal on a square document needs no mask (SDPA's faster road): every row sees its diagonal.
    is_causal = window == (-1, 0) and len_q == len_k
    mask = has_key = None
    if window != (-1, -1) and (want_lse or not is_causal):
        visible = visible_keys(len_q, len_k, window, q.device)
        has_key = visible.any(-1)
        mask = visible | ~has_key[:, None]  # a row with no key attends to all, then is zeroed
    sdpa_mask = None if is_causal else mask
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=sdpa_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    out = out.transpose(0, 1)
    lse = None
    if want_lse:
        scores = (qh @ (kh.repeat_interleave(heads // k.shape[1], 0) if gqa else kh).transpose(1, 2)) * scale
        lse = torch.logsumexp(scores if mask is None else scores.masked_fill(~mask, float("-inf")), dim=-1)
    if has_key is not None and not bool(has_key.all()):
        out = torch.where(has_key[:, None, None], out, 0.0)
        lse = None if lse is None else torch.where(has_key[None, :], lse, float("-inf"))
    return out, lse


def per_document_attention(call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The call, one document at a time (the module docstring says how padding stays out)."""
    q, k, v = call.q, call.k, call.v
    cu_q, cu_k, padded_q, padded_k = (b.tolist() for b in call.metadata.boundaries)
    rows_q = _real_rows(cu_q, padded_q, q.shape[0], q.device)
    rows_k = _real_rows(cu_k, padded_k, k.shape[0], k.device)
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    window = (call.window_left, 0 if call.causal else call.window_right)
    documents = [
        _document(qd, kd, vd, window, call.scale, call.return_lse)
        for qd, kd, vd in zip(
            _gather(q, rows_q).split(lengths_q), _gather(k, rows_k).split(lengths_k), _gather(v, rows_k).split(lengths_k)
        )
    ]
    heads, total_q = q.shape[1], q.shape[0]
    out = torch.cat([o for o, _ in documents]).to(q.dtype)
    if rows_q is not None:
        out = out.new_zeros((total_q, heads, v.shape[2])).index_copy(0, rows_q, out)
    if not call.return_lse:
        return out, None
    lse = torch.cat([lse for _, lse in documents], dim=1)
    if rows_q is not None:
        lse = lse.new_full((heads, total_q), float("-inf")).index_copy(1, rows_q, lse)
    return out, lse


class PerDocumentSdpa:
    name = "torch"
    label = "per-document SDPA"
    summary = "per-document `scaled_dot_product_attention` in float32, padding gathered out (kernels/varlen/backends/torch.py)"
    takes = "eager calls on any device (it reads the boundaries on the host); auto's pick on the CPU"

    dtypes: tuple[torch.dtype, ...] | None = None

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def cannot_take(self, call: Call) -> str | None:
        if not call.eager:
            return "traced (torch.compile or a dispatch mode): the per-document loop reads the boundaries on the host"
        return None

    def preference(self, call: Call) -> int:
        # On the CPU the interpreted Triton kernel is seconds a step; asked for, the interpreter wins.
        return 3 if call.q.is_cpu and not interpreter_forced() else 0

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        call.metadata.check()  # the boundaries are read on the host: never those of a malformed batch
        return per_document_attention(call)
