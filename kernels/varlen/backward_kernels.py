"""The backward kernels of the fixed varlen attention, launched in this order: dQ, which also
computes delta = rowsum(dO * O) - dlse and stores it, then dK/dV, which reads it. Each pass
owns its output rows (dQ: a block of query rows of one head; dK/dV: a block of keys of one kv
head, summing its GQA group), so every gradient row is written once by one program:
deterministic, no atomics, no zeroed buffer.

What they share with the forward kernel (work lists, masks, lanes, base-2 scores) is in
`kernel_common`, with the conventions they follow.
"""

import triton.language as tl

from varlen_workbench.kernels.runtime import jit
from varlen_workbench.kernels.varlen.kernel_common import (
    LOG2E,
    _block_start,
    _dot,
    _key_ranges,
    _load_keys,
    _load_rows,
    _query_ranges,
    _sequence,
    _visible,
    _work_item,
)


@jit
def _load_lse_log2(Lse, rows, row_ok):
    """lse in base 2 for exp2(s - lse); -inf (row with no visible key) becomes 0 so that exp2
    never sees +inf. Such rows have every score masked anyway."""
    lse = tl.load(Lse + rows, mask=row_ok, other=0.0)
    return tl.where(lse == float("-inf"), 0.0, lse * LOG2E)


@jit
def _dkdv_step(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    Lse,
    Delta,
    stride_qt,
    stride_dot,
    dims,
    dims_v,
    cols,
    rows,
    len_q,
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
):
    """One step of query rows for dK, dV."""
    row_ok = rows < len_q
    rows64 = rows.to(tl.int64)
    qT_ok = row_ok[None, :] & (dims < HEAD_DIM)[:, None]
    qT = tl.load(Q + rows64[None, :] * stride_qt + dims[:, None], mask=qT_ok, other=0.0)
    do_ok = row_ok[:, None] & (dims_v < HEAD_DIM_V)[None, :]
    do = tl.load(DO + rows64[:, None] * stride_dot + dims_v[None, :], mask=do_ok, other=0.0)
    lse2 = _load_lse_log2(Lse, rows, row_ok)
    delta = tl.load(Delta + rows, mask=row_ok, other=0.0)
    pT = tl.exp2(_dot(k, qT, DOT_UPCAST) * qk_scale - lse2[None, :])
    if MASKED:
        # A select, not a product: pT may be +inf on a row that sees no key (its lse2 is 0).
        pT = tl.where(_visible(rows[None, :], cols[:, None], len_k, offset, left, right, WINDOW_LEFT, WINDOW_RIGHT), pT, 0.0)
    dv = _dot(pT.to(do.dtype), do, DOT_UPCAST, dv)
    dpT = _dot(v, tl.trans(do), DOT_UPCAST)
    dsT = pT * (dpT - delta[None, :])
    dk = _dot(dsT.to(qT.dtype), tl.trans(qT), DOT_UPCAST, dk)
    return dk, dv


@jit
def _dkdv_blocks(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    Lse,
    Delta,
    stride_qt,
    stride_dot,
    dims,
    dims_v,
    cols,
    first_lo,
    hi,
    n_first,
    second_lo,
    n_blocks,
    len_q,
    len_k,
    offset,
    left,
    right,
    qk_scale,
    MASKED: tl.constexpr,
    TWO_RANGES: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
):
    """dK, dV contributions of steps of BLOCK_M query rows of one head (Q, DO, Lse, Delta at the
    sequence's first row), walked as in _forward_blocks. MASKED applies the window; nothing
    else needs a mask: keys past len_k are never stored, and rows past len_q read
    q = dO = 0, lse = delta = 0, which makes their dV and dK terms exactly 0."""
    offs = tl.arange(0, BLOCK_M)
    if TWO_RANGES:
        for i in range(0, n_blocks):
            rows = _block_start(i, first_lo, n_first, second_lo, BLOCK_M) + offs
            dk, dv = _dkdv_step(
                dk,
                dv,
                k,
                v,
                Q,
                DO,
                Lse,
                Delta,
                stride_qt,
                stride_dot,
                dims,
                dims_v,
                cols,
                rows,
                len_q,
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
            )
    else:
        for row_start in range(first_lo, hi, BLOCK_M):
            dk, dv = _dkdv_step(
                dk,
                dv,
                k,
                v,
                Q,
                DO,
                Lse,
                Delta,
                stride_qt,
                stride_dot,
                dims,
                dims_v,
                cols,
                row_start + offs,
                len_q,
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
            )
    return dk, dv


