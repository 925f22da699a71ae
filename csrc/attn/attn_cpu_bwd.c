/*
 * attn_cpu_bwd.c -- dense attention backward on the CPU.
 *
 *   q, dout, dq: (B, S_q, H, D)   k, v, dk, dv: (B, S_k, H_kv, D)
 *   out: (B, S_q, H, D)           lse, delta: (B, H, S_q) acc dtype
 *
 * Preprocess: delta = rowsum(dout * out), in double, stored in acc dtype.
 *
 * Main pass: q, dout (and lse * log2 e, delta) of every (batch, head) and
 * k, v of every (batch, kv head) are converted once into float (double for
 * float64) scratch.  Work items are (batch, kv head, split): an item owns
 * the key blocks kb = split, split + nsplit, ... of its kv head; for each
 * such block it runs the tile kernel against every query head of the GQA
 * group, so dk and dv of the block are complete when the item writes them
 * (no atomics).  dq is accumulated in float scratch: one copy per split,
 * each (batch, head) row of a copy written only by the item that owns it;
 * the copies are summed in split order at the end.  nsplit is 1 unless
 * there are too few (batch, kv head) pairs to keep the threads busy.  The
 * summation order is fixed for a given thread count, so results are
 * bitwise reproducible (the `deterministic` flag needs nothing extra).
 * Masks reach the tiles as in the forward (attn_cpu_mask.c); a key block
 * visits only the query rows that may see it.
 */
#include "attn/attn_cpu.h"
#include "attn/attn_cpu_kern.h"

#ifdef _OPENMP
#include <omp.h>
#endif

ra_status ra_cpu_attn_bwd_preprocess(const ra_attn_bwd_params *p) {
    RA_CHECK(ra_cpu_check_bwd(p));
    const int64_t B = p->batch, Sq = p->seqlen_q, H = p->heads, D = p->head_dim;
    const ra_dtype acc = ra_acc_dtype(p->dtype), od = p->out_dtype;
    const int64_t n_rows = B * H * Sq;
    const int nt = ra_cpu_threads_for(p->num_threads, 4.0 * (double)n_rows * (double)D);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t i = r % Sq, bh = r / Sq, b = bh / H, h = bh % H;
        const int64_t oo = b * p->out_batch_stride + i * p->out_seq_stride +
                           h * p->out_head_stride;
        const int64_t go = b * p->dout_batch_stride + i * p->dout_seq_stride +
                           h * p->dout_head_stride;
        double s = 0.0;
        for (int64_t d = 0; d < D; d++)
            s += ra_cpu_ld(p->out, oo + d, od) * ra_cpu_ld(p->dout, go + d, od);
        ra_cpu_st(p->delta,
                  b * p->lse_batch_stride + h * p->lse_head_stride +
                      i * p->lse_seq_stride,
                  acc, s);
    }
    return RA_OK;
}

void ra_cpu_zero_rows(void *g, ra_dtype dt, int64_t B, int64_t S, int64_t Hx,
                      int64_t D, int64_t bs, int64_t ss, int64_t hs, int nt) {
    const int64_t n_rows = B * S * Hx;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t h = r % Hx, i = (r / Hx) % S, b = r / (Hx * S);
        memset(ra_cpu_atw(g, b * bs + i * ss + h * hs, dt), 0,
               (size_t)D * ra_dtype_size(dt));
    }
}

