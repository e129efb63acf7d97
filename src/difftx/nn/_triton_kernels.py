"""The Triton kernels of :mod:`difftx.nn.triton_diff` (imported only when Triton is there).

Layouts: q (B, 2, H, N, D) and k (B, 2, HK, N, D) by their strides (the map axis second), v (B, HK, N, 2D) by its
strides; the output y (B, N, H, 2D) contiguous; the saved pre-norm output, the second map's output and dO
(B, H, N, 2D) contiguous; per-row statistics (B*H*N,) planes: log2-sum-exp of map 1, of map 2, the norm's
1/rms.  Logits are kept in log2 units (scale * log2(e) folded into the scale) so that exp2 serves.
"""

import triton
import triton.language as tl


@triton.jit
def _lambda(LQ1, LK1, LQ2, LK2, lambda_init, D: tl.constexpr):
    """exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init in float32, without inf - inf for two large equal terms."""
    offs = tl.arange(0, D)
    a = tl.sum(tl.load(LQ1 + offs).to(tl.float32) * tl.load(LK1 + offs).to(tl.float32), axis=0)
    b = tl.sum(tl.load(LQ2 + offs).to(tl.float32) * tl.load(LK2 + offs).to(tl.float32), axis=0)
    m = tl.maximum(a, b)
    diff = tl.exp(a - m) - tl.exp(b - m)
    return tl.where(diff == 0.0, 0.0, diff * tl.exp(m)) + lambda_init


@triton.jit
def _rows_pair(base, s_map, s_row, offs_r, offs_d, ok):
    """Rows ``offs_r`` of both maps' (D wide) tensors at ``base`` (map 2 ``s_map`` further): (R, D) each."""
    ptr = base + offs_r[:, None] * s_row + offs_d[None, :]
    return tl.load(ptr, mask=ok[:, None], other=0.0), tl.load(ptr + s_map, mask=ok[:, None], other=0.0)


