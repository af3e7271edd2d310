"""cuDNN's fused attention on a packed THD batch, through nvidia-cudnn-frontend's Python graph API.

This is the kernel TransformerEngine's THD path runs on Hopper (qkv_format="thd", attn_mask_type
"padding*"), reached without TE's compiled extension: an SDPA graph whose Q, K, V, O (and dQ, dK,
dV, and the softmax stats) are dense (B, H, S, D) descriptors displaced per sequence by a ragged
offset, with seq_len_q/kv giving each sequence's real length. Exactly TE's two kinds of boundary:

    cu_seqlens_q/k           REAL lengths: seq_len_q/kv = cu_seqlens.diff()
    cu_seqlens_q/k_padded    MEMORY layout: ragged offset of sequence i = cu_seqlens_padded[i] * H * D
                             (default: cu_seqlens, a layout without GAP rows)

What this thin function decides, as TransformerEngine's Python cuDNN path does on cuDNN 9.6-9.23
(read at NVIDIA/TransformerEngine's transformer_engine/pytorch/.../fused_attn: `_build_f16_fwd_graph`,
`_build_f16_bwd_graph`): int64 element offsets; the stats (log-sum-exp) ragged too, (T_q, H, 1)
float32 at offset cu_seqlens_q_padded[i] * H; the graph's S dimensions are the row counts T_q and
T_k (at least every sequence: TE buckets them likewise, so max_seqlen_q/k never reach cuDNN);
causal is bottom-right (TE's "padding_causal_bottom_right"); a window (left, right) in
FlashAttention's sense is cuDNN's diagonal band (left + 1, right), bottom-right aligned.
Unlike TE's default (fast_zero_fill=True), out, dq, dk and dv come from torch.empty: rows cuDNN
does not write keep what memory held, so the audit sees what the kernel itself writes.

Only what is needed to build a graph is checked here (tensors, 1-D integer boundaries, dtypes);
whether cuDNN refuses malformed boundaries is part of what is audited. Imported lazily: this
module imports without cuDNN; a call needs CUDA and `pip install nvidia-cudnn-frontend==1.32.0`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from varlen_workbench.workbench.upstream import import_module

INSTALL = "pip install --no-deps nvidia-cudnn-frontend==1.32.0"


def _cudnn():
    return import_module("cudnn", install=INSTALL)


@functools.cache
def _handle():
    return _cudnn().create_handle()


@dataclass(frozen=True)
class _Shape:
    """What one graph is built for (a graph is reused for every call of the same shape)."""

    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    rows_q: int
    rows_k: int
    causal: bool
    window: tuple[int, int]
    scale: float
    deterministic: bool = False

    def strides(self, heads: int, rows: int) -> list[int]:
        """(B, H, S, D) over a (T, H, D) buffer: the batch stride is displaced by the ragged offset."""
        return [rows * heads * self.head_dim, self.head_dim, heads * self.head_dim, 1]

    def dims(self, heads: int, rows: int) -> list[int]:
        return [self.batch, heads, rows, self.head_dim]


def _data_type(dtype: torch.dtype):
    cudnn = _cudnn()
    return {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]


def _new_graph(shape: _Shape):
    cudnn = _cudnn()
    return cudnn.pygraph(
        io_data_type=_data_type(shape.dtype),
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=_handle(),
    )


def _offsets(graph, name: str, batch: int):
    return graph.tensor(name=name, dim=[batch + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=_cudnn().data_type.INT64)


def _mask_options(shape: _Shape) -> dict[str, Any]:
    cudnn = _cudnn()
    options: dict[str, Any] = {
        "attn_scale": shape.scale,
        "use_padding_mask": True,  # cuDNN takes ragged offsets only with a padding mask
        "diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT,
    }
    left, right = shape.window
    if shape.causal:
        options["use_causal_mask_bottom_right"] = True  # right bound 0 (cuDNN refuses it twice)
    elif right >= 0:
        options["diagonal_band_right_bound"] = right
    if left >= 0:
        options["diagonal_band_left_bound"] = left + 1  # cuDNN's band excludes its left bound
    return options


def _inputs(graph, shape: _Shape) -> dict[str, Any]:
    """Q, K, V with ragged offsets, and the per-sequence lengths, as graph tensors."""
    cudnn = _cudnn()
    t = {name: _offsets(graph, f"offset_{name}", shape.batch) for name in ("q", "k", "v", "o", "stats")}
    dt = _data_type(shape.dtype)
    for name, heads, rows in (
        ("Q", shape.heads, shape.rows_q),
        ("K", shape.kv_heads, shape.rows_k),
        ("V", shape.kv_heads, shape.rows_k),
    ):
        t[name] = graph.tensor(
            name=name,
            dim=shape.dims(heads, rows),
            stride=shape.strides(heads, rows),
            data_type=dt,
            ragged_offset=t[name.lower()],
        )
    for name in ("seq_len_q", "seq_len_kv"):
        t[name] = graph.tensor(name=name, dim=[shape.batch, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    return t


def _stats_layout(shape: _Shape) -> tuple[list[int], list[int]]:
    """The log-sum-exp, (T_q, H, 1) float32 in memory: one value per (row, head)."""
    return [shape.batch, shape.heads, shape.rows_q, 1], [shape.heads * shape.rows_q, 1, shape.heads, 1]


def _finish(graph) -> int:
    cudnn = _cudnn()
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph.get_workspace_size()


@functools.cache
def _forward_graph(shape: _Shape):
    graph = _new_graph(shape)
    t = _inputs(graph, shape)
    out, stats = graph.sdpa(
        name="sdpa",
        q=t["Q"],
        k=t["K"],
        v=t["V"],
        generate_stats=True,
        seq_len_q=t["seq_len_q"],
        seq_len_kv=t["seq_len_kv"],
        **_mask_options(shape),
    )
    out.set_output(True).set_dim(shape.dims(shape.heads, shape.rows_q)).set_stride(shape.strides(shape.heads, shape.rows_q))
    out.set_ragged_offset(t["o"])
    dims, strides = _stats_layout(shape)
    stats.set_output(True).set_data_type(_cudnn().data_type.FLOAT).set_dim(dims).set_stride(strides)
    stats.set_ragged_offset(t["stats"])
    t.update(O=out, Stats=stats)
    return graph, t, _finish(graph)


@functools.cache
def _backward_graph(shape: _Shape):
    graph = _new_graph(shape)
    t = _inputs(graph, shape)
    qo = (shape.dims(shape.heads, shape.rows_q), shape.strides(shape.heads, shape.rows_q))
    for name in ("O", "dO"):
        t[name] = graph.tensor(name=name, dim=qo[0], stride=qo[1], data_type=_data_type(shape.dtype), ragged_offset=t["o"])
    dims, strides = _stats_layout(shape)
    t["Stats"] = graph.tensor(
        name="Stats", dim=dims, stride=strides, data_type=_cudnn().data_type.FLOAT, ragged_offset=t["stats"]
    )
    dq, dk, dv = graph.sdpa_backward(
        name="sdpa_backward",
        q=t["Q"],
        k=t["K"],
        v=t["V"],
        o=t["O"],
        dO=t["dO"],
        stats=t["Stats"],
        seq_len_q=t["seq_len_q"],
        seq_len_kv=t["seq_len_kv"],
        max_total_seq_len_q=shape.rows_q,
        max_total_seq_len_kv=shape.rows_k,
        use_deterministic_algorithm=shape.deterministic,
        **_mask_options(shape),
    )
    for grad, (name, heads, rows) in zip(
        (dq, dk, dv), (("q", shape.heads, shape.rows_q), ("k", shape.kv_heads, shape.rows_k), ("v", shape.kv_heads, shape.rows_k))
    ):
        grad.set_output(True).set_dim(shape.dims(heads, rows)).set_stride(shape.strides(heads, rows))
        grad.set_ragged_offset(t[name])
    t.update(dQ=dq, dK=dk, dV=dv)
    return graph, t, _finish(graph)


def _execute(graph, workspace_size: int, pack: dict, device) -> None:
    cudnn = _cudnn()
    cudnn.set_stream(handle=_handle(), stream=torch.cuda.current_stream(device).cuda_stream)
    workspace = torch.empty(workspace_size, dtype=torch.uint8, device=device)
    graph.execute(pack, workspace, handle=_handle())


def _metadata(shape: _Shape, cu_q, cu_k, padded_q, padded_k) -> dict[str, torch.Tensor]:
    """The per-call tensors: element offsets (int64, (B+1, 1, 1, 1)) and real lengths (int32, (B, 1, 1, 1))."""

    def offsets(layout, per_row):
        return (layout.to(torch.int64) * per_row).reshape(-1, 1, 1, 1).contiguous()

    d = shape.head_dim
    return {
        "q": offsets(padded_q, shape.heads * d),
        "o": offsets(padded_q, shape.heads * d),
        "stats": offsets(padded_q, shape.heads),
        "k": offsets(padded_k, shape.kv_heads * d),
        "v": offsets(padded_k, shape.kv_heads * d),
        "seq_len_q": cu_q.diff().to(torch.int32).reshape(-1, 1, 1, 1).contiguous(),
        "seq_len_kv": cu_k.diff().to(torch.int32).reshape(-1, 1, 1, 1).contiguous(),
    }


class _CudnnRagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, shape: _Shape, meta: dict[str, torch.Tensor]):
        graph, t, workspace = _forward_graph(shape)
        out = torch.empty_like(q)
        stats = torch.empty(q.shape[0], q.shape[1], 1, dtype=torch.float32, device=q.device)
        pack = {t[name]: tensor for name, tensor in meta.items()}
        pack.update({t["Q"]: q, t["K"]: k, t["V"]: v, t["O"]: out, t["Stats"]: stats})
        _execute(graph, workspace, pack, q.device)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.shape, ctx.meta = shape, meta
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, stats = ctx.saved_tensors
        shape = dataclasses.replace(ctx.shape, deterministic=torch.are_deterministic_algorithms_enabled())
        graph, t, workspace = _backward_graph(shape)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pack = {t[name]: tensor for name, tensor in ctx.meta.items()}
        pack.update(
            {
                t["Q"]: q,
                t["K"]: k,
                t["V"]: v,
                t["O"]: out,
                t["dO"]: d_out.contiguous(),
                t["Stats"]: stats,
                t["dQ"]: dq,
                t["dK"]: dk,
                t["dV"]: dv,
            }
        )
        _execute(graph, workspace, pack, q.device)
        return dq, dk, dv, None, None


def _boundaries(name: str, cu, batch: int | None) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be a 1-D integer tensor (int32 boundaries, B + 1 of them), got {cu!r:.80}.")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} has {cu.numel()} entries; cu_seqlens_q has {batch + 1}: one boundary per sequence, plus 0.")
    return cu


def cudnn_ragged_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    cu_seqlens_q_padded=None,
    cu_seqlens_k_padded=None,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
):
    """cuDNN SDPA on THD q (T_q, H, D), k, v (T_k, H_kv, D), fp16/bf16 on CUDA: out (T_q, H, D).

    cu_seqlens_q/k give the real lengths, cu_seqlens_q/k_padded the memory layout (TE's pair);
    causal is bottom-right; window_size=(left, right), -1 unbounded. Differentiable (cuDNN's
    backward graph). max_seqlen_q/k are accepted for the varlen signature and not used (see the
    module docstring)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise TypeError(f"{name} must be a 3-D (tokens, heads, head_dim) tensor, got {getattr(x, 'shape', type(x))}.")
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name} is {x.dtype}; cuDNN's fused attention takes float16 or bfloat16: cast with .half().")
        if not x.is_cuda:
            raise ValueError(f"{name} is on {x.device}; cuDNN runs on CUDA: move it with .cuda().")
    cu_q = _boundaries("cu_seqlens_q", cu_seqlens_q, None)
    batch = cu_q.numel() - 1
    cu_k = _boundaries("cu_seqlens_k", cu_seqlens_k, batch)
    padded_q = cu_q if cu_seqlens_q_padded is None else _boundaries("cu_seqlens_q_padded", cu_seqlens_q_padded, batch)
    padded_k = cu_k if cu_seqlens_k_padded is None else _boundaries("cu_seqlens_k_padded", cu_seqlens_k_padded, batch)
    shape = _Shape(
        q.dtype,
        batch,
        q.shape[1],
        k.shape[1],
        q.shape[2],
        max(q.shape[0], 1),
        max(k.shape[0], 1),
        bool(causal),
        (int(window_size[0]), int(window_size[1])),
        float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2]),
    )
    meta = _metadata(shape, cu_q.to(q.device), cu_k.to(q.device), padded_q.to(q.device), padded_k.to(q.device))
    return _CudnnRagged.apply(q.contiguous(), k.contiguous(), v.contiguous(), shape, meta)