@jit(do_not_specialize=["n_seqs", "n_search_steps", "window_left", "window_right"])
def attention_backward_dkdv_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DK,
    DV,
    cu_q,
    cu_k,
    cu_q_padded,
    cu_k_padded,
    block_starts,
    n_seqs,
    n_search_steps,
    qk_scale,
    scale,
    window_left,
    window_right,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
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
):
    """dK, dV of one block of BLOCK_N keys of one sequence and one kv head.

    The program loops over the query heads of its GQA group and sums their contributions in
    registers, so each dK/dV row is written once by one program: no atomics, no zeroed buffer.
    Tiles are kept transposed (keys x queries), as in Triton's fused-attention tutorial, so
    that P^T and dS^T feed the dots without a register transpose.
    """
    kv_head = tl.program_id(1)
    seq, block = _work_item(tl.program_id(0), block_starts, n_seqs, n_search_steps, REVERSE=False)
    if seq == n_seqs:
        return
    q_start, len_q = _sequence(cu_q, cu_q_padded, seq)
    k_start, len_k = _sequence(cu_k, cu_k_padded, seq)
    col_start = block * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    col_ok = cols < len_k
    dims = tl.arange(0, BLOCK_D)  # q/k lanes: those past HEAD_DIM load 0 and are never stored
    dims_v = tl.arange(0, BLOCK_DV)  # v/dO lanes: those past HEAD_DIM_V load 0 and are never stored
    k = _load_rows(K + kv_head * stride_kh, k_start, cols, col_ok, stride_kt, dims, HEAD_DIM)
    v = _load_rows(V + kv_head * stride_vh, k_start, cols, col_ok, stride_vt, dims_v, HEAD_DIM_V)

    row_lo, masked_end, full_end, row_hi = _query_ranges(
        col_start, len_q, len_k, window_left, window_right, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N
    )
    # Masked: [row_lo, masked_end) (the window's lower edge, empty without a right bound) and
    # [full_end, row_hi) (its upper edge, empty without a left bound); with both bounds, both
    # in one loop.
    n_low = tl.cdiv(masked_end - row_lo, BLOCK_M)
    n_high = tl.cdiv(tl.maximum(row_hi - full_end, 0), BLOCK_M)
    masked_lo, masked_hi = row_lo, masked_end
    if WINDOW_LEFT:
        if not WINDOW_RIGHT:
            masked_lo, masked_hi = full_end, row_hi
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        Q_seq = Q + head * stride_qh + q_start * stride_qt
        DO_seq = DOut + head * stride_doh + q_start * stride_dot
        Lse_seq = Lse + head * stride_lh + q_start
        Delta_seq = Delta + head * stride_lh + q_start
        dk, dv = _dkdv_blocks(
            dk,
            dv,
            k,
            v,
            Q_seq,
            DO_seq,
            Lse_seq,
            Delta_seq,
            stride_qt,
            stride_dot,
            dims,
            dims_v,
            cols,
            masked_lo,
            masked_hi,
            n_low,
            full_end,
            n_low + n_high,
            len_q,
            len_k,
            len_k - len_q,
            window_left,
            window_right,
            qk_scale,
            MASKED=True,
            TWO_RANGES=WINDOW_LEFT and WINDOW_RIGHT,
            WINDOW_LEFT=WINDOW_LEFT,
            WINDOW_RIGHT=WINDOW_RIGHT,
            BLOCK_M=BLOCK_M,
            DOT_UPCAST=DOT_UPCAST,
            HEAD_DIM=HEAD_DIM,
            HEAD_DIM_V=HEAD_DIM_V,
        )
        dk, dv = _dkdv_blocks(
            dk,
            dv,
            k,
            v,
            Q_seq,
            DO_seq,
            Lse_seq,
            Delta_seq,
            stride_qt,
            stride_dot,
            dims,
            dims_v,
            cols,
            masked_end,
            full_end,
            0,
            0,
            0,
            len_q,
            len_k,
            len_k - len_q,
            window_left,
            window_right,
            qk_scale,
            MASKED=False,
            TWO_RANGES=False,
            WINDOW_LEFT=WINDOW_LEFT,
            WINDOW_RIGHT=WINDOW_RIGHT,
            BLOCK_M=BLOCK_M,
            DOT_UPCAST=DOT_UPCAST,
            HEAD_DIM=HEAD_DIM,
            HEAD_DIM_V=HEAD_DIM_V,
        )

    dk_ptrs = DK + kv_head * stride_dkh + (k_start + cols)[:, None] * stride_dkt + dims[None, :]
    dv_ptrs = DV + kv_head * stride_dvh + (k_start + cols)[:, None] * stride_dvt + dims_v[None, :]
    tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None] & (dims < HEAD_DIM)[None, :])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & (dims_v < HEAD_DIM_V)[None, :])