@triton.jit
def _query_block(N, H, G, BM: tl.constexpr, D: tl.constexpr):
    """A query-block program's place: its (batch, head) b and h, the K/V head hk, its rows offs_m (ok: row_ok), the
    head-dim and value-width offsets."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    return bh, b, h, h // G, offs_m, tl.arange(0, D), tl.arange(0, 2 * D), offs_m < N


@triton.jit
def _visible(pos_q, offs_n, col_ok, docb, doc_q, WINDOW, HAS_DOC: tl.constexpr, HAS_WIN: tl.constexpr):
    """(queries, keys): which keys ``offs_n`` the queries at positions ``pos_q`` see: causal, a real key
    (``col_ok``), and with documents the same document, with a window fewer than WINDOW positions back."""
    ok = (pos_q[:, None] >= offs_n[None, :]) & col_ok[None, :]
    if HAS_DOC:
        doc_k = tl.load(docb + offs_n, mask=col_ok, other=-2)
        ok = ok & (doc_q[:, None] == doc_k[None, :])
    if HAS_WIN:
        ok = ok & (pos_q[:, None] - offs_n[None, :] < WINDOW)
    return ok


@triton.jit
def diff_fwd(Q, K, V, LQ1, LK1, LQ2, LK2, W, Y, OPRE, O2, STATS, DOC,
             s_qb, s_qm, s_qh, s_qn, s_kb, s_km, s_kh, s_kn, s_vb, s_vh, s_vn, s_db,
             N, NK, Q0, H, G, qk_scale, lambda_init, eps, gain, WINDOW,
             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr,
             SAVE: tl.constexpr, PREC: tl.constexpr, HAS_DOC: tl.constexpr, HAS_WIN: tl.constexpr,
             MASKED: tl.constexpr):
    """N queries at positions Q0 .. Q0 + N - 1 over NK keys (Q0 = NK - N: a prompt after a cached prefix, a decoding
    step; 0 in training); document ids by position."""
    pid_m = tl.program_id(0)
    bh, b, h, hk, offs_m, offs_d, offs_v, row_ok = _query_block(N, H, G, BM, D)
    lam = _lambda(LQ1, LK1, LQ2, LK2, lambda_init, D)
    pos_m = Q0 + offs_m  # the queries' positions among the keys
    q1, q2 = _rows_pair(Q + b.to(tl.int64) * s_qb + h * s_qh, s_qm, s_qn, offs_m, offs_d, row_ok)
    kb = K + b.to(tl.int64) * s_kb + hk * s_kh
    vb = V + b.to(tl.int64) * s_vb + hk * s_vh
    m1 = tl.full([BM], float("-inf"), tl.float32)
    m2 = tl.full([BM], float("-inf"), tl.float32)
    l1 = tl.zeros([BM], tl.float32)
    l2 = tl.zeros([BM], tl.float32)
    acc1 = tl.zeros([BM, 2 * D], tl.float32)
    acc2 = tl.zeros([BM, 2 * D], tl.float32)
    lo = Q0 + pid_m * BM  # the block's first query position
    docb, doc_q = DOC, pos_m  # read by _visible only with documents
    if HAS_DOC:
        docb = DOC + b.to(tl.int64) * s_db
        doc_q = tl.load(docb + pos_m, mask=row_ok, other=-1)
    if HAS_WIN:  # the first key block any row of this block sees
        first = tl.maximum(lo - WINDOW + 1, 0) // BN * BN
    else:
        first = 0
    for start in range(first, tl.minimum(lo + BM, NK), BN):  # (keys past NK are masked)
        offs_n = start + tl.arange(0, BN)
        col_ok = offs_n < NK
        k1 = tl.load(kb + offs_n[None, :] * s_kn + offs_d[:, None], mask=col_ok[None, :], other=0.0)  # (D, BN)
        k2 = tl.load(kb + s_km + offs_n[None, :] * s_kn + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        vv = tl.load(vb + offs_n[:, None] * s_vn + offs_v[None, :], mask=col_ok[:, None], other=0.0)  # (BN, 2D)
        s1 = tl.dot(q1, k1, input_precision=PREC) * qk_scale
        s2 = tl.dot(q2, k2, input_precision=PREC) * qk_scale
        if MASKED:  # documents or a window: every block
            ok = _visible(pos_m, offs_n, col_ok, docb, doc_q, WINDOW, HAS_DOC, HAS_WIN)
            s1 = tl.where(ok, s1, float("-inf"))
            s2 = tl.where(ok, s2, float("-inf"))
        else:
            if start + BN > lo:  # the diagonal blocks: causal and key-count masks
                ok = _visible(pos_m, offs_n, col_ok, docb, doc_q, WINDOW, False, False)
                s1 = tl.where(ok, s1, float("-inf"))
                s2 = tl.where(ok, s2, float("-inf"))
        m1n = tl.maximum(m1, tl.max(s1, 1))
        m2n = tl.maximum(m2, tl.max(s2, 1))
        if MASKED:  # a row may have seen no key yet (all -inf): exp2(-inf - -inf) would be NaN
            m1n = tl.where(m1n == float("-inf"), -1e30, m1n)
            m2n = tl.where(m2n == float("-inf"), -1e30, m2n)
        p1 = tl.exp2(s1 - m1n[:, None])
        p2 = tl.exp2(s2 - m2n[:, None])
        a1 = tl.exp2(m1 - m1n)
        a2 = tl.exp2(m2 - m2n)
        l1 = l1 * a1 + tl.sum(p1, 1)
        l2 = l2 * a2 + tl.sum(p2, 1)
        acc1 = acc1 * a1[:, None] + tl.dot(p1.to(vv.dtype), vv, input_precision=PREC)
        acc2 = acc2 * a2[:, None] + tl.dot(p2.to(vv.dtype), vv, input_precision=PREC)
        m1 = m1n
        m2 = m2n
    o2 = acc2 / l2[:, None]
    o = acc1 / l1[:, None] - lam * o2
    rows = bh.to(tl.int64) * N + offs_m
    if SAVE:
        tl.store(OPRE + rows[:, None] * (2 * D) + offs_v[None, :], o.to(OPRE.dtype.element_ty), mask=row_ok[:, None])
        tl.store(O2 + rows[:, None] * (2 * D) + offs_v[None, :], o2.to(O2.dtype.element_ty), mask=row_ok[:, None])
        plane = N * tl.num_programs(1)
        tl.store(STATS + rows, m1 + tl.log2(l1), mask=row_ok)
        tl.store(STATS + plane + rows, m2 + tl.log2(l2), mask=row_ok)
    if NORM:
        r = 1.0 / tl.sqrt(tl.sum(o * o, 1) / (2 * D) + eps)
        y = o * r[:, None]
        if HAS_W:
            y = y * tl.load(W + offs_v).to(tl.float32)[None, :]
        y = y * gain
        if SAVE:
            tl.store(STATS + 2 * plane + rows, r, mask=row_ok)
    else:
        y = o
    out = ((b.to(tl.int64) * N + offs_m) * H + h) * (2 * D)
    tl.store(Y + out[:, None] + offs_v[None, :], y.to(Y.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def diff_bwd_rows(DY, OPRE, O2, W, STATS, DO, DELTA, PART, LQ1, LK1, LQ2, LK2,
                  N, H, lambda_init, gain,
                  D: tl.constexpr, BM: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr):
    """Per query row: dO of the combined output (through the norm), D1 = rowsum(dO * o1), D2 = rowsum(dO * o2);
    per program: partial sums of the norm weight's gradient and of lambda's (-sum D2)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    lam = _lambda(LQ1, LK1, LQ2, LK2, lambda_init, D)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_v = tl.arange(0, 2 * D)
    row_ok = offs_m < N
    plane = N * tl.num_programs(1)
    rows = bh.to(tl.int64) * N + offs_m
    out = ((b.to(tl.int64) * N + offs_m) * H + h) * (2 * D)
    dy = tl.load(DY + out[:, None] + offs_v[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    o = tl.load(OPRE + rows[:, None] * (2 * D) + offs_v[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    o2 = tl.load(O2 + rows[:, None] * (2 * D) + offs_v[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    if NORM:
        r = tl.load(STATS + 2 * plane + rows, mask=row_ok, other=0.0)
        g = dy * gain
        if HAS_W:
            g = g * tl.load(W + offs_v).to(tl.float32)[None, :]
        c = tl.sum(g * o, 1) * r * r * r / (2 * D)
        do = r[:, None] * g - o * c[:, None]
        dw = tl.sum(dy * o * r[:, None], 0) * gain
    else:
        do = dy
        dw = tl.zeros([2 * D], tl.float32)
    do = do.to(DO.dtype.element_ty)
    tl.store(DO + rows[:, None] * (2 * D) + offs_v[None, :], do, mask=row_ok[:, None])
    do = do.to(tl.float32)  # the row terms from the dO the products will read
    d1 = tl.sum(do * (o + lam * o2), 1)
    d2 = tl.sum(do * o2, 1)
    tl.store(DELTA + rows, d1, mask=row_ok)
    tl.store(DELTA + plane + rows, d2, mask=row_ok)
    pid = bh * tl.num_programs(0) + pid_m
    tl.store(PART + pid * (2 * D + 1) + offs_v, dw)
    tl.store(PART + pid * (2 * D + 1) + 2 * D, -tl.sum(d2, 0))


@triton.jit
def diff_bwd_reduce(PART, P, LQ1, LK1, LQ2, LK2, OUT, D: tl.constexpr, BP: tl.constexpr):
    """One program: the partials summed in a fixed order; OUT = [dlq1, dlk1, dlq2, dlk2, dw] (6D floats)."""
    offs_v = tl.arange(0, 2 * D)
    offs_p = tl.arange(0, BP)
    acc = tl.zeros([2 * D], tl.float32)
    accl = tl.zeros([BP], tl.float32)
    for start in range(0, P, BP):
        rows = start + offs_p
        ok = rows < P
        acc += tl.sum(tl.load(PART + rows[:, None] * (2 * D + 1) + offs_v[None, :], mask=ok[:, None], other=0.0), 0)
        accl += tl.load(PART + rows * (2 * D + 1) + 2 * D, mask=ok, other=0.0)
    dlam = tl.sum(accl, 0)
    offs = tl.arange(0, D)
    q1 = tl.load(LQ1 + offs).to(tl.float32)
    k1 = tl.load(LK1 + offs).to(tl.float32)
    q2 = tl.load(LQ2 + offs).to(tl.float32)
    k2 = tl.load(LK2 + offs).to(tl.float32)
    e1 = tl.exp(tl.sum(q1 * k1, 0)) * dlam
    e2 = tl.exp(tl.sum(q2 * k2, 0)) * dlam
    tl.store(OUT + offs, e1 * k1)
    tl.store(OUT + D + offs, e1 * q1)
    tl.store(OUT + 2 * D + offs, -e2 * k2)
    tl.store(OUT + 3 * D + offs, -e2 * q2)
    tl.store(OUT + 4 * D + offs_v, acc)


@triton.jit
def diff_bwd_kv(Q, K, V, DO, STATS, DELTA, DK, DV, DQ32, LQ1, LK1, LQ2, LK2, DOC,
                s_qb, s_qm, s_qh, s_qn, s_kb, s_km, s_kh, s_kn, s_vb, s_vh, s_vn, s_db,
                N, H, HK, G, qk_scale, sm_scale, lambda_init, WINDOW,
                D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, HAS_DOC: tl.constexpr,
                HAS_WIN: tl.constexpr, MASKED: tl.constexpr, DQ_ATOMIC: tl.constexpr):
    """dK1, dK2 and dV of one key block, over the G query heads of its K/V head: dV from the combined map.  With
    DQ_ATOMIC also each query block's share of dQ1 and dQ2 (dS^T K), added into the float32 DQ32 (B, 2, H, N, D)
    with atomics: no second pass recomputing both maps (diff_bwd_q), in an order that varies from run to run."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // HK
    hk = bhk % HK
    lam = _lambda(LQ1, LK1, LQ2, LK2, lambda_init, D)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    offs_v = tl.arange(0, 2 * D)
    col_ok = offs_n < N
    kb = K + b.to(tl.int64) * s_kb + hk * s_kh
    vb = V + b.to(tl.int64) * s_vb + hk * s_vh
    k1 = tl.load(kb + offs_n[:, None] * s_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)  # (BN, D)
    k2 = tl.load(kb + s_km + offs_n[:, None] * s_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    vv = tl.load(vb + offs_n[:, None] * s_vn + offs_v[None, :], mask=col_ok[:, None], other=0.0)  # (BN, 2D)
    dk1 = tl.zeros([BN, D], tl.float32)
    dk2 = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, 2 * D], tl.float32)
    plane = N * H * (tl.num_programs(1) // HK)
    if HAS_DOC:
        docb = DOC + b.to(tl.int64) * s_db
        doc_k = tl.load(docb + offs_n, mask=col_ok, other=-2)
    if HAS_WIN:  # past the last query that sees a key of this block
        last = tl.minimum(pid_n * BN + BN - 1 + WINDOW, N)
    else:
        last = N
    for j in range(G):
        h = hk * G + j
        bh = b * H + h
        qb = Q + b.to(tl.int64) * s_qb + h * s_qh
        for start in range(pid_n * BN, last, BM):
            offs_m = start + tl.arange(0, BM)
            row_ok = offs_m < N
            rows = bh.to(tl.int64) * N + offs_m
            q1, q2 = _rows_pair(qb, s_qm, s_qn, offs_m, offs_d, row_ok)
            do = tl.load(DO + rows[:, None] * (2 * D) + offs_v[None, :], mask=row_ok[:, None], other=0.0)
            lse1 = tl.load(STATS + rows, mask=row_ok, other=0.0)
            lse2 = tl.load(STATS + plane + rows, mask=row_ok, other=0.0)
            dd1 = tl.load(DELTA + rows, mask=row_ok, other=0.0)
            dd2 = tl.load(DELTA + plane + rows, mask=row_ok, other=0.0)
            p1 = tl.exp2(tl.dot(k1, tl.trans(q1), input_precision=PREC) * qk_scale - lse1[None, :])
            p2 = tl.exp2(tl.dot(k2, tl.trans(q2), input_precision=PREC) * qk_scale - lse2[None, :])
            # masked: documents or a window, and the diagonal block; past it every query sees every key of this
            # block (rows past N load zero dO and row terms: p * (dp - dd) is 0 there, no share of anything)
            if MASKED or start < pid_n * BN + BN - 1:
                ok = (offs_m[None, :] >= offs_n[:, None]) & row_ok[None, :]
                if HAS_DOC:
                    doc_q = tl.load(docb + offs_m, mask=row_ok, other=-1)
                    ok = ok & (doc_k[:, None] == doc_q[None, :])
                if HAS_WIN:
                    ok = ok & (offs_m[None, :] - offs_n[:, None] < WINDOW)
                p1 = tl.where(ok, p1, 0.0)
                p2 = tl.where(ok, p2, 0.0)
            dv += tl.dot((p1 - lam * p2).to(do.dtype), do, input_precision=PREC)
            dp = tl.dot(vv, tl.trans(do), input_precision=PREC)  # (BN, BM)
            ds1 = (p1 * (dp - dd1[None, :])).to(q1.dtype)
            ds2 = ((-lam) * p2 * (dp - dd2[None, :])).to(q2.dtype)
            dk1 += tl.dot(ds1, q1, input_precision=PREC)
            dk2 += tl.dot(ds2, q2, input_precision=PREC)
            if DQ_ATOMIC:  # (keys past N are zero rows of K: no share)
                qo = (b.to(tl.int64) * 2 * H + h) * N + offs_m
                dq1 = tl.dot(tl.trans(ds1), k1, input_precision=PREC) * sm_scale
                dq2 = tl.dot(tl.trans(ds2), k2, input_precision=PREC) * sm_scale
                tl.atomic_add(DQ32 + qo[:, None] * D + offs_d[None, :], dq1, mask=row_ok[:, None], sem="relaxed")
                tl.atomic_add(DQ32 + (qo + H * N)[:, None] * D + offs_d[None, :], dq2, mask=row_ok[:, None],
                              sem="relaxed")
    kout = (b.to(tl.int64) * 2 * HK + hk) * N + offs_n  # DK (B, 2, HK, N, D) contiguous
    tl.store(DK + kout[:, None] * D + offs_d[None, :], (dk1 * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DK + (kout + HK * N)[:, None] * D + offs_d[None, :], (dk2 * sm_scale).to(DK.dtype.element_ty),
             mask=col_ok[:, None])
    vout = bhk.to(tl.int64) * N + offs_n  # DV (B, HK, N, 2D) contiguous
    tl.store(DV + vout[:, None] * (2 * D) + offs_v[None, :], dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def diff_bwd_q(Q, K, V, DO, STATS, DELTA, DQ, LQ1, LK1, LQ2, LK2, DOC,
               s_qb, s_qm, s_qh, s_qn, s_kb, s_km, s_kh, s_kn, s_vb, s_vh, s_vn, s_db,
               N, H, G, qk_scale, sm_scale, lambda_init, WINDOW,
               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, HAS_DOC: tl.constexpr,
               HAS_WIN: tl.constexpr, MASKED: tl.constexpr):
    """dQ1 and dQ2 of one query block: one dO V^T product serves both maps."""
    pid_m = tl.program_id(0)
    bh, b, h, hk, offs_m, offs_d, offs_v, row_ok = _query_block(N, H, G, BM, D)
    lam = _lambda(LQ1, LK1, LQ2, LK2, lambda_init, D)
    plane = N * tl.num_programs(1)
    rows = bh.to(tl.int64) * N + offs_m
    q1, q2 = _rows_pair(Q + b.to(tl.int64) * s_qb + h * s_qh, s_qm, s_qn, offs_m, offs_d, row_ok)
    do = tl.load(DO + rows[:, None] * (2 * D) + offs_v[None, :], mask=row_ok[:, None], other=0.0)
    lse1 = tl.load(STATS + rows, mask=row_ok, other=0.0)
    lse2 = tl.load(STATS + plane + rows, mask=row_ok, other=0.0)
    dd1 = tl.load(DELTA + rows, mask=row_ok, other=0.0)
    dd2 = tl.load(DELTA + plane + rows, mask=row_ok, other=0.0)
    kb = K + b.to(tl.int64) * s_kb + hk * s_kh
    vb = V + b.to(tl.int64) * s_vb + hk * s_vh
    dq1 = tl.zeros([BM, D], tl.float32)
    dq2 = tl.zeros([BM, D], tl.float32)
    docb, doc_q = DOC, offs_m  # read by _visible only with documents
    if HAS_DOC:
        docb = DOC + b.to(tl.int64) * s_db
        doc_q = tl.load(docb + offs_m, mask=row_ok, other=-1)
    if HAS_WIN:  # the first key block any row of this block sees
        first = tl.maximum(pid_m * BM - WINDOW + 1, 0) // BN * BN
    else:
        first = 0
    for start in range(first, pid_m * BM + BM, BN):  # (keys past N are masked)
        offs_n = start + tl.arange(0, BN)
        col_ok = offs_n < N
        k1 = tl.load(kb + offs_n[:, None] * s_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)  # (BN, D)
        k2 = tl.load(kb + s_km + offs_n[:, None] * s_kn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        vv = tl.load(vb + offs_n[:, None] * s_vn + offs_v[None, :], mask=col_ok[:, None], other=0.0)
        p1 = tl.exp2(tl.dot(q1, tl.trans(k1), input_precision=PREC) * qk_scale - lse1[:, None])
        p2 = tl.exp2(tl.dot(q2, tl.trans(k2), input_precision=PREC) * qk_scale - lse2[:, None])
        # masked: documents or a window, and the diagonal block; before it every query of this block sees every
        # key (keys past N load zero rows of K: their dS meets zeros in dS K)
        if MASKED or start + BN - 1 > pid_m * BM:
            ok = _visible(offs_m, offs_n, col_ok, docb, doc_q, WINDOW, HAS_DOC, HAS_WIN)
            p1 = tl.where(ok, p1, 0.0)
            p2 = tl.where(ok, p2, 0.0)
        dp = tl.dot(do, tl.trans(vv), input_precision=PREC)  # (BM, BN)
        ds1 = p1 * (dp - dd1[:, None])
        ds2 = (-lam) * p2 * (dp - dd2[:, None])
        dq1 += tl.dot(ds1.to(k1.dtype), k1, input_precision=PREC)
        dq2 += tl.dot(ds2.to(k2.dtype), k2, input_precision=PREC)
    qout = (b.to(tl.int64) * 2 * H + h) * N + offs_m  # DQ (B, 2, H, N, D) contiguous
    tl.store(DQ + qout[:, None] * D + offs_d[None, :], (dq1 * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
    tl.store(DQ + (qout + H * N)[:, None] * D + offs_d[None, :], (dq2 * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])
