"""The forward kernel of the fixed varlen attention: for each block of query rows and each head,
an online softmax over the key blocks its window reaches, storing out and lse on real rows.
Its Hopper variants (tensor descriptors, warp specialization, a persistent grid) are constexpr
switches (kernels/varlen/hopper.py).

What it shares with the backward kernels (work lists, masks, lanes, base-2 scores) is in
`kernel_common`, with the conventions they follow.
"""

import triton.language as tl

from varlen_workbench.kernels.runtime import jit
from varlen_workbench.kernels.varlen.kernel_common import (
    LN2,
    _block_start,
    _dot,
    _key_ranges,
    _load_keys,
    _load_rows,
    _sequence,
    _visible,
    _work_item,
)


@jit
def _forward_step(
    acc,
    l_i,
    m_i,
    q,
    K,
    V,
    stride_kt,
    stride_vt,
    dims,
    dims_v,
    rows,
    col_start,
    cols,
    len_k,
    offset,
    left,
    right,
    qk_scale,
    MASKED: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
):
    """One key block of the online softmax. With DESCRIPTORS, K and V are tensor descriptors
    over this sequence's keys: rows past len_k come back zero-filled, as the masked loads do."""
    if DESCRIPTORS:
        k = K.load([col_start, 0])
        v = V.load([col_start, 0])
    else:
        k, v = _load_keys(K, V, cols, len_k, stride_kt, stride_vt, dims, dims_v, HEAD_DIM, HEAD_DIM_V, MASKED)
    qk = _dot(q, tl.trans(k), DOT_UPCAST)
    if MASKED:
        qk = tl.where(
            _visible(rows[:, None], cols[None, :], len_k, offset, left, right, WINDOW_LEFT, WINDOW_RIGHT), qk, float("-inf")
        )
    # Scaling the row max (qk_scale > 0) instead of every score leaves one fused
    # multiply-add per score for exp2's argument, as in Triton's fused-attention tutorial.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:
        # A row that has seen no visible key yet keeps m = -inf: subtract 0 instead, so that
        # exp2 sees -inf - 0 (= 0) and never -inf - (-inf) (= NaN).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new  # every row sees every key of an unmasked block: m_new is finite
    p = tl.exp2(qk * qk_scale - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, DOT_UPCAST, acc * alpha[:, None])
    return acc, l_i, m_new


