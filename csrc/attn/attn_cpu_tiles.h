/*
 * attn_cpu_tiles.h -- the tile kernels of CPU attention, one source compiled
 * per (arithmetic type, SIMD level); included by attn_cpu_isa_*.c after
 * attn_cpu_simd.h.  Defines the kernel table RA_TABLE_NAME.
 *
 * Forward tile (fwd_block): one block of nq <= BQ query rows against all
 * keys of one (packed) kv head, flash-attention style:
 *   Qs = Q * scale * log2(e)                          (nq, Dp)  packed once
 *   for each key block kb that some row may see (BK keys; causal frontier,
 *   window and the rows' documents bound the range, blocks of other
 *   documents are skipped whole):
 *     S  = Qs K_kb^T                                  (nq, BK)  ra_gemm
 *     softcap: S = c2 tanh(S / c2)
 *     mask: cols past the block's keys; per row its position limits (only
 *     on blocks some row sees in part) and ids (only where ids mix)
 *     m' = max(m, rowmax S); P = 2^(S - m'); l = l 2^(m - m') + rowsum P
 *     O  = O 2^(m - m') + P V_kb                      (nq, Dp)  ra_gemm
 *   out = O / l, lse = (m + log2 l) ln 2; rows that saw nothing: 0, -inf.
 * A NaN score (NaN in q or k, or +inf - +inf) makes P, l, O and so out
 * and lse NaN: the empty-row tests compare with -inf and 0 exactly.
 * In accumulate mode the state starts from (out, lse): m = lse log2(e),
 * l = 1, O = out, so merging happens by the same online rule.  Without
 * masks the per-block and per-row tests all fall through: the unmasked
 * tile does the work it did before masks existed.
 *
 * Backward tile (bwd_kblock): one key block of one kv head against all rows
 * of one query head, with the final lse and delta = rowsum(dO * O).  Q comes
 * packed times scale * log2(e) exactly as the forward packs it, so S below
 * is the forward's score bit for bit:
 *   for each query block of the rows that may see the block (by position,
 *   and by document when the rows' ids are sorted; blocks of rows of
 *   other documents skipped):
 *     S = Qs K^T (capped as in the forward),
 *     P = 2^(S - lse log2 e)  (masked; an exponent above a rounding band
 *     below 0 reads as 0, so P <= 1),
 *     dP = dO V^T, dS = P (dP - delta) (times 1 - tanh^2 with a softcap)
 *     dV += P^T dO, dK += dS^T Qs, dQ += dS K   (dK times ln 2, dQ times
 *                                                 scale, applied later)
 */

#define RA_NEG_INF (-(real)INFINITY)
/* the backward's rounding band below an exponent of 0 (see bwd_kblock):
 * 16 ulps of |L|, from the |L| where an ulp reaches 2^-10 */
#if RA_IS_DOUBLE
#define RA_BWD_BAND ((real)0x1p-48)
#define RA_BWD_BAND_FROM ((real)0x1p42)
#else
#define RA_BWD_BAND ((real)0x1p-19f)
#define RA_BWD_BAND_FROM ((real)0x1p13f)
#endif

/* ---- packing and storing ----------------------------------------------- */
/* one row of D elements of dtype dt -> reals times mul */
static void ld_row(const void *src, ra_dtype dt, int64_t D, real mul,
                   real *dst) {
    switch (dt) {
    case RA_FLOAT32: {
        const float *s = (const float *)src;
        for (int64_t d = 0; d < D; d++) dst[d] = (real)s[d] * mul;
        break;
    }
    case RA_FLOAT64: {
        const double *s = (const double *)src;
        for (int64_t d = 0; d < D; d++) dst[d] = (real)(s[d] * mul);
        break;
    }
    case RA_FLOAT16: {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t d = 0; d < D; d++) dst[d] = (real)ra_cpu_h2f(s[d]) * mul;
        break;
    }
    case RA_BFLOAT16: {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t d = 0; d < D; d++) dst[d] = (real)ra_cpu_b2f(s[d]) * mul;
        break;
    }
    default:
        for (int64_t d = 0; d < D; d++) dst[d] = 0;
    }
}

