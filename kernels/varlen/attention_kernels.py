"""Triton kernels of the fixed varlen attention: forward, backward (dq with delta, then dk/dv),
the work lists they share, and the fill of padding rows.

Work is split into (sequence, block) pairs: program `pid` of a launch owns block
`pid - block_starts[seq]` of sequence `seq`, found by binary search of `block_starts` (the
running count of blocks per sequence, written on the device by `block_starts_kernel`). The grid
is an upper bound (`cdiv(T, BLOCK) + B`), so no host sync is needed, and surplus programs exit.

The attention kernels read and write REAL rows only: every load of q, k, v, dO, O, lse is
masked by the real length (never the padded one), so NaN or Inf in padding never enters a
computation. Padding rows of the outputs are written by `fill_padding_rows_kernel`.

Masks are FlashAttention's windows, bottom-right aligned: query i of a sequence sees key j iff
i + off - left <= j <= i + off + right, off = len_k - len_q, a bound of -1 being unbounded
(causal is (-1, 0)). WINDOW_LEFT / WINDOW_RIGHT (constexpr) say which bound exists, so the
unbounded sides compile to nothing. Key blocks wholly outside a program's window are never
visited, in the forward pass and in both backward passes.

Key loops are split as in Triton's fused-attention tutorial: blocks that every row of the
program sees in full run with no score mask and no -inf guard; only the blocks on the window's
edges or holding the ragged end of the keys pay for them. Rows past the real length of
the last block are never stored, and their zero-filled q/dO make their backward terms exactly
0, so no loop masks them.

Head dims: q and k have HEAD_DIM features, v, out and dO HEAD_DIM_V (192 and 128 in
DeepSeek-style attention), each any multiple of 8 up to 256. A kernel computes on BLOCK_D and
BLOCK_DV lanes, the next powers of two (at least 16, the smallest K of `tl.dot`): lanes past a
head dim load 0, so they add exactly 0 to every score, dot product and rowsum, and are never
stored. At a power-of-two head dim the lane masks are all true and cost nothing: at 64 and 128
(bf16, sm_90) every candidate tile compiles to the registers, spills and shared memory it had
without them (`python -m varlen_workbench.kernels.varlen.tiles`).

Scores live in base 2: `qk_scale = scale * log2(e)` so that `exp2` (one instruction) replaces
`exp`; lse is stored in natural log.
"""

import triton.language as tl

