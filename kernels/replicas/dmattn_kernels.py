"""The Triton kernels of the flash-dmattn replica: forward, the backward's dO.O preprocessing and
backward (each with the `guard` and `patch` switches), and the Copilot PR's masking exactly as
written, which cannot compile. `dmattn` launches them, and says what they replicate and why.
"""

import triton.language as tl

from varlen_workbench.kernels.runtime import jit


@jit
def _finite_or_zero(x):
    """The Copilot patch's `tl.where(tl.isfinite(x), x, 0.0)`: NaN fails x == x, +-inf fails |x| < inf."""
    return tl.where((x == x) & (tl.abs(x) < float("inf")), x, 0.0)


@jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The Triton interpreter multiplies the raw bits of bf16 operands (triton-lang/triton#11584):
    # there only (UPCAST comes from varlen_workbench.kernels.interpreter.dot_upcast_needed), operands already
    # rounded to the input dtype are upcast to fp32. Native code never takes this branch.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b)


@jit
def _scores(
    q,
    k,
    Mask,
    Bias,
    offs_m,
    offs_n,
    stride_mm,
    stride_bm,
    seqlen_q,
    seqlen_k,
    softmax_scale,
    mask,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Scaled scores plus bias for one (query tile, key block), masked entries at -inf (as upstream)."""
    acc_s = _dot(q, tl.trans(k), UPCAST) * softmax_scale
    if HAS_BIAS:
        bias = tl.load(
            Bias + offs_m[:, None] * stride_bm + offs_n[None, :],
            mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k),
            other=0.0,
        )
        acc_s += bias.to(tl.float32)
    acc_s += tl.where(offs_n[None, :] < seqlen_k, 0.0, float("-inf"))
    if IS_CAUSAL:  # top-left aligned, as upstream at the time of the report
        acc_s += tl.where(offs_m[:, None] >= offs_n[None, :], 0.0, float("-inf"))
    if HAS_MASK:
        acc_s += tl.where(mask, 0.0, float("-inf"))
    return acc_s


@jit
def _load_mask(Mask, offs_m, offs_n, stride_mm, seqlen_q, seqlen_k, HAS_MASK: tl.constexpr):
    """The tile's mask and whether any entry is True; rows/keys out of range load as False (upstream's other=False)."""
    if HAS_MASK:
        mask = tl.load(
            Mask + offs_m[:, None] * stride_mm + offs_n[None, :],
            mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k),
            other=False,
        )
        # upstream: tl.reduce_or(mask, axis=None). A max is the same test, and the interpreter runs
        # it in numpy instead of calling the combine function once per element (seconds per tile).
        any_active = tl.max(tl.max(mask.to(tl.int32), 1), 0) > 0
    else:
        mask = offs_n[None, :] >= 0  # unused: HAS_MASK=False compiles the mask term out
        any_active = True
    return mask, any_active


@jit
def _fwd_kernel(
    Q,
    K,
    V,
    Mask,
    Bias,
    Out,
    Lse,
    softmax_scale,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_ob,
    stride_om,
    stride_oh,
    nheads,
    group,
    seqlen_q,
    seqlen_k,
    seqlen_q_rounded,
    headdim,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GUARD: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_HEADDIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_hb = tl.program_id(1)
    off_b = off_hb // nheads
    off_h = off_hb % nheads
    off_hk = off_h // group
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_HEADDIM)
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_kb + off_hk * stride_kh
    Mask += off_b * stride_mb + off_hk * stride_mh
    Bias += off_b * stride_bb + off_hk * stride_bh

    lse_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_M, BLOCK_HEADDIM], dtype=tl.float32)
    q = tl.load(
        Q + offs_m[:, None] * stride_qm + offs_d[None, :],
        mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < headdim),
        other=0.0,
    )
    end_n = seqlen_k if not IS_CAUSAL else tl.minimum((start_m + 1) * BLOCK_M, seqlen_k)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        mask, any_active = _load_mask(Mask, offs_m, cols, stride_mm, seqlen_q, seqlen_k, HAS_MASK)
        if any_active:  # dynamic-mask block skipping: no True entry in the whole tile
            kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < headdim)
            k = tl.load(K + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            acc_s = _scores(
                q,
                k,
                Mask,
                Bias,
                offs_m,
                cols,
                stride_mm,
                stride_bm,
                seqlen_q,
                seqlen_k,
                softmax_scale,
                mask,
                IS_CAUSAL,
                HAS_MASK,
                HAS_BIAS,
                UPCAST,
            )
            # THE BUG: a row fully masked in the first block it visits has m_ij = -inf here,
            # and exp(-inf - (-inf)) = NaN below.
            m_ij = tl.maximum(tl.max(acc_s, 1), lse_i)
            if GUARD:
                m_ij = tl.where(m_ij > float("-inf"), m_ij, 0.0)
            p = tl.exp(acc_s - m_ij[:, None])
            l_ij = tl.sum(p, 1)
            acc_o = acc_o * tl.exp(m_i - m_ij)[:, None]
            v = tl.load(V + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            acc_o += _dot(p.to(v.dtype), v, UPCAST)
            m_i = m_ij
            l_i_new = tl.exp(lse_i - m_ij) + l_ij
            if GUARD:
                l_i_new = tl.where(lse_i > float("-inf"), l_i_new, l_ij)
            lse_i = m_ij + tl.log(l_i_new)

    o_scale = tl.exp(m_i - lse_i)  # also NaN for a row that never visited a block: exp(-inf - (-inf))
    if GUARD:
        o_scale = tl.where(lse_i > float("-inf"), o_scale, 0.0)
    acc_o = acc_o * o_scale[:, None]
    tl.store(Lse + off_hb * seqlen_q_rounded + offs_m, lse_i)
    tl.store(
        Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
        acc_o.to(Out.dtype.element_ty),
        mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < headdim),
    )


@jit
def _bwd_preprocess_do_o_dot(
    Out,
    DO,
    Delta,
    stride_ob,
    stride_om,
    stride_oh,
    stride_dob,
    stride_dom,
    stride_doh,
    nheads,
    seqlen_q,
    seqlen_q_rounded,
    headdim,
    BLOCK_M: tl.constexpr,
    BLOCK_HEADDIM: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_hb = tl.program_id(1)
    off_b = off_hb // nheads
    off_h = off_hb % nheads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_HEADDIM)
    inside = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < headdim)
    o = tl.load(
        Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], mask=inside, other=0.0
    ).to(tl.float32)
    do = tl.load(
        DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :], mask=inside, other=0.0
    ).to(tl.float32)
    tl.store(Delta + off_hb * seqlen_q_rounded + offs_m, tl.sum(o * do, axis=1))


@jit
def _bwd_kernel(
    Q,
    K,
    V,
    Mask,
    Bias,
    DO,
    DQ,
    DK,
    DV,
    DBias,
    LSE,
    D,
    Written,
    softmax_scale,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_dob,
    stride_dom,
    stride_doh,
    stride_dqb,
    stride_dqm,
    stride_dqh,
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dbb,
    stride_dbh,
    stride_dbm,
    nheads,
    group,
    seqlen_q,
    seqlen_k,
    seqlen_q_rounded,
    headdim,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GUARD: tl.constexpr,
    PATCH: tl.constexpr,
    RECORD_WRITES: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_HEADDIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    off_hb = tl.program_id(1)
    off_b = off_hb // nheads
    off_h = off_hb % nheads
    off_hk = off_h // group
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_kb + off_hk * stride_kh
    Mask += off_b * stride_mb + off_hk * stride_mh
    Bias += off_b * stride_bb + off_hk * stride_bh
    DO += off_b * stride_dob + off_h * stride_doh
    DQ += off_b * stride_dqb + off_h * stride_dqh
    DK += off_b * stride_dkb + off_h * stride_dkh  # per query head; the wrapper sums GQA groups
    DV += off_b * stride_dkb + off_h * stride_dkh
    DBias += off_b * stride_dbb + off_h * stride_dbh
    LSE += off_hb * seqlen_q_rounded
    D += off_hb * seqlen_q_rounded
    Written += off_hb * seqlen_k
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_HEADDIM)
    num_block_m = tl.cdiv(seqlen_q, BLOCK_M)
    for start_n in range(0, tl.cdiv(seqlen_k, BLOCK_N)):
        # Tri Dao's _bwd_kernel_one_col_block, inlined: one key block, every query tile below it.
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < headdim)
        dv = tl.zeros([BLOCK_N, BLOCK_HEADDIM], dtype=tl.float32)
        dk = tl.zeros([BLOCK_N, BLOCK_HEADDIM], dtype=tl.float32)
        begin_m = 0 if not IS_CAUSAL else ((start_n * BLOCK_N) // BLOCK_M) * BLOCK_M
        # Upstream's causal early exit (`if begin_m >= seqlen_q: store zeros; return`) as an
        # empty loop: dk/dv of this block stay zero and are stored below, like every other block.
        k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        for start_m in range(begin_m, num_block_m * BLOCK_M, BLOCK_M):
            rows = start_m + offs_m
            mask, any_active = _load_mask(Mask, rows, offs_n, stride_mm, seqlen_q, seqlen_k, HAS_MASK)
            if any_active:
                q_mask = (rows[:, None] < seqlen_q) & (offs_d[None, :] < headdim)
                q = tl.load(Q + rows[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
                acc_s = _scores(
                    q,
                    k,
                    Mask,
                    Bias,
                    rows,
                    offs_n,
                    stride_mm,
                    stride_bm,
                    seqlen_q,
                    seqlen_k,
                    softmax_scale,
                    mask,
                    IS_CAUSAL,
                    HAS_MASK,
                    HAS_BIAS,
                    UPCAST,
                )
                lse_i = tl.load(LSE + rows)
                if GUARD:
                    lse_i = tl.where(lse_i > float("-inf"), lse_i, 0.0)
                p = tl.exp(acc_s - lse_i[:, None])  # NaN lse: NaN for every key of the block
                do = tl.load(DO + rows[:, None] * stride_dom + offs_d[None, :], mask=q_mask, other=0.0)
                if PATCH:
                    do = _finite_or_zero(do)
                dv_delta = _dot(tl.trans(p.to(do.dtype)), do, UPCAST)
                if PATCH:  # one NaN row of p makes the whole delta NaN: the tile's contribution is dropped
                    dv_delta = _finite_or_zero(dv_delta)
                dv += dv_delta
                dp = _dot(do, tl.trans(v), UPCAST)
                Di = tl.load(D + rows)
                dbias = p * (dp - Di[:, None])
                ds = (dbias * softmax_scale).to(q.dtype)
                if HAS_BIAS:
                    tl.store(
                        DBias + rows[:, None] * stride_dbm + offs_n[None, :],
                        dbias,
                        mask=(rows[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k),
                    )
                dk_delta = _dot(tl.trans(ds), q, UPCAST)
                if PATCH:
                    dk_delta = _finite_or_zero(dk_delta)
                dk += dk_delta
                dq_ptrs = DQ + rows[:, None] * stride_dqm + offs_d[None, :]
                dq = tl.load(dq_ptrs, mask=q_mask, other=0.0)
                tl.store(dq_ptrs, dq + _dot(ds, k, UPCAST), mask=q_mask)
        if PATCH:
            dv = _finite_or_zero(dv)
            dk = _finite_or_zero(dk)
        tl.store(DV + offs_n[:, None] * stride_dkn + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)
        tl.store(DK + offs_n[:, None] * stride_dkn + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
        if RECORD_WRITES:  # instrumentation: which dk/dv rows the store above covered
            tl.store(Written + offs_n, tl.full([BLOCK_N], 1, tl.int8), mask=offs_n < seqlen_k)


@jit
def _copilot_where_isfinite(X, Y, N: tl.constexpr):
    """The Copilot PR's masking exactly as written: `tl.where(tl.isfinite(x), x, 0.0)`."""
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, tl.where(tl.isfinite(x), x, 0.0))