/* reals times mul -> one row of dtype dt (added to it when add) */
static void st_row(const real *src, int64_t D, real mul, void *dst,
                   ra_dtype dt, int add) {
    switch (dt) {
    case RA_FLOAT32: {
        float *o = (float *)dst;
        for (int64_t d = 0; d < D; d++)
            o[d] = add ? (float)(o[d] + src[d] * mul) : (float)(src[d] * mul);
        break;
    }
    case RA_FLOAT64: {
        double *o = (double *)dst;
        for (int64_t d = 0; d < D; d++)
            o[d] = add ? o[d] + (double)(src[d] * mul) : (double)(src[d] * mul);
        break;
    }
    case RA_FLOAT16: {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t d = 0; d < D; d++) {
            float v = (float)(src[d] * mul);
            if (add) v += ra_cpu_h2f(o[d]);
            o[d] = ra_cpu_f2h(v);
        }
        break;
    }
    case RA_BFLOAT16: {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t d = 0; d < D; d++) {
            float v = (float)(src[d] * mul);
            if (add) v += ra_cpu_b2f(o[d]);
            o[d] = ra_cpu_f2b(v);
        }
        break;
    }
    default: break;
    }
}

static void k_pack_t(const void *src, int64_t ss, ra_dtype dt, int64_t n,
                     int64_t D, void *dstv) {
    /* dst: (D, BK), dst[d][j] = src[j][d], zero for j >= n */
    real *dst = (real *)dstv;
    real row[RA_MAX_HEAD_DIM];
    memset(dst, 0, sizeof(real) * (size_t)(D * RA_CPU_BK));
    for (int64_t j = 0; j < n; j++) {
        ld_row(ra_cpu_at(src, j * ss, dt), dt, D, 1, row);
        for (int64_t d = 0; d < D; d++) dst[d * RA_CPU_BK + j] = row[d];
    }
}

static void k_pack_r(const void *src, int64_t ss, ra_dtype dt, int64_t n,
                     int64_t D, int64_t Dp, double mul, void *dstv) {
    /* dst: (n, Dp) */
    real *dst = (real *)dstv;
    for (int64_t i = 0; i < n; i++) {
        ld_row(ra_cpu_at(src, i * ss, dt), dt, D, (real)mul, dst + i * Dp);
        for (int64_t d = D; d < Dp; d++) dst[i * Dp + d] = 0;
    }
}

static void k_store_rows(const void *srcv, int64_t n, int64_t D, int64_t Dp,
                         double mul, void *dst, int64_t dst_ss, ra_dtype dt,
                         int add) {
    const real *src = (const real *)srcv;
    for (int64_t i = 0; i < n; i++)
        st_row(src + i * Dp, D, (real)mul, ra_cpu_atw(dst, i * dst_ss, dt), dt,
               add);
}

/* the scores S (rows x NB, row stride BK) soft-capped in place:
 * S -> c2 tanh(S / c2) */
static void cap_scores(real *st, int64_t rows, int64_t NB, real c2) {
    const rv cv = v_set1(c2), inv = v_set1((real)1 / c2);
    rv unused;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < NB; j += VW)
            v_st(st + i * RA_CPU_BK + j,
                 cv * v_tanh(v_ld(st + i * RA_CPU_BK + j) * inv, &unused));
}

/* ---- forward tile ------------------------------------------------------ */
static size_t k_fwd_scratch(int64_t Dp) {
    return sizeof(real) *
           (size_t)(2 * RA_CPU_BQ * Dp + RA_CPU_BQ * RA_CPU_BK + 2 * RA_CPU_BQ);
}

