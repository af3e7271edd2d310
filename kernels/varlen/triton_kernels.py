"""Triton kernels of the fixed varlen attention: forward, backward (preprocess, dk/dv, dq), and
the fill of padding rows.

Work is split into (sequence, block) pairs: program `pid` of a launch owns block
`pid - block_starts[seq]` of sequence `seq`, found by binary search of `block_starts` (the
running count of blocks per sequence, computed on the device). The grid is an upper bound
(`cdiv(T, BLOCK) + B`), so no host sync is needed, and surplus programs exit at once.

The attention kernels read and write REAL rows only: every load of q, k, v, dO, O, lse is
masked by the real length (never the padded one), so NaN or Inf in padding never enters a
computation. Padding rows of the outputs are written by `fill_padding_rows_kernel`.

Scores live in base 2: `qk_scale = scale * log2(e)` so that `exp2` (one instruction) replaces
`exp`; lse is stored in natural log.
"""
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _last_at_or_below(boundaries, x, n_segments, n_steps):
    """Largest s in [0, n_segments] with boundaries[s] <= x, elementwise for x >= 0.

    `boundaries` is non-decreasing from boundaries[0] = 0; n_steps >= ceil(log2(n_segments + 1)).
    With repeated boundaries (empty segments) the last of them wins, i.e. the non-empty one.
    """
    lo = x * 0
    hi = lo + n_segments
    for _ in range(n_steps):
        mid = (lo + hi + 1) // 2
        right = tl.load(boundaries + mid) <= x
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid - 1)
    return lo


@triton.jit
def _sequence(cu_real, cu_padded, seq):
    """(first row in memory, real length) of sequence `seq`; int64 rows keep offsets safe."""
    start = tl.load(cu_padded + seq).to(tl.int64)
    length = (tl.load(cu_real + seq + 1) - tl.load(cu_real + seq)).to(tl.int32)
    return start, length


@triton.jit
def _visible(rows, cols, len_q, len_k, CAUSAL: tl.constexpr):
    """Query `rows` see key `cols` (broadcast): both real and, if causal, bottom-right aligned."""
    ok = (rows < len_q) & (cols < len_k)
    if CAUSAL:
        ok = ok & (cols <= rows + (len_k - len_q))
    return ok


@triton.jit
def _key_end(row_end, len_q, len_k, CAUSAL: tl.constexpr):
    """Keys at or past the result are invisible to every query row below `row_end`."""
    if CAUSAL:
        return tl.minimum(tl.maximum(tl.minimum(row_end, len_q) + len_k - len_q, 0), len_k)
    return len_k


@triton.jit
def _query_start(col_start, len_q, len_k, CAUSAL: tl.constexpr):
    """Query rows below the result see no key at or past `col_start`."""
    if CAUSAL:
        return tl.maximum(col_start - (len_k - len_q), 0)
    return col_start * 0


