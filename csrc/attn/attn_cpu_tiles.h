/*
 * attn_cpu_tiles.h -- the tile kernels of CPU attention, one source compiled
 * per (arithmetic type, SIMD level); included by attn_cpu_isa_*.c after
 * attn_cpu_simd.h.  Defines the kernel table RA_TABLE_NAME.
 *
 * Forward tile (fwd_block): one block of nq <= BQ query rows against all
 * keys of one (packed) kv head, flash-attention style:
 *   Qs = Q * scale * log2(e)                          (nq, Dp)  packed once
 *   for each key block kb (BK keys, stopping at the causal frontier):
 *     S  = Qs K_kb^T                                  (nq, BK)  ra_gemm
 *     mask: cols past the block's keys, causal cols (only on diagonal blocks)
 *     m' = max(m, rowmax S); P = 2^(S - m'); l = l 2^(m - m') + rowsum P
 *     O  = O 2^(m - m') + P V_kb                      (nq, Dp)  ra_gemm
 *   out = O / l, lse = (m + log2 l) ln 2; rows that saw nothing: 0, -inf.
 * In accumulate mode the state starts from (out, lse): m = lse log2(e),
 * l = 1, O = out, so merging happens by the same online rule.
 *
 * Backward tile (bwd_kblock): one key block of one kv head against all rows
 * of one query head, with the final lse and delta = rowsum(dO * O):
 *   for each query block (from the first row that can see the block):
 *     S = Q K^T, P = 2^(S scale log2 e - lse log2 e)  (masked),
 *     dP = dO V^T, dS = P (dP - delta)
 *     dV += P^T dO, dK += dS^T Q, dQ += dS K          (scale applied later)
 */

#define RA_NEG_INF (-(real)INFINITY)

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

/* number of keys of a block (first at position kp0, stride kst, nk keys)
 * visible from query position qp */