static void k_fwd_block(const ra_fwd_blk *fb, void *scratch) {
    const int64_t nq = fb->nq, D = fb->D, Dp = fb->Dp, BK = RA_CPU_BK;
    real *qt = (real *)scratch;             /* (nq, Dp) scaled queries */
    real *ot = qt + RA_CPU_BQ * Dp;         /* (nq, Dp) output accumulator */
    real *st = ot + RA_CPU_BQ * Dp;         /* (nq, BK) scores / probs */
    real *mrow = st + RA_CPU_BQ * BK;       /* (nq) running max, base 2 */
    real *lrow = mrow + RA_CPU_BQ;          /* (nq) running sum */
    const real *kt = (const real *)fb->kt, *vr = (const real *)fb->vr;
    const ra_tile_mask *m = &fb->m;

    for (int64_t i = 0; i < nq; i++) {
        ld_row(ra_cpu_at(fb->q, i * fb->q_ss, fb->dtype), fb->dtype, D,
               (real)(fb->scale * RA_LOG2E), qt + i * Dp);
        for (int64_t d = D; d < Dp; d++) qt[i * Dp + d] = 0;
        real lse_old = RA_NEG_INF;
        if (fb->accumulate)
            lse_old = (real)ra_cpu_ld(fb->lse, i * fb->lse_ss, fb->lse_dtype);
        if (lse_old != RA_NEG_INF) {
            /* a NaN lse stays NaN: l = NaN is never rescaled away */
            mrow[i] = lse_old * (real)RA_LOG2E;
            lrow[i] = lse_old == lse_old ? 1 : lse_old;
            ld_row(ra_cpu_at(fb->out, i * fb->out_ss, fb->out_dtype),
                   fb->out_dtype, D, 1, ot + i * Dp);
            for (int64_t d = D; d < Dp; d++) ot[i * Dp + d] = 0;
        } else {
            mrow[i] = RA_NEG_INF;
            lrow[i] = 0;
            memset(ot + i * Dp, 0, sizeof(real) * (size_t)Dp);
        }
    }

    /* the keys some row may see, [jlo, jhi): bounded by the first row's
     * lowest and the last row's highest visible position (positions
     * increase along the rows), and by the rows' documents when the keys'
     * ids are sorted */
    const int64_t qst = fb->qpos_st, kst = fb->kpos_st;
    const int64_t qfirst = fb->qpos0, qlast = fb->qpos0 + (nq - 1) * qst;
    int64_t jlo = 0, jhi = fb->nk, unused_lo = 0, unused_hi = fb->nk;
    ra_row_limits(m, qfirst, fb->kpos0, kst, fb->nk, &jlo, &unused_hi);
    ra_row_limits(m, qlast, fb->kpos0, kst, fb->nk, &unused_lo, &jhi);
    int32_t qmin = 0, qmax = 0;
    if (m->q_ids != NULL) {
        ra_ids_range(m->q_ids, nq, m->q_sorted, &qmin, &qmax);
        if (m->kv_sorted) ra_ids_narrow(m->kv_ids, qmin, qmax, &jlo, &jhi);
    }

    for (int64_t kb = jlo / BK; jlo < jhi && kb * BK < jhi; kb++) {
        const int64_t j0 = kb * BK;
        /* keys [ja, jb) of the block are in [jlo, jhi) */
        const int64_t ja = jlo > j0 ? jlo - j0 : 0;
        const int64_t jb = jhi - j0 < BK ? jhi - j0 : BK;
        const int64_t NB = ra_cpu_cdiv(jb, VW) * VW;
        const int64_t kp0 = fb->kpos0 + j0 * kst;
        const int64_t kpa = kp0 + ja * kst, kpb = kp0 + (jb - 1) * kst;
        /* documents: skip a block of other documents; compare ids key by
         * key only where the block or the rows mix documents */
        int idmask = 0;
        if (m->q_ids != NULL) {
            const int32_t kmin = m->kv_block_min[kb], kmax = m->kv_block_max[kb];
            if (kmax < qmin || kmin > qmax) continue;
            idmask = !(qmin == qmax && kmin == kmax && qmin == kmin);
        }
        /* rows [r0, r1) see some key of [ja, jb); the others keep their
         * state and are left out of both GEMMs.  `edge`: some row sees
         * only part of [ja, jb) and needs its own limits */
        int64_t r0, r1;
        ra_rows_seeing(m, kpa, kpb, qfirst, qst, nq, &r0, &r1);
        if (r0 >= r1) continue;
        const int edge =
            (m->has_hi && kpb > ra_sat_add(qfirst, m->hi_off)) ||
            (m->has_lo && kpa < ra_sat_sub(qlast, m->lo_off));

        ra_gemm(r1 - r0, NB, D, qt + r0 * Dp, Dp, 1, kt + kb * D * BK, BK,
                st + r0 * BK, BK, 0);
        if (m->softcap2 > 0)
            cap_scores(st + r0 * BK, r1 - r0, NB, (real)m->softcap2);

        for (int64_t i = r0; i < r1; i++) {
            real *row = st + i * BK;
            int64_t lo = ja, hi = jb;
            if (edge)
                ra_row_limits(m, qfirst + i * qst, kp0, kst, jb, &lo, &hi);
            if (lo >= hi) {
                memset(row, 0, sizeof(real) * (size_t)NB);
                continue;
            }
            for (int64_t j = 0; j < lo; j++) row[j] = RA_NEG_INF;
            for (int64_t j = hi; j < NB; j++) row[j] = RA_NEG_INF;
            if (idmask) {
                const int32_t qid = m->q_ids[i], *kid = m->kv_ids + j0;
                for (int64_t j = lo; j < hi; j++)
                    if (kid[j] != qid) row[j] = RA_NEG_INF;
            }
            rv mx = v_ld(row);
            for (int64_t j = VW; j < NB; j += VW) mx = v_max(mx, v_ld(row + j));
            const real m_old = mrow[i];
            real m_new = v_hmax(mx);
            if (m_old > m_new || m_old != m_old) m_new = m_old;
            /* a NaN score makes the row NaN (DESIGN 2): a NaN max goes on,
             * and so does a NaN that v_max passed over beside -inf */
            for (int64_t j = lo; m_new == RA_NEG_INF && j < hi; j++)
                if (row[j] != row[j]) m_new = row[j];
            if (m_new == RA_NEG_INF) {    /* nothing seen yet, nor here */
                memset(row, 0, sizeof(real) * (size_t)NB);
                continue;
            }
            const rv mv = v_set1(m_new);
            rv sum = v_set1(0);
            for (int64_t j = 0; j < NB; j += VW) {
                rv pj = v_exp2_le0(v_ld(row + j) - mv);
                sum += pj;
                v_st(row + j, pj);
            }
            if (m_old < m_new) {
                /* alpha = 2^(m_old - m_new): 0 when m_old is -inf */
                const rv av = v_exp2_le0(v_set1(m_old - m_new));
                real *o = ot + i * Dp;
                for (int64_t d = 0; d < Dp; d += VW) v_st(o + d, v_ld(o + d) * av);
                lrow[i] *= av[0];
            }
            lrow[i] += v_hsum(sum);
            mrow[i] = m_new;
        }

        ra_gemm(r1 - r0, Dp, jb, st + r0 * BK, BK, 1, vr + j0 * Dp, Dp,
                ot + r0 * Dp, Dp, 1);
    }

    for (int64_t i = 0; i < nq; i++) {
        void *orow = ra_cpu_atw(fb->out, i * fb->out_ss, fb->out_dtype);
        real *o = ot + i * Dp;
        if (lrow[i] == 0) {    /* saw no key (a NaN l is not empty) */
            memset(o, 0, sizeof(real) * (size_t)Dp);
            st_row(o, D, 1, orow, fb->out_dtype, 0);
            ra_cpu_st(fb->lse, i * fb->lse_ss, fb->lse_dtype, -INFINITY);
            continue;
        }
        st_row(o, D, (real)(1.0 / (double)lrow[i]), orow, fb->out_dtype, 0);
        double lse = ((double)mrow[i] + log2((double)lrow[i])) * RA_LN2;
        ra_cpu_st(fb->lse, i * fb->lse_ss, fb->lse_dtype, lse);
    }
}