@jit
def _forward_blocks(
    acc,
    l_i,
    m_i,
    q,
    K,
    V,
    stride_kt,
    stride_vt,
    dims,
    dims_v,
    rows,
    first_lo,
    hi,
    n_first,
    second_lo,
    n_blocks,
    len_k,
    offset,
    left,
    right,
    qk_scale,
    MASKED: tl.constexpr,
    TWO_RANGES: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Online softmax over key blocks of one sequence (K, V at its first row): [first_lo, hi),
    or with TWO_RANGES n_blocks of them, n_first from first_lo then on from second_lo.
    WARP_SPECIALIZE asks Triton to split the loop into producer and consumer warps."""
    offs = tl.arange(0, BLOCK_N)
    if TWO_RANGES:
        for i in tl.range(0, n_blocks, warp_specialize=WARP_SPECIALIZE):
            col_start = _block_start(i, first_lo, n_first, second_lo, BLOCK_N)
            acc, l_i, m_i = _forward_step(
                acc,
                l_i,
                m_i,
                q,
                K,
                V,
                stride_kt,
                stride_vt,
                dims,
                dims_v,
                rows,
                col_start,
                col_start + offs,
                len_k,
                offset,
                left,
                right,
                qk_scale,
                MASKED,
                WINDOW_LEFT,
                WINDOW_RIGHT,
                DOT_UPCAST,
                HEAD_DIM,
                HEAD_DIM_V,
                DESCRIPTORS,
            )
    else:
        for col_start in tl.range(first_lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            acc, l_i, m_i = _forward_step(
                acc,
                l_i,
                m_i,
                q,
                K,
                V,
                stride_kt,
                stride_vt,
                dims,
                dims_v,
                rows,
                col_start,
                col_start + offs,
                len_k,
                offset,
                left,
                right,
                qk_scale,
                MASKED,
                WINDOW_LEFT,
                WINDOW_RIGHT,
                DOT_UPCAST,
                HEAD_DIM,
                HEAD_DIM_V,
                DESCRIPTORS,
            )
    return acc, l_i, m_i


@jit
def _rows_descriptor(base, start, length, stride_t, BLOCK: tl.constexpr, WIDTH: tl.constexpr, LANES: tl.constexpr):
    """A descriptor over one sequence's rows of one head, [length, WIDTH] from row `start`, in
    blocks of [BLOCK, LANES]: TMA zero-fills loads past `length` (and lanes past WIDTH) and drops
    stores there, so the next sequence, the padding and the next head are never touched. A length of 0 becomes 1: no block of such a sequence is ever
    loaded or stored (its key loops are empty, and it owns no query block), and TMA needs a
    non-empty extent."""
    return tl.make_tensor_descriptor(
        base + start * stride_t, shape=[tl.maximum(length, 1), WIDTH], strides=[stride_t, 1], block_shape=[BLOCK, LANES]
    )


@jit
def _forward_tile(
    Q,
    K,
    V,
    Out,
    Lse,
    cu_q,
    cu_k,
    cu_q_padded,
    cu_k_padded,
    seq,
    block,
    head,
    qk_scale,
    window_left,
    window_right,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    GROUP: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """Block `block` of BLOCK_M query rows of sequence `seq` and head `head`: online softmax over keys."""
    q_start, len_q = _sequence(cu_q, cu_q_padded, seq)
    k_start, len_k = _sequence(cu_k, cu_k_padded, seq)
    row_start = block * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    dims = tl.arange(0, BLOCK_D)  # q/k lanes: those past HEAD_DIM load 0 and add 0 to every score
    dims_v = tl.arange(0, BLOCK_DV)  # v/out lanes: those past HEAD_DIM_V load 0 and are never stored
    Q += head * stride_qh
    Out += head * stride_oh
    K += (head // GROUP) * stride_kh
    V += (head // GROUP) * stride_vh
    if DESCRIPTORS:
        q_desc = _rows_descriptor(Q, q_start, len_q, stride_qt, BLOCK_M, HEAD_DIM, BLOCK_D)
        q = q_desc.load([row_start, 0])
        K = _rows_descriptor(K, k_start, len_k, stride_kt, BLOCK_N, HEAD_DIM, BLOCK_D)
        V = _rows_descriptor(V, k_start, len_k, stride_vt, BLOCK_N, HEAD_DIM_V, BLOCK_DV)
    else:
        q = _load_rows(Q, q_start, rows, row_ok, stride_qt, dims, HEAD_DIM)
        K += k_start * stride_kt
        V += k_start * stride_vt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    key_lo, full_lo, full_hi, key_hi = _key_ranges(
        row_start, len_q, len_k, window_left, window_right, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N
    )
    # Blocks [full_lo, full_hi) unmasked; masked [full_hi, key_hi) and, with a left bound, the
    # window's left edge [key_lo, full_lo) first, in the same loop.
    n_left = (full_lo - key_lo) // BLOCK_N
    n_right = tl.cdiv(tl.maximum(key_hi - full_hi, 0), BLOCK_N)
    masked_lo = full_hi
    if WINDOW_LEFT:
        masked_lo = key_lo
    acc, l_i, m_i = _forward_blocks(
        acc,
        l_i,
        m_i,
        q,
        K,
        V,
        stride_kt,
        stride_vt,
        dims,
        dims_v,
        rows,
        full_lo,
        full_hi,
        0,
        0,
        0,
        len_k,
        len_k - len_q,
        window_left,
        window_right,
        qk_scale,
        MASKED=False,
        TWO_RANGES=False,
        WINDOW_LEFT=WINDOW_LEFT,
        WINDOW_RIGHT=WINDOW_RIGHT,
        BLOCK_N=BLOCK_N,
        DOT_UPCAST=DOT_UPCAST,
        HEAD_DIM=HEAD_DIM,
        HEAD_DIM_V=HEAD_DIM_V,
        DESCRIPTORS=DESCRIPTORS,
        WARP_SPECIALIZE=WARP_SPECIALIZE,
    )
    acc, l_i, m_i = _forward_blocks(
        acc,
        l_i,
        m_i,
        q,
        K,
        V,
        stride_kt,
        stride_vt,
        dims,
        dims_v,
        rows,
        masked_lo,
        key_hi,
        n_left,
        full_hi,
        n_left + n_right,
        len_k,
        len_k - len_q,
        window_left,
        window_right,
        qk_scale,
        MASKED=True,
        TWO_RANGES=WINDOW_LEFT,
        WINDOW_LEFT=WINDOW_LEFT,
        WINDOW_RIGHT=WINDOW_RIGHT,
        BLOCK_N=BLOCK_N,
        DOT_UPCAST=DOT_UPCAST,
        HEAD_DIM=HEAD_DIM,
        HEAD_DIM_V=HEAD_DIM_V,
        DESCRIPTORS=DESCRIPTORS,
        WARP_SPECIALIZE=WARP_SPECIALIZE,
    )

    # Rows with no visible key have l = 0 and acc = 0: output 0 and lse = -inf, no 0/0.
    has_key = l_i > 0.0
    out = (acc / tl.where(has_key, l_i, 1.0)[:, None]).to(Out.dtype.element_ty)
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * LN2, float("-inf"))
    if DESCRIPTORS:
        _rows_descriptor(Out, q_start, len_q, stride_ot, BLOCK_M, HEAD_DIM_V, BLOCK_DV).store([row_start, 0], out)
    else:
        out_ok = row_ok[:, None] & (dims_v < HEAD_DIM_V)[None, :]
        tl.store(Out + (q_start + rows)[:, None] * stride_ot + dims_v[None, :], out, mask=out_ok)
    tl.store(Lse + head * stride_lh + q_start + rows, lse, mask=row_ok)


@jit(do_not_specialize=["n_seqs", "n_search_steps", "n_items", "window_left", "window_right"])
def attention_forward_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    cu_q,
    cu_k,
    cu_q_padded,
    cu_k_padded,
    block_starts,
    order,
    n_items,
    n_seqs,
    n_search_steps,
    qk_scale,
    window_left,
    window_right,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    GROUP: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    PERSISTENT: tl.constexpr,
    N_HEADS: tl.constexpr,
):
    """Query blocks x heads. One program per (block, head) on a (blocks, heads) grid, or with
    PERSISTENT a 1-D grid of about one program per SM, each walking tiles
    program_id, program_id + num_programs, ... of `n_items` = blocks x heads: tile t is head
    t % N_HEADS of work item order[t // N_HEADS], `order` listing the work items longest first
    (`longest_first` in kernels/varlen/hopper.py), so the longest tiles start first and the short ones fill
    the last wave. Without PERSISTENT `order` and `n_items` are unread."""
    if PERSISTENT:
        for t in range(tl.program_id(0), n_items, tl.num_programs(0)):
            item = tl.load(order + t // N_HEADS)
            seq, block = _work_item(item, block_starts, n_seqs, n_search_steps, REVERSE=False)
            if seq < n_seqs:
                _forward_tile(
                    Q, K, V, Out, Lse, cu_q, cu_k, cu_q_padded, cu_k_padded, seq, block, t % N_HEADS,
                    qk_scale, window_left, window_right, stride_qt, stride_qh, stride_kt, stride_kh,
                    stride_vt, stride_vh, stride_ot, stride_oh, stride_lh, GROUP, WINDOW_LEFT,
                    WINDOW_RIGHT, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, DOT_UPCAST, DESCRIPTORS,
                    WARP_SPECIALIZE,
                )  # fmt: skip
    else:
        seq, block = _work_item(tl.program_id(0), block_starts, n_seqs, n_search_steps, REVERSE=WINDOW_RIGHT)
        if seq < n_seqs:
            _forward_tile(
                Q, K, V, Out, Lse, cu_q, cu_k, cu_q_padded, cu_k_padded, seq, block, tl.program_id(1),
                qk_scale, window_left, window_right, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_vt, stride_vh, stride_ot, stride_oh, stride_lh, GROUP, WINDOW_LEFT,
                WINDOW_RIGHT, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, DOT_UPCAST, DESCRIPTORS,
                WARP_SPECIALIZE,
            )  # fmt: skip
