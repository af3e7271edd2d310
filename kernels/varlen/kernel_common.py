"""What the forward and backward kernels of the fixed varlen attention share: the work lists
of both passes, the fill of padding rows, and the @jit helpers they call (the window's mask
and the ranges of blocks it reaches, the loads of real rows, `_dot`). The attention kernels
themselves are in `forward_kernels` and `backward_kernels`.

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
`exp`; lse is stored in natural log (LN2, by the forward pass) and read back in base 2 (LOG2E,
by the backward passes).
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