/* ---- backward tile ----------------------------------------------------- */
static size_t k_bwd_scratch(int64_t Dp) {
    (void)Dp;
    return sizeof(real) * (size_t)(2 * RA_CPU_BQB * RA_CPU_BK);
}

/* One row of the backward tile: prow holds S (becomes P), drow dP (becomes
 * dS); L = lse log2 e.  `capped` (a constant at each call, so the plain
 * row has no soft-capping code): S is capped first and dS is taken through
 * the tanh.
 *
 * x = S - L <= 0 in exact arithmetic (L is the log2 of a sum that holds
 * 2^S), so x > 0 is rounding: read as 0 (P <= 1; huge scores would
 * otherwise overflow).  For huge |L| the rounding of L itself (stored in
 * the acc dtype, merged over ring steps) is many units: there an x within
 * 16 ulps of |L| below 0 reads as 0 too, so the row's dominant key gets
 * P = 1, not 2^(-ulps), which would lose it.  A soft cap bounds |S| by
 * softcap2, so |L| <= softcap2 + log2(keys): the band only ever applies to
 * caps beyond 2^13 (float) and protects them as it does uncapped scores.
 * A dilated pair that c branches share reads as -log2 c: P sums to 1 over
 * them (c <= 1, a pair no other branch selects: 0 as without branches). */
