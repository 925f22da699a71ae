/*
 * attn_cpu_dilated.c -- LongNet dilated attention on the CPU (DESIGN 2),
 * forward and backward, built from the dense tile kernels.
 *
 *   q, out: (B, S_q, H, D)   k, v: (B, S_k, H_kv, D)   lse, delta: (B, H, S_q)
 *   row i of q sits at global position q_pos_offset + i (stride must be 1),
 *   row j of k/v at k_pos_offset + j.
 *
 * Branch b (segment length w, rate r) pairs query i with key j of query
 * head h iff both lie in one segment [s w, (s+1) w) and both positions are
 * = o (mod r) inside it, o = h mod r (and, if causal, pos_k <= pos_q).  The
 * rows a branch selects from a segment are a strided view of the inputs
 * (sequence stride times r, positions o + s w, o + s w + r, ...), so each
 * work item (segment, batch, head) packs only its selected keys (at most one
 * segment's worth, in per-thread scratch) and runs the dense forward tile
 * kernel over its selected query rows with position stride r.
 *
 * Forward: branches run one after another, every tile in accumulate mode,
 * into a float32 (float64) running state: the output itself when out dtype
 * is the acc dtype, else a scratch copy converted at the end.  This is the
 * LSE merge of the branches with no rounding in between.  Items of one
 * branch write disjoint rows, so there are no races.
 *
 * Backward: the sum over branches of the dense backward restricted to each
 * branch's selection, with the final lse and delta.  Work items are
 * (segment, batch, kv head) so the GQA group's contributions to a key row
 * are added by one thread; gradients collect in the acc dtype (the
 * gradients themselves, or scratch converted at the end).
 */
#include "attn/attn_cpu.h"
#include "attn/attn_cpu_kern.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* positions of a local row range [lo, lo + n) selected by segment s,
 * length w, rate r, offset o: first selected position and how many */
static int64_t select_rows(int64_t lo, int64_t n, int64_t s, int64_t w,
                           int64_t r, int64_t o, int64_t *first) {
    int64_t seg_lo = s * w, seg_hi = seg_lo + w;
    int64_t a = lo > seg_lo ? lo : seg_lo, e = lo + n < seg_hi ? lo + n : seg_hi;
    if (o >= w) return 0;
    int64_t f = seg_lo + o;
    if (f < a) {
        /* a rate past the range selects nothing more (and r may be huge:
         * f + r would overflow) */
        if (r >= e - f) return 0;
        f += ra_cpu_cdiv(a - f, r) * r;
    }
    *first = f;
    return f < e ? (e - 1 - f) / r + 1 : 0;
}

/* The step between the rows a branch of rate r selects (strides and
 * positions are multiplied by it).  A rate at or past the segment length w
 * or the local rows n selects at most one row of a segment here, so no
 * step is ever taken: it is capped there, which keeps every stride times
 * step inside int64 (a rate of 2**62 would overflow). */
static int64_t row_step(int64_t r, int64_t w, int64_t n) {
    int64_t s = r < w ? r : w;
    if (s > n) s = n > 0 ? n : 1;
    return s;
}

/* segments that hold rows of both local ranges: [*s_lo, *s_lo + count) */
static int64_t seg_range(int64_t qlo, int64_t nq, int64_t klo, int64_t nk,
                         int64_t w, int64_t *s_lo) {
    if (nq <= 0 || nk <= 0 || qlo < 0 || klo < 0) return 0;
    const int64_t q_first = qlo / w, q_last = (qlo + nq - 1) / w;
    const int64_t k_first = klo / w, k_last = (klo + nk - 1) / w;
    const int64_t first = q_first > k_first ? q_first : k_first;
    const int64_t last = q_last < k_last ? q_last : k_last;
    if (first > last) return 0;
    *s_lo = first;
    return last - first + 1;
}