@jit
def _dq_step(
    dq,
    q,
    do,
    lse2,
    delta,
    K,
    V,
    stride_kt,
    stride_vt,
    dims,
    dims_v,
    rows,
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
):
    """One key block of dQ."""
    k, v = _load_keys(K, V, cols, len_k, stride_kt, stride_vt, dims, dims_v, HEAD_DIM, HEAD_DIM_V, MASKED)
    p = tl.exp2(_dot(q, tl.trans(k), DOT_UPCAST) * qk_scale - lse2[:, None])
    if MASKED:
        # A select, not a product: p may be +inf on a row that sees no key (its lse2 is 0).
        p = tl.where(_visible(rows[:, None], cols[None, :], len_k, offset, left, right, WINDOW_LEFT, WINDOW_RIGHT), p, 0.0)
    dp = _dot(do, tl.trans(v), DOT_UPCAST)
    ds = p * (dp - delta[:, None])
    return _dot(ds.to(k.dtype), k, DOT_UPCAST, dq)


@jit
def _dq_blocks(
    dq,
    q,
    do,
    lse2,
    delta,
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
):
    """dQ contributions of key blocks of one sequence (K, V at its first row), walked as in
    _forward_blocks."""
    offs = tl.arange(0, BLOCK_N)
    if TWO_RANGES:
        for i in range(0, n_blocks):
            cols = _block_start(i, first_lo, n_first, second_lo, BLOCK_N) + offs
            dq = _dq_step(
                dq,
                q,
                do,
                lse2,
                delta,
                K,
                V,
                stride_kt,
                stride_vt,
                dims,
                dims_v,
                rows,
                cols,
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
            )
    else:
        for col_start in range(first_lo, hi, BLOCK_N):
            dq = _dq_step(
                dq,
                q,
                do,
                lse2,
                delta,
                K,
                V,
                stride_kt,
                stride_vt,
                dims,
                dims_v,
                rows,
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
            )
    return dq


@jit(do_not_specialize=["n_seqs", "n_search_steps", "window_left", "window_right"])
def attention_backward_dq_kernel(
    Q,
    K,
    V,
    Out,
    DOut,
    Lse,
    DLse,
    Delta,
    DQ,
    cu_q,
    cu_k,
    cu_q_padded,
    cu_k_padded,
    block_starts,
    n_seqs,
    n_search_steps,
    qk_scale,
    scale,
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
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lh,
    HAS_DLSE: tl.constexpr,
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
):
    """dQ of one block of BLOCK_M query rows of one sequence and one head.

    A pass separate from dK/dV (it recomputes P and dP) so that every dQ row is owned by one
    program: deterministic, no fp32 atomics, no memset of dQ. It runs first and computes its
    rows' delta = rowsum(dO * O) - dlse itself (dS = P * (dP - delta)), storing it for the
    dK/dV pass: no separate delta launch. Without HAS_DLSE (lse unused, the usual case) DLse
    is not read: dlse = 0.
    """
    head = tl.program_id(1)
    seq, block = _work_item(tl.program_id(0), block_starts, n_seqs, n_search_steps, REVERSE=WINDOW_RIGHT)
    if seq == n_seqs:
        return
    q_start, len_q = _sequence(cu_q, cu_q_padded, seq)
    k_start, len_k = _sequence(cu_k, cu_k_padded, seq)
    row_start = block * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    dims = tl.arange(0, BLOCK_D)  # q/k lanes: those past HEAD_DIM load 0 and are never stored
    dims_v = tl.arange(0, BLOCK_DV)  # v/out/dO lanes: those past HEAD_DIM_V load 0
    q = _load_rows(Q + head * stride_qh, q_start, rows, row_ok, stride_qt, dims, HEAD_DIM)
    do = _load_rows(DOut + head * stride_doh, q_start, rows, row_ok, stride_dot, dims_v, HEAD_DIM_V)
    lse_row0 = head * stride_lh + q_start
    lse2 = _load_lse_log2(Lse + lse_row0, rows, row_ok)
    o = _load_rows(Out + head * stride_oh, q_start, rows, row_ok, stride_ot, dims_v, HEAD_DIM_V)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLse + lse_row0 + rows, mask=row_ok, other=0.0)
    tl.store(Delta + lse_row0 + rows, delta, mask=row_ok)  # read by the dK/dV pass, launched next
    K += (head // GROUP) * stride_kh + k_start * stride_kt
    V += (head // GROUP) * stride_vh + k_start * stride_vt

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_lo, full_lo, full_hi, key_hi = _key_ranges(
        row_start, len_q, len_k, window_left, window_right, WINDOW_LEFT, WINDOW_RIGHT, BLOCK_M, BLOCK_N
    )
    n_left = (full_lo - key_lo) // BLOCK_N
    n_right = tl.cdiv(tl.maximum(key_hi - full_hi, 0), BLOCK_N)
    masked_lo = full_hi
    if WINDOW_LEFT:
        masked_lo = key_lo
    dq = _dq_blocks(
        dq,
        q,
        do,
        lse2,
        delta,
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
    )
    dq = _dq_blocks(
        dq,
        q,
        do,
        lse2,
        delta,
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
    )

    dq_ptrs = DQ + head * stride_dqh + (q_start + rows)[:, None] * stride_dqt + dims[None, :]
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])