RA_AI void bwd_row(const ra_bwd_blk *bb, real *prow, real *drow, real L,
                   real delta, int64_t i, int64_t NB, const int capped) {
    const real aL = L < 0 ? -L : L;
    const real band = aL >= RA_BWD_BAND_FROM ? -(RA_BWD_BAND * aL) : 0;
    const rv Lv = v_set1(L), dl = v_set1(delta), bv = v_set1(band);
    const rv c2 = v_set1((real)bb->m.softcap2);
    const rv inv = v_set1(capped ? (real)(1.0 / bb->m.softcap2) : 0);
    const int64_t qp = bb->qpos0 + i * bb->qpos_st;
    for (int64_t j = 0; j < NB; j += VW) {
        rv s = v_ld(prow + j), sech2 = v_set1(1);
        if (capped) s = c2 * v_tanh(s * inv, &sech2);
        rv x = s - Lv;
        const ri snap = (ri)(x >= bv);
        x = (rv)((ri)x & ~snap);              /* 0 inside the band */
        if (bb->branches != NULL)
            for (int l = 0; l < VW; l++)
                if (snap[l] && j + l < bb->nk) {
                    const int c = ra_dilated_pair_count(
                        bb->branches, bb->head, qp,
                        bb->kpos0 + (j + l) * bb->kpos_st);
                    x[l] = c > 1 ? -(real)log2((double)c) : 0;
                }
        const rv pj = v_exp2(x);
        rv ds = pj * (v_ld(drow + j) - dl);
        if (capped) ds = ds * sech2;
        v_st(prow + j, pj);
        v_st(drow + j, ds);
    }
}