@triton.jit
def _dot(a, b, DOT_UPCAST: tl.constexpr):
    # Under the Triton interpreter, tl.dot on bfloat16 multiplies the raw bit patterns
    # (triton-lang/triton#11584). There, and only there, bf16 operands are upcast to fp32:
    # exact, since every bf16 is an fp32, so the result is the native bf16 dot up to summation
    # order. DOT_UPCAST is a constexpr from kernels.interpreter.dot_upcast_needed, False
    # natively, so the branch is compiled out and bf16 goes to the tensor cores as it is.
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # "ieee": fp32 operands get a true fp32 product, not TF32 (no effect on fp16/bf16).
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_rows(base, start, rows, row_ok, stride_t, dims):
    """A (rows, head_dim) tile; rows past the real length read as 0, never touching padding."""
    return tl.load(base + (start + rows)[:, None] * stride_t + dims[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def attention_forward_kernel(
    Q, K, V, Out, Lse,
    cu_q, cu_k, cu_q_padded, cu_k_padded, block_starts, n_seqs, n_search_steps,
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """One block of BLOCK_M query rows of one sequence and one head: online softmax over keys."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = _last_at_or_below(block_starts, pid, n_seqs, n_search_steps)
    if seq == n_seqs:
        return
    q_start, len_q = _sequence(cu_q, cu_q_padded, seq)
    k_start, len_k = _sequence(cu_k, cu_k_padded, seq)
    row_start = (pid - tl.load(block_starts + seq)) * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    dims = tl.arange(0, HEAD_DIM)
    q = _load_rows(Q + head * stride_qh, q_start, rows, row_ok, stride_qt, dims)
    K += (head // GROUP) * stride_kh
    V += (head // GROUP) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for col_start in range(0, _key_end(row_start + BLOCK_M, len_q, len_k, CAUSAL), BLOCK_N):
        cols = col_start + tl.arange(0, BLOCK_N)
        col_ok = cols < len_k
        k = _load_rows(K, k_start, cols, col_ok, stride_kt, dims)
        v = _load_rows(V, k_start, cols, col_ok, stride_vt, dims)
        s = _dot(q, tl.trans(k), DOT_UPCAST) * qk_scale
        s = tl.where(_visible(rows[:, None], cols[None, :], len_q, len_k, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf: subtract 0 instead, so that
        # exp2 sees -inf - 0 (= 0) and never -inf - (-inf) (= NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_UPCAST)
        m_i = m_new

    # Rows with no visible key have l = 0 and acc = 0: output 0 and lse = -inf, no 0/0.
    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * LN2, float("-inf"))
    out_ptrs = Out + head * stride_oh + (q_start + rows)[:, None] * stride_ot + dims[None, :]
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + head * stride_lh + q_start + rows, lse, mask=row_ok)


@triton.jit
def attention_backward_preprocess_kernel(
    Out, DOut, DLse, Delta,
    cu_q, cu_q_padded, block_starts, n_seqs, n_search_steps,
    stride_ot, stride_oh, stride_dot, stride_doh, stride_lh,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """delta = rowsum(dO * O) - dlse on real rows (dS = P * (dP - delta)); Delta/DLse share lse's layout."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = _last_at_or_below(block_starts, pid, n_seqs, n_search_steps)
    if seq == n_seqs:
        return
    q_start, len_q = _sequence(cu_q, cu_q_padded, seq)
    rows = (pid - tl.load(block_starts + seq)) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    dims = tl.arange(0, HEAD_DIM)
    o = _load_rows(Out + head * stride_oh, q_start, rows, row_ok, stride_ot, dims).to(tl.float32)
    do = _load_rows(DOut + head * stride_doh, q_start, rows, row_ok, stride_dot, dims).to(tl.float32)
    lse_offsets = head * stride_lh + q_start + rows
    dlse = tl.load(DLse + lse_offsets, mask=row_ok, other=0.0)
    tl.store(Delta + lse_offsets, tl.sum(o * do, 1) - dlse, mask=row_ok)


@triton.jit
def _load_lse_log2(Lse, offsets, row_ok):
    """lse in base 2 for exp2(s - lse); -inf (row with no visible key) becomes 0 so that exp2
    never sees +inf. Such rows have every score masked anyway."""
    lse = tl.load(Lse + offsets, mask=row_ok, other=0.0)
    return tl.where(lse == float("-inf"), 0.0, lse * LOG2E)


@triton.jit
def attention_backward_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV,
    cu_q, cu_k, cu_q_padded, cu_k_padded, block_starts, n_seqs, n_search_steps,
    qk_scale, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """dK, dV of one block of BLOCK_N keys of one sequence and one kv head.

    The program loops over the query heads of its GQA group and sums their contributions in
    registers, so each dK/dV row is written once by one program: no atomics, no zeroed buffer.
    Tiles are kept transposed (keys x queries), as in Triton's fused-attention tutorial, so
    that P^T and dS^T feed the dots without a register transpose.
    """
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _last_at_or_below(block_starts, pid, n_seqs, n_search_steps)
    if seq == n_seqs:
        return
    q_start, len_q = _sequence(cu_q, cu_q_padded, seq)
    k_start, len_k = _sequence(cu_k, cu_k_padded, seq)
    col_start = (pid - tl.load(block_starts + seq)) * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    col_ok = cols < len_k
    dims = tl.arange(0, HEAD_DIM)
    k = _load_rows(K + kv_head * stride_kh, k_start, cols, col_ok, stride_kt, dims)
    v = _load_rows(V + kv_head * stride_vh, k_start, cols, col_ok, stride_vt, dims)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    first_row = _query_start(col_start, len_q, len_k, CAUSAL)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for row_start in range(first_row, len_q, BLOCK_M):
            rows = row_start + tl.arange(0, BLOCK_M)
            row_ok = rows < len_q
            qT = tl.load(
                Q + head * stride_qh + (q_start + rows)[None, :] * stride_qt + dims[:, None],
                mask=row_ok[None, :], other=0.0,
            )
            do = _load_rows(DOut + head * stride_doh, q_start, rows, row_ok, stride_dot, dims)
            lse_offsets = head * stride_lh + q_start + rows
            lse2 = _load_lse_log2(Lse, lse_offsets, row_ok)
            delta = tl.load(Delta + lse_offsets, mask=row_ok, other=0.0)
            sT = _dot(k, qT, DOT_UPCAST) * qk_scale
            visible = _visible(rows[None, :], cols[:, None], len_q, len_k, CAUSAL)
            pT = tl.where(visible, tl.exp2(sT - lse2[None, :]), 0.0)
            dv += _dot(pT.to(do.dtype), do, DOT_UPCAST)
            dpT = _dot(v, tl.trans(do), DOT_UPCAST)
            dsT = pT * (dpT - delta[None, :])
            dk += _dot(dsT.to(qT.dtype), tl.trans(qT), DOT_UPCAST)

    dk_ptrs = DK + kv_head * stride_dkh + (k_start + cols)[:, None] * stride_dkt + dims[None, :]
    dv_ptrs = DV + kv_head * stride_dvh + (k_start + cols)[:, None] * stride_dvt + dims[None, :]
    tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def attention_backward_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ,
    cu_q, cu_k, cu_q_padded, cu_k_padded, block_starts, n_seqs, n_search_steps,
    qk_scale, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lh,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """dQ of one block of BLOCK_M query rows of one sequence and one head.

    A pass separate from dK/dV (it recomputes P and dP) so that every dQ row is owned by one
    program: deterministic, no fp32 atomics, no memset of dQ.
    """
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = _last_at_or_below(block_starts, pid, n_seqs, n_search_steps)
    if seq == n_seqs:
        return
    q_start, len_q = _sequence(cu_q, cu_q_padded, seq)
    k_start, len_k = _sequence(cu_k, cu_k_padded, seq)
    row_start = (pid - tl.load(block_starts + seq)) * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    dims = tl.arange(0, HEAD_DIM)
    q = _load_rows(Q + head * stride_qh, q_start, rows, row_ok, stride_qt, dims)
    do = _load_rows(DOut + head * stride_doh, q_start, rows, row_ok, stride_dot, dims)
    lse_offsets = head * stride_lh + q_start + rows
    lse2 = _load_lse_log2(Lse, lse_offsets, row_ok)
    delta = tl.load(Delta + lse_offsets, mask=row_ok, other=0.0)
    K += (head // GROUP) * stride_kh
    V += (head // GROUP) * stride_vh

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for col_start in range(0, _key_end(row_start + BLOCK_M, len_q, len_k, CAUSAL), BLOCK_N):
        cols = col_start + tl.arange(0, BLOCK_N)
        col_ok = cols < len_k
        k = _load_rows(K, k_start, cols, col_ok, stride_kt, dims)
        v = _load_rows(V, k_start, cols, col_ok, stride_vt, dims)
        s = _dot(q, tl.trans(k), DOT_UPCAST) * qk_scale
        visible = _visible(rows[:, None], cols[None, :], len_q, len_k, CAUSAL)
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), DOT_UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_UPCAST)

    dq_ptrs = DQ + head * stride_dqh + (q_start + rows)[:, None] * stride_dqt + dims[None, :]
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def fill_padding_rows_kernel(
    X, stride_row, stride_col, n_rows, n_cols, value,
    cu_real, cu_padded, n_seqs, n_search_steps,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """Writes `value` into every padding row (GAP or TAIL) of a (rows, cols) view of X.

    A row belongs to the last sequence whose padded start is at or below it; it is padding
    when it lies at or past that sequence's real end, or past the last padded end (TAIL).
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    seq = _last_at_or_below(cu_padded, rows, n_seqs, n_search_steps)
    in_batch = seq < n_seqs
    real_len = tl.load(cu_real + seq + 1, mask=in_batch, other=0) - tl.load(cu_real + seq, mask=in_batch, other=0)
    padding = (rows < n_rows) & (rows - tl.load(cu_padded + seq) >= real_len)
    mask = padding[:, None] & (cols < n_cols)[None, :]
    fill = (tl.zeros([BLOCK_ROWS, BLOCK_COLS], tl.float32) + value).to(X.dtype.element_ty)
    tl.store(X + rows.to(tl.int64)[:, None] * stride_row + cols[None, :] * stride_col, fill, mask=mask)