static inline int64_t visible_keys(int64_t qp, int64_t kp0, int64_t kst,
                                   int64_t nk) {
    if (qp < kp0) return 0;
    int64_t v = (qp - kp0) / kst + 1;
    return v < nk ? v : nk;
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

    for (int64_t i = 0; i < nq; i++) {
        ld_row(ra_cpu_at(fb->q, i * fb->q_ss, fb->dtype), fb->dtype, D,
               (real)(fb->scale * RA_LOG2E), qt + i * Dp);
        for (int64_t d = D; d < Dp; d++) qt[i * Dp + d] = 0;
        real lse_old = RA_NEG_INF;
        if (fb->accumulate)
            lse_old = (real)ra_cpu_ld(fb->lse, i * fb->lse_ss, fb->lse_dtype);
        if (lse_old > RA_NEG_INF) {
            mrow[i] = lse_old * (real)RA_LOG2E;
            lrow[i] = 1;
            ld_row(ra_cpu_at(fb->out, i * fb->out_ss, fb->out_dtype),
                   fb->out_dtype, D, 1, ot + i * Dp);
            for (int64_t d = D; d < Dp; d++) ot[i * Dp + d] = 0;
        } else {
            mrow[i] = RA_NEG_INF;
            lrow[i] = 0;
            memset(ot + i * Dp, 0, sizeof(real) * (size_t)Dp);
        }
    }

    /* keys visible to the last (largest position) query bound the loop */
    int64_t nvis = fb->nk;
    const int64_t qlast = fb->qpos0 + (nq - 1) * fb->qpos_st;
    if (fb->causal) nvis = visible_keys(qlast, fb->kpos0, fb->kpos_st, fb->nk);
    const int64_t nkb = ra_cpu_cdiv(nvis, BK);

    for (int64_t kb = 0; kb < nkb; kb++) {
        const int64_t j0 = kb * BK;
        const int64_t nv = nvis - j0 < BK ? nvis - j0 : BK;
        const int64_t NB = ra_cpu_cdiv(nv, VW) * VW;
        const int64_t kp0 = fb->kpos0 + j0 * fb->kpos_st;
        const int diag =
            fb->causal && kp0 + (nv - 1) * fb->kpos_st > fb->qpos0;
        /* rows before r0 see no key of this block (positions increase along
         * the rows): leave their state alone and skip them in both GEMMs */
        int64_t r0 = 0;
        if (diag && kp0 > fb->qpos0) {
            r0 = ra_cpu_cdiv(kp0 - fb->qpos0, fb->qpos_st);
            if (r0 >= nq) continue;
        }

        ra_gemm(nq - r0, NB, D, qt + r0 * Dp, Dp, 1, kt + kb * D * BK, BK,
                st + r0 * BK, BK, 0);

        for (int64_t i = r0; i < nq; i++) {
            real *row = st + i * BK;
            int64_t lim = nv;
            if (diag)
                lim = visible_keys(fb->qpos0 + i * fb->qpos_st, kp0,
                                   fb->kpos_st, nv);
            if (lim == 0) {
                memset(row, 0, sizeof(real) * (size_t)NB);
                continue;
            }
            for (int64_t j = lim; j < NB; j++) row[j] = RA_NEG_INF;
            rv mx = v_ld(row);
            for (int64_t j = VW; j < NB; j += VW) mx = v_max(mx, v_ld(row + j));
            const real m_old = mrow[i];
            real m_new = v_hmax(mx);
            if (m_old > m_new) m_new = m_old;
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

        ra_gemm(nq - r0, Dp, nv, st + r0 * BK, BK, 1, vr + j0 * Dp, Dp,
                ot + r0 * Dp, Dp, 1);
    }

    for (int64_t i = 0; i < nq; i++) {
        void *orow = ra_cpu_atw(fb->out, i * fb->out_ss, fb->out_dtype);
        real *o = ot + i * Dp;
        if (!(lrow[i] > 0)) {
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
    const real c = (real)(bb->scale * RA_LOG2E);
    const int64_t kp_last = bb->kpos0 + (nk - 1) * bb->kpos_st;

    if (nk <= 0 || nq <= 0) return;
    int64_t i_start = 0;
    if (bb->causal && bb->kpos0 > bb->qpos0)
        i_start = ra_cpu_cdiv(bb->kpos0 - bb->qpos0, bb->qpos_st);

    for (int64_t i0 = i_start; i0 < nq; i0 += RA_CPU_BQB) {
        const int64_t mq = nq - i0 < RA_CPU_BQB ? nq - i0 : RA_CPU_BQB;
        const int diag =
            bb->causal && kp_last > bb->qpos0 + i0 * bb->qpos_st;

        ra_gemm(mq, NB, D, q + i0 * Dp, Dp, 1, kt, BK, st, BK, 0);
        ra_gemm(mq, NB, D, dout + i0 * Dp, Dp, 1, vt, BK, dp, BK, 0);

        for (int64_t i = 0; i < mq; i++) {
            real *prow = st + i * BK, *drow = dp + i * BK;
            const real L = lse2[i0 + i];
            int64_t lim = nk;
            if (diag)
                lim = visible_keys(bb->qpos0 + (i0 + i) * bb->qpos_st,
                                   bb->kpos0, bb->kpos_st, nk);
            if (lim == 0 || !(L > RA_NEG_INF)) {
                memset(prow, 0, sizeof(real) * (size_t)NB);
                memset(drow, 0, sizeof(real) * (size_t)NB);
                continue;
            }
            const rv cv = v_set1(c), Lv = v_set1(L), dl = v_set1(delta[i0 + i]);
            for (int64_t j = 0; j < NB; j += VW) {
                rv pj = v_exp2(v_ld(prow + j) * cv - Lv);
                v_st(prow + j, pj);
                v_st(drow + j, pj * (v_ld(drow + j) - dl));
            }
            for (int64_t j = lim; j < NB; j++) prow[j] = drow[j] = 0;
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