static void k_bwd_kblock(const ra_bwd_blk *bb, void *scratch) {
    const int64_t nq = bb->nq, nk = bb->nk, D = bb->D, Dp = bb->Dp;
    const int64_t BK = RA_CPU_BK, NB = ra_cpu_cdiv(nk, VW) * VW;
    real *st = (real *)scratch;             /* (BQB, BK) P */
    real *dp = st + RA_CPU_BQB * BK;        /* (BQB, BK) dP, then dS */
    const real *q = (const real *)bb->q, *dout = (const real *)bb->dout;
    const real *lse2 = (const real *)bb->lse2, *delta = (const real *)bb->delta;
    const real *kt = (const real *)bb->kt, *vt = (const real *)bb->vt;
    const real *kr = (const real *)bb->kr;
    real *dq = (real *)bb->dq, *dk = (real *)bb->dk, *dv = (real *)bb->dv;
    const ra_tile_mask *m = &bb->m;
    const int64_t qst = bb->qpos_st;

    if (nk <= 0 || nq <= 0) return;
    const int64_t kfirst = bb->kpos0, klast = bb->kpos0 + (nk - 1) * bb->kpos_st;
    /* the rows that may see a key of the block, [i_lo, i_hi): by position,
     * and by the block's documents when the rows' ids are sorted */
    int64_t i_lo, i_hi;
    ra_rows_seeing(m, kfirst, klast, bb->qpos0, qst, nq, &i_lo, &i_hi);
    int32_t kmin = 0, kmax = 0;
    if (m->q_ids != NULL) {
        ra_ids_range(m->kv_ids, nk, m->kv_sorted, &kmin, &kmax);
        if (m->q_sorted) ra_ids_narrow(m->q_ids, kmin, kmax, &i_lo, &i_hi);
    }

    for (int64_t i0 = i_lo; i0 < i_hi; i0 += RA_CPU_BQB) {
        const int64_t mq = i_hi - i0 < RA_CPU_BQB ? i_hi - i0 : RA_CPU_BQB;
        int idmask = 0;
        if (m->q_ids != NULL) {
            int32_t qmin, qmax;
            ra_ids_range(m->q_ids + i0, mq, m->q_sorted, &qmin, &qmax);
            if (kmax < qmin || kmin > qmax) continue;
            idmask = !(qmin == qmax && kmin == kmax && qmin == kmin);
        }
        const int64_t qa = bb->qpos0 + i0 * qst, qb = qa + (mq - 1) * qst;
        const int edge = (m->has_hi && klast > ra_sat_add(qa, m->hi_off)) ||
                         (m->has_lo && kfirst < ra_sat_sub(qb, m->lo_off));

        ra_gemm(mq, NB, D, q + i0 * Dp, Dp, 1, kt, BK, st, BK, 0);
        ra_gemm(mq, NB, D, dout + i0 * Dp, Dp, 1, vt, BK, dp, BK, 0);

        for (int64_t i = 0; i < mq; i++) {
            real *prow = st + i * BK, *drow = dp + i * BK;
            const real L = lse2[i0 + i];
            int64_t lo = 0, hi = nk;
            if (edge)
                ra_row_limits(m, qa + i * qst, kfirst, bb->kpos_st, nk, &lo,
                              &hi);
            if (lo >= hi || L == RA_NEG_INF) {   /* a NaN L goes on */
                memset(prow, 0, sizeof(real) * (size_t)NB);
                memset(drow, 0, sizeof(real) * (size_t)NB);
                continue;
            }
            if (m->softcap2 > 0)
                bwd_row(bb, prow, drow, L, delta[i0 + i], i0 + i, NB, 1);
            else
                bwd_row(bb, prow, drow, L, delta[i0 + i], i0 + i, NB, 0);
            for (int64_t j = 0; j < lo; j++) prow[j] = drow[j] = 0;
            for (int64_t j = hi; j < NB; j++) prow[j] = drow[j] = 0;
            if (idmask) {
                const int32_t qid = m->q_ids[i0 + i];
                for (int64_t j = lo; j < hi; j++)
                    if (m->kv_ids[j] != qid) prow[j] = drow[j] = 0;
            }
        }

        ra_gemm(nk, Dp, mq, st, 1, BK, dout + i0 * Dp, Dp, dv, Dp, 1);
        ra_gemm(nk, Dp, mq, dp, 1, BK, q + i0 * Dp, Dp, dk, Dp, 1);
        ra_gemm(mq, Dp, nk, dp, BK, 1, kr, Dp, dq + i0 * Dp, Dp, 1);
    }
}

const ra_cpu_kernels RA_TABLE_NAME = {
    RA_ISA_NAME,   (int)sizeof(real), VW,          k_fwd_scratch,
    k_bwd_scratch, k_pack_t,          k_pack_r,    k_store_rows,
    k_fwd_block,   k_bwd_kblock};