ra_status ra_cpu_dilated_fwd(const ra_attn_fwd_params *p,
                             const ra_dilated_config *cfg) {
    RA_CHECK(ra_cpu_check_fwd(p));
    RA_CHECK(ra_check_dilated(cfg, p->q_pos_stride, p->k_pos_stride, &p->mask));
    const int64_t B = p->batch, Sq = p->seqlen_q, Sk = p->seqlen_k;
    const int64_t H = p->heads, Hkv = p->heads_kv, D = p->head_dim;
    if (B == 0 || Sq == 0 || H == 0) return RA_OK;
    const ra_cpu_kernels *kn = ra_cpu_kernels_for(p->dtype);
    const ra_dtype acc = ra_acc_dtype(p->dtype);
    const int64_t Dp = ra_cpu_cdiv(D, kn->vw) * kn->vw, BK = RA_CPU_BK;
    const int64_t group = H / Hkv;
    const size_t rs = (size_t)kn->real_size;
    const int nt = ra_cpu_threads_for(
        p->num_threads, 4.0 * cfg->n_branches * (double)B * (double)H * (double)Sq *
                            (double)(Sk < 4096 ? Sk : 4096) * (double)D);
    const int own_state = p->out_dtype != acc;
    int64_t wmax = 1;
    for (int i = 0; i < cfg->n_branches; i++)
        if (cfg->segment_lengths[i] > wmax) wmax = cfg->segment_lengths[i];
    const int64_t kmax = wmax < Sk ? wmax : Sk, nkb_max = ra_cpu_cdiv(kmax, BK);
    const size_t fwd_scr = (kn->fwd_scratch(Dp) + 63) & ~(size_t)63;
    const size_t scr_each = fwd_scr + ra_cpu_bytes(nkb_max, BK * (D + Dp), 1, (int64_t)rs);
    const size_t scr_bytes = scr_each * (size_t)nt;
    const size_t state_bytes =
        own_state ? ra_cpu_bytes(B * Sq, H * D, 1, (int64_t)ra_dtype_size(acc)) : 0;
    char *scr = NULL, *state = NULL;
    ra_status st = RA_OK;

    /* running state: (ptr, strides) of an acc-dtype (B, S_q, H, D) array */
    void *so = p->out;
    int64_t so_bs = p->out_batch_stride, so_ss = p->out_seq_stride,
            so_hs = p->out_head_stride;
    if ((scr = (char *)ra_host_alloc(scr_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
    if (own_state) {
        if ((state = (char *)ra_host_calloc(state_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
        so = state;
        so_bs = Sq * H * D; so_ss = H * D; so_hs = D;
    }
    if (!p->accumulate) {
        const int64_t n_rows = B * Sq * H;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t h = r % H, i = (r / H) % Sq, b = r / (H * Sq);
            if (!own_state)
                memset(ra_cpu_atw(so, b * so_bs + i * so_ss + h * so_hs, acc), 0,
                       (size_t)D * ra_dtype_size(acc));
            ra_cpu_st(p->lse, b * p->lse_batch_stride + h * p->lse_head_stride +
                                  i * p->lse_seq_stride, acc, -INFINITY);
        }
    }

    for (int br = 0; br < cfg->n_branches; br++) {
        const int64_t w = cfg->segment_lengths[br], r = cfg->dilation_rates[br];
        const int64_t rstep = row_step(r, w, Sq > Sk ? Sq : Sk);
        int64_t s_lo = 0;
        const int64_t nseg = seg_range(p->q_pos_offset, Sq, p->k_pos_offset, Sk, w, &s_lo);
        const int64_t n_items = nseg * B * H;
#pragma omp parallel num_threads(nt)
        {
            int tid = 0;
#ifdef _OPENMP
            tid = omp_get_thread_num();
#endif
            char *my = scr + (size_t)tid * scr_each, *kvp = my + fwd_scr;
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_items; it++) {
                const int64_t s = s_lo + it / (B * H), b = (it / H) % B, h = it % H;
                const int64_t g = h / group, o = h % r;
                int64_t fq = 0, fk = 0;
                const int64_t nq = select_rows(p->q_pos_offset, Sq, s, w, r, o, &fq);
                const int64_t nk = select_rows(p->k_pos_offset, Sk, s, w, r, o, &fk);
                if (nq == 0 || nk == 0) continue;
                const int64_t qi = fq - p->q_pos_offset, kj = fk - p->k_pos_offset;
                const int64_t nkb = ra_cpu_cdiv(nk, BK);
                char *vr = kvp + (size_t)(nkb * D * BK) * rs;
                for (int64_t kb = 0; kb < nkb; kb++) {
                    const int64_t j0 = kb * BK, n = nk - j0 < BK ? nk - j0 : BK;
                    const int64_t row = kj + j0 * rstep;
                    kn->pack_t(ra_cpu_at(p->k, b * p->k_batch_stride + g * p->k_head_stride +
                                                   row * p->k_seq_stride, p->dtype),
                               p->k_seq_stride * rstep, p->dtype, n, D,
                               kvp + (size_t)(kb * D * BK) * rs);
                    kn->pack_r(ra_cpu_at(p->v, b * p->v_batch_stride + g * p->v_head_stride +
                                                   row * p->v_seq_stride, p->dtype),
                               p->v_seq_stride * rstep, p->dtype, n, D, Dp, 1.0,
                               vr + (size_t)(j0 * Dp) * rs);
                }
                for (int64_t i0 = 0; i0 < nq; i0 += RA_CPU_BQ) {
                    const int64_t row = qi + i0 * rstep;
                    ra_fwd_blk fb;
                    memset(&fb, 0, sizeof fb);
                    fb.q = ra_cpu_at(p->q, b * p->q_batch_stride + h * p->q_head_stride +
                                               row * p->q_seq_stride, p->dtype);
                    fb.q_ss = p->q_seq_stride * rstep;
                    fb.dtype = p->dtype;
                    fb.nq = nq - i0 < RA_CPU_BQ ? nq - i0 : RA_CPU_BQ;
                    fb.D = D;
                    fb.Dp = Dp;
                    fb.kt = kvp;
                    fb.vr = vr;
                    fb.nk = nk;
                    fb.qpos0 = fq + i0 * rstep;
                    fb.qpos_st = rstep;
                    fb.kpos0 = fk;
                    fb.kpos_st = rstep;
                    fb.m.has_hi = p->causal;  /* hi_off 0: causal */
                    fb.scale = p->scale;
                    fb.out = ra_cpu_atw(so, b * so_bs + h * so_hs + row * so_ss, acc);
                    fb.out_ss = so_ss * rstep;
                    fb.out_dtype = acc;
                    fb.lse = ra_cpu_atw(p->lse, b * p->lse_batch_stride +
                                                    h * p->lse_head_stride +
                                                    row * p->lse_seq_stride, acc);
                    fb.lse_ss = p->lse_seq_stride * rstep;
                    fb.lse_dtype = acc;
                    fb.accumulate = 1;
                    kn->fwd_block(&fb, my);
                }
            }
        }
    }

    if (own_state) {
        const int64_t n_rows = B * Sq * H;
        const ra_cpu_kernels *kf = ra_cpu_kernels_for(acc);
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t r = 0; r < n_rows; r++) {
            const int64_t h = r % H, i = (r / H) % Sq, b = r / (H * Sq);
            kf->store_rows(ra_cpu_at(so, b * so_bs + i * so_ss + h * so_hs, acc), 1, D, D,
                           1.0,
                           ra_cpu_atw(p->out, b * p->out_batch_stride +
                                                  i * p->out_seq_stride +
                                                  h * p->out_head_stride, p->out_dtype),
                           0, p->out_dtype, 0);
        }
    }

exit:
    ra_host_free(state, state_bytes);
    ra_host_free(scr, scr_bytes);
    return st;
}

/* an acc-dtype gradient target: the gradient itself or a scratch copy */
typedef struct grad_target {
    void *ptr;
    int64_t bs, ss, hs;
} grad_target;

ra_status ra_cpu_dilated_bwd(const ra_attn_bwd_params *p,
                             const ra_dilated_config *cfg) {
    RA_CHECK(ra_cpu_check_bwd(p));
    RA_CHECK(ra_check_dilated(cfg, p->q_pos_stride, p->k_pos_stride, &p->mask));
    const int64_t B = p->batch, Sq = p->seqlen_q, Sk = p->seqlen_k;
    const int64_t H = p->heads, Hkv = p->heads_kv, D = p->head_dim;
    if (B == 0 || H == 0) return RA_OK;
    const ra_cpu_kernels *kn = ra_cpu_kernels_for(p->dtype);
    const ra_dtype acc = ra_acc_dtype(p->dtype), gd = p->grad_dtype;
    const int64_t Dp = ra_cpu_cdiv(D, kn->vw) * kn->vw, BK = RA_CPU_BK;
    const int64_t group = H / Hkv;
    const size_t rs = (size_t)kn->real_size, as = ra_dtype_size(acc);
    const int nt = ra_cpu_threads_for(
        p->num_threads, 10.0 * cfg->n_branches * (double)B * (double)H * (double)Sq *
                            (double)(Sk < 4096 ? Sk : 4096) * (double)D);
    const int own = gd != acc;
    int64_t wmax = 1;
    for (int i = 0; i < cfg->n_branches; i++)
        if (cfg->segment_lengths[i] > wmax) wmax = cfg->segment_lengths[i];
    const int64_t qmax = wmax < Sq ? wmax : Sq, kmax = wmax < Sk ? wmax : Sk;
    const int64_t nkb_max = ra_cpu_cdiv(kmax, BK);
    /* per thread: tile scratch | q, dout, dq (qmax x Dp) | lse2, delta (qmax)
     * | kt, vt, kr per key block | dk, dv block accumulators */
    const size_t tile = (kn->bwd_scratch(Dp) + 63) & ~(size_t)63;
    const size_t scr_each =
        tile + rs * (size_t)(3 * qmax * Dp + 2 * qmax + nkb_max * BK * (2 * D + Dp) +
                             2 * BK * Dp) + 64;
    const size_t scr_bytes = scr_each * (size_t)nt;
    const size_t gq_bytes = own ? ra_cpu_bytes(B * Sq, H * D, 1, (int64_t)as) : 0;
    const size_t gk_bytes = own ? ra_cpu_bytes(B * Sk, Hkv * D, 1, (int64_t)as) : 0;
    char *scr = NULL, *gq = NULL, *gk = NULL, *gv = NULL;
    ra_status st = RA_OK;
    grad_target tq = {p->dq, p->dq_batch_stride, p->dq_seq_stride, p->dq_head_stride};
    grad_target tk = {p->dk, p->dk_batch_stride, p->dk_seq_stride, p->dk_head_stride};
    grad_target tv = {p->dv, p->dv_batch_stride, p->dv_seq_stride, p->dv_head_stride};

    if ((scr = (char *)ra_host_alloc(scr_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
    if (own) {
        if ((gq = (char *)ra_host_calloc(gq_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
        if ((gk = (char *)ra_host_calloc(gk_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
        if ((gv = (char *)ra_host_calloc(gk_bytes)) == NULL) { st = RA_ERR_NOMEM; goto exit; }
        tq = (grad_target){gq, Sq * H * D, H * D, D};
        tk = (grad_target){gk, Sk * Hkv * D, Hkv * D, D};
        tv = (grad_target){gv, Sk * Hkv * D, Hkv * D, D};
    } else if (!p->accumulate) {
        ra_cpu_zero_rows(p->dq, gd, B, Sq, H, D, tq.bs, tq.ss, tq.hs, nt);
        ra_cpu_zero_rows(p->dk, gd, B, Sk, Hkv, D, tk.bs, tk.ss, tk.hs, nt);
        ra_cpu_zero_rows(p->dv, gd, B, Sk, Hkv, D, tv.bs, tv.ss, tv.hs, nt);
    }

    for (int br = 0; br < cfg->n_branches; br++) {
        const int64_t w = cfg->segment_lengths[br], r = cfg->dilation_rates[br];
        const int64_t rstep = row_step(r, w, Sq > Sk ? Sq : Sk);
        int64_t s_lo = 0;
        const int64_t nseg = seg_range(p->q_pos_offset, Sq, p->k_pos_offset, Sk, w, &s_lo);
        const int64_t n_items = nseg * B * Hkv;
#pragma omp parallel num_threads(nt)
        {
            int tid = 0;
#ifdef _OPENMP
            tid = omp_get_thread_num();
#endif
            char *my = scr + (size_t)tid * scr_each;
            char *qp = my + tile, *dop = qp + (size_t)(qmax * Dp) * rs;
            char *dqp = dop + (size_t)(qmax * Dp) * rs;
            char *l2p = dqp + (size_t)(qmax * Dp) * rs, *dlp = l2p + (size_t)qmax * rs;
            char *kvp = dlp + (size_t)qmax * rs;
            char *dkb = kvp + (size_t)(nkb_max * BK * (2 * D + Dp)) * rs;
            char *dvb = dkb + (size_t)(BK * Dp) * rs;
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_items; it++) {
                const int64_t s = s_lo + it / (B * Hkv), b = (it / Hkv) % B, g = it % Hkv;
                for (int64_t hh = 0; hh < group; hh++) {
                    const int64_t h = g * group + hh, o = h % r;
                    int64_t fq = 0, fk = 0;
                    const int64_t nq = select_rows(p->q_pos_offset, Sq, s, w, r, o, &fq);
                    const int64_t nk = select_rows(p->k_pos_offset, Sk, s, w, r, o, &fk);
                    if (nq == 0 || nk == 0) continue;
                    const int64_t qi = fq - p->q_pos_offset, kj = fk - p->k_pos_offset;
                    const int64_t lo = b * p->lse_batch_stride + h * p->lse_head_stride +
                                       qi * p->lse_seq_stride;
                    kn->pack_r(ra_cpu_at(p->q, b * p->q_batch_stride + h * p->q_head_stride +
                                                   qi * p->q_seq_stride, p->dtype),
                               p->q_seq_stride * rstep, p->dtype, nq, D, Dp,
                               p->scale * RA_LOG2E, qp);   /* as the forward */
                    kn->pack_r(ra_cpu_at(p->dout, b * p->dout_batch_stride +
                                                      h * p->dout_head_stride +
                                                      qi * p->dout_seq_stride, p->out_dtype),
                               p->dout_seq_stride * rstep, p->out_dtype, nq, D, Dp, 1.0, dop);
                    kn->pack_r(ra_cpu_at(p->lse, lo, acc), p->lse_seq_stride * rstep, acc, nq,
                               1, 1, RA_LOG2E, l2p);
                    kn->pack_r(ra_cpu_at(p->delta, lo, acc), p->lse_seq_stride * rstep, acc,
                               nq, 1, 1, 1.0, dlp);
                    memset(dqp, 0, (size_t)(nq * Dp) * rs);
                    const int64_t nkb = ra_cpu_cdiv(nk, BK);
                    for (int64_t kb = 0; kb < nkb; kb++) {
                        const int64_t j0 = kb * BK, n = nk - j0 < BK ? nk - j0 : BK;
                        const int64_t row = kj + j0 * rstep;
                        char *blk = kvp + (size_t)(kb * BK * (2 * D + Dp)) * rs;
                        const void *ks = ra_cpu_at(p->k, b * p->k_batch_stride +
                                                             g * p->k_head_stride +
                                                             row * p->k_seq_stride, p->dtype);
                        const void *vs = ra_cpu_at(p->v, b * p->v_batch_stride +
                                                             g * p->v_head_stride +
                                                             row * p->v_seq_stride, p->dtype);
                        kn->pack_t(ks, p->k_seq_stride * rstep, p->dtype, n, D, blk);
                        kn->pack_t(vs, p->v_seq_stride * rstep, p->dtype, n, D,
                                   blk + (size_t)(D * BK) * rs);
                        kn->pack_r(ks, p->k_seq_stride * rstep, p->dtype, n, D, Dp, 1.0,
                                   blk + (size_t)(2 * D * BK) * rs);
                        memset(dkb, 0, (size_t)(2 * BK * Dp) * rs);
                        ra_bwd_blk bb;
                        memset(&bb, 0, sizeof bb);
                        bb.q = qp; bb.dout = dop; bb.lse2 = l2p; bb.delta = dlp; bb.dq = dqp;
                        bb.nq = nq; bb.qpos0 = fq; bb.qpos_st = rstep;
                        bb.kt = blk;
                        bb.vt = blk + (size_t)(D * BK) * rs;
                        bb.kr = blk + (size_t)(2 * D * BK) * rs;
                        bb.nk = n; bb.kpos0 = fk + j0 * rstep; bb.kpos_st = rstep;
                        bb.dk = dkb; bb.dv = dvb; bb.D = D; bb.Dp = Dp;
                        bb.m.has_hi = p->causal;
                        bb.branches = cfg; bb.head = h;
                        kn->bwd_kblock(&bb, my);
                        kn->store_rows(dkb, n, D, Dp, RA_LN2,   /* q was scaled */
                                       ra_cpu_atw(tk.ptr, b * tk.bs + g * tk.hs + row * tk.ss, acc),
                                       tk.ss * rstep, acc, 1);
                        kn->store_rows(dvb, n, D, Dp, 1.0,
                                       ra_cpu_atw(tv.ptr, b * tv.bs + g * tv.hs + row * tv.ss, acc),
                                       tv.ss * rstep, acc, 1);
                    }
                    kn->store_rows(dqp, nq, D, Dp, p->scale,
                                   ra_cpu_atw(tq.ptr, b * tq.bs + h * tq.hs + qi * tq.ss, acc),
                                   tq.ss * rstep, acc, 1);
                }
            }
        }
    }

    if (own) {   /* convert the acc-dtype gradients (overwrite: !accumulate) */
        const ra_cpu_kernels *kf = ra_cpu_kernels_for(acc);
        const int64_t nq_rows = B * Sq * H, nk_rows = B * Sk * Hkv;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t rr = 0; rr < nq_rows + 2 * nk_rows; rr++) {
            const grad_target *t = rr < nq_rows ? &tq : (rr < nq_rows + nk_rows ? &tk : &tv);
            void *dst = rr < nq_rows ? p->dq : (rr < nq_rows + nk_rows ? p->dk : p->dv);
            int64_t x = rr < nq_rows ? rr : (rr - nq_rows) % nk_rows;
            const int64_t Hx = rr < nq_rows ? H : Hkv, Sx = rr < nq_rows ? Sq : Sk;
            const int64_t h = x % Hx, i = (x / Hx) % Sx, b = x / (Hx * Sx);
            int64_t dbs, dss, dhs;
            if (rr < nq_rows) { dbs = p->dq_batch_stride; dss = p->dq_seq_stride; dhs = p->dq_head_stride; }
            else if (rr < nq_rows + nk_rows) { dbs = p->dk_batch_stride; dss = p->dk_seq_stride; dhs = p->dk_head_stride; }
            else { dbs = p->dv_batch_stride; dss = p->dv_seq_stride; dhs = p->dv_head_stride; }
            kf->store_rows(ra_cpu_at(t->ptr, b * t->bs + i * t->ss + h * t->hs, acc), 1, D, D,
                           1.0, ra_cpu_atw(dst, b * dbs + i * dss + h * dhs, gd), 0, gd, 0);
        }
    }

exit:
    ra_host_free(gv, gk_bytes);
    ra_host_free(gk, gk_bytes);
    ra_host_free(gq, gq_bytes);
    ra_host_free(scr, scr_bytes);
    return st;
}