ra_status ra_cpu_attn_bwd(const ra_attn_bwd_params *p) {
    RA_CHECK(ra_cpu_check_bwd(p));
    const int64_t B = p->batch, Sq = p->seqlen_q, Sk = p->seqlen_k;
    const int64_t H = p->heads, Hkv = p->heads_kv, D = p->head_dim;
    const int nt = ra_cpu_threads_for(
        p->num_threads, 10.0 * (double)B * (double)H * (double)Sq * (double)Sk * (double)D);
    const ra_dtype gd = p->grad_dtype, acc = ra_acc_dtype(p->dtype);
    if (B == 0 || H == 0) return RA_OK;
    if (Sq == 0 || Sk == 0) {
        if (!p->accumulate) {
            ra_cpu_zero_rows(p->dq, gd, B, Sq, H, D, p->dq_batch_stride,
                      p->dq_seq_stride, p->dq_head_stride, nt);
            ra_cpu_zero_rows(p->dk, gd, B, Sk, Hkv, D, p->dk_batch_stride,
                      p->dk_seq_stride, p->dk_head_stride, nt);
            ra_cpu_zero_rows(p->dv, gd, B, Sk, Hkv, D, p->dv_batch_stride,
                      p->dv_seq_stride, p->dv_head_stride, nt);
        }
        return RA_OK;
    }

    const ra_cpu_kernels *kn = ra_cpu_kernels_for(p->dtype);
    const int64_t Dp = ra_cpu_cdiv(D, kn->vw) * kn->vw, BK = RA_CPU_BK;
    const int64_t group = H / Hkv, nkb = ra_cpu_cdiv(Sk, BK), G = B * Hkv;
    const size_t rs = (size_t)kn->real_size;
    int64_t nsplit = 1;
    if (G % nt != 0 && G < 4 * nt) nsplit = ra_cpu_cdiv(4 * nt, G);
    if (nsplit > nkb) nsplit = nkb;

    /* scratch: q, dout rows; lse2, delta; per kv head kt, vt, kr blocks;
     * nsplit dq accumulators; per thread tile scratch + dk, dv blocks */
    const int64_t q_elems = B * H * Sq * Dp, r_elems = B * H * Sq;
    const int64_t kv_head = nkb * BK * (2 * D + Dp);
    const size_t q_bytes = ra_cpu_bytes(q_elems, 2, 1, (int64_t)rs);
    const size_t r_bytes = ra_cpu_bytes(r_elems, 2, 1, (int64_t)rs);
    const size_t kv_bytes = ra_cpu_bytes(G, kv_head, 1, (int64_t)rs);
    const size_t dq_bytes = ra_cpu_bytes(q_elems, nsplit, 1, (int64_t)rs);
    const size_t scr_each =
        (kn->bwd_scratch(Dp) + 2 * (size_t)(BK * Dp) * rs + 63) & ~(size_t)63;
    const size_t scr_bytes = scr_each * (size_t)nt;
    char *qbuf = NULL, *rbuf = NULL, *kv = NULL, *dqb = NULL, *scr = NULL;
    ra_cpu_ids ids;
    ra_tile_mask tm;
    ra_status st = RA_OK;

    if (q_bytes == 0 || r_bytes == 0 || kv_bytes == 0 || dq_bytes == 0) {
        ra_set_error(RA_ERR_OVERFLOW, "attention backward: scratch size overflows");
        return RA_ERR_OVERFLOW;
    }
    ra_cpu_tile_mask(p->causal, &p->mask, &tm);
    RA_CHECK(ra_cpu_ids_prepare(&p->mask, B, Sq, Sk, &ids));
    if ((qbuf = (char *)ra_host_alloc(q_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
    if ((rbuf = (char *)ra_host_alloc(r_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
    if ((kv = (char *)ra_host_alloc(kv_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
    if ((dqb = (char *)ra_host_calloc(dq_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
    if ((scr = (char *)ra_host_alloc(scr_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }

    char *const qp = qbuf, *const dop = qbuf + (size_t)q_elems * rs;
    char *const lse2 = rbuf, *const dlt = rbuf + (size_t)r_elems * rs;

    /* pack q * scale * log2 e (as the forward does: the same scores bit for
     * bit), dout, lse * log2 e, delta per (b, h, row chunk of 256) */
    {
        const int64_t nch = ra_cpu_cdiv(Sq, 256), n_pack = B * H * nch;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t it = 0; it < n_pack; it++) {
            const int64_t c = it % nch, bh = it / nch, b = bh / H, h = bh % H;
            const int64_t i0 = c * 256, n = Sq - i0 < 256 ? Sq - i0 : 256;
            const size_t ro = (size_t)(bh * Sq + i0);
            kn->pack_r(ra_cpu_at(p->q, b * p->q_batch_stride + h * p->q_head_stride +
                                           i0 * p->q_seq_stride, p->dtype),
                       p->q_seq_stride, p->dtype, n, D, Dp, p->scale * RA_LOG2E,
                       qp + ro * (size_t)Dp * rs);
            kn->pack_r(ra_cpu_at(p->dout, b * p->dout_batch_stride +
                                              h * p->dout_head_stride +
                                              i0 * p->dout_seq_stride, p->out_dtype),
                       p->dout_seq_stride, p->out_dtype, n, D, Dp, 1.0,
                       dop + ro * (size_t)Dp * rs);
            const int64_t lo = b * p->lse_batch_stride + h * p->lse_head_stride +
                               i0 * p->lse_seq_stride;
            kn->pack_r(ra_cpu_at(p->lse, lo, acc), p->lse_seq_stride, acc, n, 1, 1,
                       RA_LOG2E, lse2 + ro * rs);
            kn->pack_r(ra_cpu_at(p->delta, lo, acc), p->lse_seq_stride, acc, n, 1,
                       1, 1.0, dlt + ro * rs);
        }
    }
    /* pack k (transposed and rows) and v (transposed) per (b, g, block) */
    {
        const int64_t n_pack = G * nkb;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t it = 0; it < n_pack; it++) {
            const int64_t kb = it % nkb, bg = it / nkb, b = bg / Hkv, g = bg % Hkv;
            const int64_t j0 = kb * BK, n = Sk - j0 < BK ? Sk - j0 : BK;
            char *blk = kv + (size_t)(bg * kv_head + kb * BK * (2 * D + Dp)) * rs;
            const void *ks = ra_cpu_at(p->k, b * p->k_batch_stride +
                                                 g * p->k_head_stride +
                                                 j0 * p->k_seq_stride, p->dtype);
            const void *vs = ra_cpu_at(p->v, b * p->v_batch_stride +
                                                 g * p->v_head_stride +
                                                 j0 * p->v_seq_stride, p->dtype);
            kn->pack_t(ks, p->k_seq_stride, p->dtype, n, D, blk);
            kn->pack_t(vs, p->v_seq_stride, p->dtype, n, D,
                       blk + (size_t)(D * BK) * rs);
            kn->pack_r(ks, p->k_seq_stride, p->dtype, n, D, Dp, 1.0,
                       blk + (size_t)(2 * D * BK) * rs);
        }
    }

    /* main pass over (b, g, split) */
    {
        const int64_t n_items = G * nsplit;
#pragma omp parallel num_threads(nt)
        {
            int tid = 0;
#ifdef _OPENMP
            tid = omp_get_thread_num();
#endif
            char *my = scr + (size_t)tid * scr_each;
            char *dkb = my + kn->bwd_scratch(Dp);
            char *dvb = dkb + (size_t)(BK * Dp) * rs;
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_items; it++) {
                const int64_t bg = it / nsplit, sp = it % nsplit;
                const int64_t b = bg / Hkv, g = bg % Hkv;
                char *dqs = dqb + (size_t)(sp * q_elems) * rs;
                for (int64_t kb = sp; kb < nkb; kb += nsplit) {
                    const int64_t j0 = kb * BK, n = Sk - j0 < BK ? Sk - j0 : BK;
                    const char *blk =
                        kv + (size_t)(bg * kv_head + kb * BK * (2 * D + Dp)) * rs;
                    memset(dkb, 0, (size_t)(2 * BK * Dp) * rs);
                    for (int64_t hh = 0; hh < group; hh++) {
                        const int64_t bh = b * H + g * group + hh;
                        ra_bwd_blk bb;
                        memset(&bb, 0, sizeof bb);
                        bb.q = qp + (size_t)(bh * Sq * Dp) * rs;
                        bb.dout = dop + (size_t)(bh * Sq * Dp) * rs;
                        bb.lse2 = lse2 + (size_t)(bh * Sq) * rs;
                        bb.delta = dlt + (size_t)(bh * Sq) * rs;
                        bb.dq = dqs + (size_t)(bh * Sq * Dp) * rs;
                        bb.nq = Sq;
                        bb.qpos0 = p->q_pos_offset;
                        bb.qpos_st = p->q_pos_stride;
                        bb.kt = blk;
                        bb.vt = blk + (size_t)(D * BK) * rs;
                        bb.kr = blk + (size_t)(2 * D * BK) * rs;
                        bb.nk = n;
                        bb.kpos0 = p->k_pos_offset + j0 * p->k_pos_stride;
                        bb.kpos_st = p->k_pos_stride;
                        bb.dk = dkb;
                        bb.dv = dvb;
                        bb.D = D;
                        bb.Dp = Dp;
                        bb.m = tm;
                        ra_cpu_tile_ids(&ids, b, Sq, Sk, 0, j0, &bb.m);
                        bb.branches = p->branches;
                        bb.head = p->branch_head0 +
                                  p->branch_head_stride * (g * group + hh);
                        kn->bwd_kblock(&bb, my);
                    }
                    kn->store_rows(dkb, n, D, Dp, RA_LN2,   /* q was scaled */
                                   ra_cpu_atw(p->dk, b * p->dk_batch_stride +
                                                         g * p->dk_head_stride +
                                                         j0 * p->dk_seq_stride, gd),
                                   p->dk_seq_stride, gd, p->accumulate);
                    kn->store_rows(dvb, n, D, Dp, 1.0,
                                   ra_cpu_atw(p->dv, b * p->dv_batch_stride +
                                                         g * p->dv_head_stride +
                                                         j0 * p->dv_seq_stride, gd),
                                   p->dv_seq_stride, gd, p->accumulate);
                }
            }
        }
    }

    /* dq = scale * (sum of the split copies, in split order) */
    {
        const int64_t n_rows = B * H * Sq;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t i = r % Sq, bh = r / Sq, b = bh / H, h = bh % H;
            char *row0 = dqb + (size_t)(r * Dp) * rs;
            for (int64_t sp = 1; sp < nsplit; sp++) {
                const char *rowk = row0 + (size_t)(sp * q_elems) * rs;
                if (rs == sizeof(float)) {
                    for (int64_t d = 0; d < D; d++)
                        ((float *)row0)[d] += ((const float *)rowk)[d];
                } else {
                    for (int64_t d = 0; d < D; d++)
                        ((double *)row0)[d] += ((const double *)rowk)[d];
                }
            }
            kn->store_rows(row0, 1, D, Dp, p->scale,
                           ra_cpu_atw(p->dq, b * p->dq_batch_stride +
                                                 h * p->dq_head_stride +
                                                 i * p->dq_seq_stride, gd),
                           0, gd, p->accumulate);
        }
    }

exit:
    ra_cpu_ids_free(&ids);
    ra_host_free(scr, scr_bytes);
    ra_host_free(dqb, dq_bytes);
    ra_host_free(kv, kv_bytes);
    ra_host_free(rbuf, r_bytes);
    ra_host_free(qbuf, q_bytes);
    return st;
}