from varlen_workbench.kernels.runtime import jit

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@jit
def write_block_starts(
    cu_seqlens,
    Starts,
    n_seqs,
    stride_size,
    keep,
    SMALLEST_LOG2: tl.constexpr,
    N_SIZES: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Starts[i, s]: the running count of blocks of 2**(SMALLEST_LOG2 + i) rows per sequence
    before sequence s, for the N_SIZES block sizes of one side. Every length counts as 0 where
    `keep` is false: the work lists of a failed device check's all-zero safe copy."""
    sizes = tl.arange(0, N_SIZES)
    log2_block = (SMALLEST_LOG2 + sizes)[:, None]
    tl.store(Starts + sizes * stride_size, tl.zeros([N_SIZES], tl.int32))
    total = tl.zeros([N_SIZES], tl.int32)
    for first in range(0, n_seqs, CHUNK):
        seqs = first + tl.arange(0, CHUNK)
        ok = seqs < n_seqs
        lengths = tl.load(cu_seqlens + seqs + 1, mask=ok, other=0) - tl.load(cu_seqlens + seqs, mask=ok, other=0)
        lengths = tl.where(keep, lengths, 0)
        blocks = ((lengths[None, :] + (1 << log2_block) - 1) >> log2_block).to(tl.int32)
        tl.store(
            Starts + sizes[:, None] * stride_size + 1 + seqs[None, :], total[:, None] + tl.cumsum(blocks, 1), mask=ok[None, :]
        )
        total += tl.sum(blocks, 1)


@jit(do_not_specialize=["n_seqs"])
def block_starts_kernel(
    cu_seqlens_q,
    cu_seqlens_k,
    Starts,
    n_seqs,
    stride_side,
    stride_size,
    SMALLEST_LOG2: tl.constexpr,
    N_SIZES: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The work lists of the queries (program 0) or the keys (program 1), every block size
    (`write_block_starts`).

    One launch writes the work lists of both sides and every block size: the forward pass
    computes them once, and the backward pass reuses them, however its tiles are chosen.
    (`varlen_attention`'s device check writes those of its safe copy itself, no launch.)
    """
    if tl.program_id(0) == 0:
        cu_seqlens = cu_seqlens_q
    else:
        cu_seqlens = cu_seqlens_k
    keep = tl.full([], 1, tl.int1)
    write_block_starts(
        cu_seqlens, Starts + tl.program_id(0) * stride_side, n_seqs, stride_size, keep, SMALLEST_LOG2, N_SIZES, CHUNK
    )


@jit
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


@jit
def _work_item(pid, block_starts, n_seqs, n_search_steps, REVERSE: tl.constexpr):
    """(sequence, block of it) of work item `pid`; sequence == n_seqs for a surplus item.

    REVERSE hands a sequence's blocks out last first: under a causal mask the last query
    blocks see the most keys, and starting the longest work first shortens the final wave.
    """
    seq = _last_at_or_below(block_starts, pid, n_seqs, n_search_steps)
    first = tl.load(block_starts + seq)
    block = pid - first
    if REVERSE:
        block = tl.load(block_starts + seq + 1, mask=seq < n_seqs, other=0) - first - 1 - block
    return seq, block


@jit
def _sequence(cu_real, cu_padded, seq):
    """(first row in memory, real length) of sequence `seq`; int64 rows keep offsets safe."""
    start = tl.load(cu_padded + seq).to(tl.int64)
    length = (tl.load(cu_real + seq + 1) - tl.load(cu_real + seq)).to(tl.int32)
    return start, length


@jit
def _visible(rows, cols, len_k, offset, left, right, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Query `rows` see key `cols` (broadcast): a real key inside the window, bottom-right
    aligned (offset = len_k - len_q). Rows past len_q are not masked: they are never stored."""
    ok = cols < len_k
    if WINDOW_RIGHT:
        ok = ok & (cols <= rows + offset + right)
    if WINDOW_LEFT:
        ok = ok & (cols >= rows + offset - left)
    return ok


@jit
def _key_ranges(
    row_start,
    len_q,
    len_k,
    left,
    right,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(key_lo, full_lo, full_hi, key_hi) for query rows [row_start, row_start + BLOCK_M):
    key blocks in [full_lo, full_hi) are real keys seen by every real one of those rows (no
    mask); [key_lo, full_lo) and [full_hi, key_hi) need a mask; keys outside [key_lo, key_hi)
    are seen by none of the rows and are never loaded. Without a left bound key_lo = full_lo = 0."""
    offset = len_k - len_q
    last_row = tl.minimum(row_start + BLOCK_M, len_q) - 1
    if WINDOW_RIGHT:
        key_hi = tl.minimum(tl.maximum(last_row + offset + right + 1, 0), len_k)
        all_hi = tl.minimum(tl.maximum(row_start + offset + right + 1, 0), len_k)
    else:
        key_hi = len_k
        all_hi = len_k
    if WINDOW_LEFT:
        key_lo = tl.maximum(row_start + offset - left, 0)
        all_lo = tl.maximum(last_row + offset - left, 0)
    else:
        key_lo = len_k * 0
        all_lo = key_lo
    key_lo = (key_lo // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(all_lo, BLOCK_N) * BLOCK_N
    full_hi = (all_hi // BLOCK_N) * BLOCK_N
    # No block seen in full: everything in [key_lo, key_hi) is masked, walked as the range from
    # full_hi (the left edge [key_lo, full_lo) is then empty, with or without a left bound).
    none_full = full_hi <= full_lo
    full_lo = tl.where(none_full, key_lo, full_lo)
    full_hi = tl.where(none_full, key_lo, full_hi)
    return key_lo, full_lo, full_hi, key_hi


@jit
def _query_ranges(
    col_start,
    len_q,
    len_k,
    left,
    right,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(row_lo, masked_end, full_end, row_hi) for keys [col_start, col_start + BLOCK_N): query
    rows outside [row_lo, row_hi) see none of them; steps of BLOCK_M rows from row_lo up to
    masked_end and from full_end up to row_hi need a mask, those in [masked_end, full_end)
    see every real key of the block (rows past len_q in that range read q = dO = 0 and add
    exactly 0, so they need none)."""
    offset = len_k - len_q
    last_col = tl.minimum(col_start + BLOCK_N, len_k) - 1
    if WINDOW_LEFT:
        row_hi = tl.minimum(tl.maximum(last_col - offset + left + 1, 0), len_q)
        all_hi = tl.minimum(tl.maximum(col_start - offset + left + 1, 0), len_q)
    else:
        row_hi = len_q
        all_hi = len_q
    if WINDOW_RIGHT:
        row_lo = tl.minimum(tl.maximum(col_start - offset - right, 0), row_hi)
        all_lo = tl.maximum(last_col - offset - right, row_lo)
    else:
        row_lo = len_q * 0
        all_lo = row_lo
    masked_end = tl.minimum(row_lo + tl.cdiv(all_lo - row_lo, BLOCK_M) * BLOCK_M, row_hi)
    whole = masked_end + (tl.maximum(all_hi - masked_end, 0) // BLOCK_M) * BLOCK_M
    # When every row from masked_end to len_q sees the block, the last partial step needs no
    # mask either (its rows past len_q add 0).
    full_end = tl.where(all_hi >= len_q, row_hi, whole)
    full_end = tl.maximum(full_end, masked_end)
    return row_lo, masked_end, full_end, row_hi


@jit
def _block_start(i, lo, n_first, second_lo, STEP: tl.constexpr):
    """Start of step i of a walk over [lo, lo + n_first * STEP) then on from second_lo: the
    window's two masked edges in one loop. With a left and a right bound a kernel then compiles
    two loops (unmasked, masked), as without them; a third loop costs registers (spills at head
    dim 128). Other masks walk one range with `range(lo, hi, STEP)`, as before windows."""
    return tl.where(i < n_first, lo + i * STEP, second_lo + (i - n_first) * STEP)


@jit
def _dot(a, b, DOT_UPCAST: tl.constexpr, acc=None):
    # Under the Triton interpreter, tl.dot on bfloat16 multiplies the raw bit patterns
    # (triton-lang/triton#11584). There, and only there, bf16 operands are upcast to fp32:
    # exact, since every bf16 is an fp32, so the result is the native bf16 dot up to summation
    # order. DOT_UPCAST is a constexpr from varlen_workbench.kernels.interpreter.dot_upcast_needed, False
    # natively, so the branch is compiled out and bf16 goes to the tensor cores as it is.
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # "ieee": fp32 operands get a true fp32 product, not TF32 (no effect on fp16/bf16).
    return tl.dot(a, b, acc, input_precision="ieee")


@jit
def _load_rows(base, start, rows, row_ok, stride_t, dims, WIDTH: tl.constexpr):
    """A (rows, lanes) tile of a head of WIDTH features (the lanes `dims` past WIDTH read as 0);
    rows past the real length read as 0, never touching padding."""
    mask = row_ok[:, None] & (dims < WIDTH)[None, :]
    return tl.load(base + (start + rows)[:, None] * stride_t + dims[None, :], mask=mask, other=0.0)


@jit
def _load_keys(
    K, V, cols, len_k, stride_kt, stride_vt, dims, dims_v, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASKED: tl.constexpr
):
    """k, v tiles of keys `cols` (K, V at the sequence's first row; k on the lanes `dims`, v on
    `dims_v`, the lanes past HEAD_DIM / HEAD_DIM_V read as 0). Row offsets are int64, as in
    _load_rows, and recomputed each step from `cols`: a loop-carried tile of pointers would hold
    64 bits per element in registers for the whole loop. Unmasked: every col < len_k."""
    rows = cols.to(tl.int64)[:, None]
    k_ok = (dims < HEAD_DIM)[None, :]
    v_ok = (dims_v < HEAD_DIM_V)[None, :]
    if MASKED:
        col_ok = (cols < len_k)[:, None]
        k_ok = k_ok & col_ok
        v_ok = v_ok & col_ok
    k = tl.load(K + rows * stride_kt + dims[None, :], mask=k_ok, other=0.0)
    v = tl.load(V + rows * stride_vt + dims_v[None, :], mask=v_ok, other=0.0)
    return k, v


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


@jit
def _fill_padding_rows(
    X,
    stride_row,
    stride_col,
    n_rows,
    n_cols,
    value,
    cu_real,
    cu_padded,
    n_seqs,
    n_search_steps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Writes `value` into the padding rows (GAP or TAIL) of this program's tile of X.

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


@jit(do_not_specialize=["n_seqs", "n_search_steps"])
def fill_padding_rows_kernel(
    X0,
    stride0_row,
    stride0_col,
    n0_rows,
    n0_cols,
    value0,
    cu0_real,
    cu0_padded,
    X1,
    stride1_row,
    stride1_col,
    n1_rows,
    n1_cols,
    value1,
    cu1_real,
    cu1_padded,
    X2,
    stride2_row,
    stride2_col,
    n2_rows,
    n2_cols,
    value2,
    cu2_real,
    cu2_padded,
    n_seqs,
    n_search_steps,
    Verdict,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    POISON: tl.constexpr,
):
    """The padding rows of up to three (rows, cols) views, X<program_id(2)>: one launch per pass
    (every launch costs tens of microseconds of host time, more than these writes take).
    POISON: a device check's verdict is read, and NaN written instead of each value where it
    failed: its safe copy makes every row padding, and a malformed batch must never pass as zeros."""
    target = tl.program_id(2)
    poison = 0.0
    if POISON:
        poison = tl.where(tl.load(Verdict) != 0, float("nan"), 0.0)
    if target == 0:
        _fill_padding_rows(
            X0,
            stride0_row,
            stride0_col,
            n0_rows,
            n0_cols,
            value0 + poison,
            cu0_real,
            cu0_padded,
            n_seqs,
            n_search_steps,
            BLOCK_ROWS,
            BLOCK_COLS,
        )
    elif target == 1:
        _fill_padding_rows(
            X1,
            stride1_row,
            stride1_col,
            n1_rows,
            n1_cols,
            value1 + poison,
            cu1_real,
            cu1_padded,
            n_seqs,
            n_search_steps,
            BLOCK_ROWS,
            BLOCK_COLS,
        )
    else:
        _fill_padding_rows(
            X2,
            stride2_row,
            stride2_col,
            n2_rows,
            n2_cols,
            value2 + poison,
            cu2_real,
            cu2_padded,
            n_seqs,
            n_search_steps,
            BLOCK_ROWS,
            BLOCK_COLS,
        )
