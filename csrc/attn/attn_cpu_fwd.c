/*
 * attn_cpu_fwd.c -- dense attention forward on the CPU.
 *
 *   q: (B, S_q, H, D)   k, v: (B, S_k, H_kv, D)   out: (B, S_q, H, D)
 *   lse: (B, H, S_q) acc dtype
 *
 * Algorithm: keys and values of every (batch, kv head) are converted once
 * into float (double for float64) scratch -- K transposed in blocks of
 * RA_CPU_BK keys, V row-major with D padded to the vector width.  Then the
 * work items (batch, head, block of RA_CPU_BQ query rows) are shared among
 * OpenMP threads, heaviest causal blocks first, and each runs the
 * flash-style tile kernel (attn_cpu_tiles.h) that streams the key blocks
 * with an online softmax.  Each item writes only its own rows of out/lse,
 * so there are no races and the result does not depend on the thread count.
 * Masks reach the tiles as an ra_tile_mask (attn_cpu_mask.c): position
 * bounds, contiguous ids, the softcap; the tiles skip what no row sees.
 */
#include "attn/attn_cpu.h"
#include "attn/attn_cpu_kern.h"

#ifdef _OPENMP
#include <omp.h>
#endif

static ra_status check_dims(ra_dtype dtype, int64_t B, int64_t sq, int64_t sk,
                            int64_t H, int64_t Hkv, int64_t D, int64_t qps,
                            int64_t kps) {
    if (dtype != RA_FLOAT32 && dtype != RA_FLOAT64 && dtype != RA_FLOAT16 &&
        dtype != RA_BFLOAT16) {
        ra_set_error(RA_ERR_TYPE, "attention: unsupported dtype %s",
                     ra_dtype_name(dtype));
        return RA_ERR_TYPE;
    }
    if (B < 0 || sq < 0 || sk < 0 || H < 0 || Hkv < 1 || H % Hkv != 0) {
        ra_set_error(RA_ERR_VALUE,
                     "attention: bad sizes (batch %lld, seqlen_q %lld, "
                     "seqlen_k %lld, heads %lld, heads_kv %lld)",
                     (long long)B, (long long)sq, (long long)sk, (long long)H,
                     (long long)Hkv);
        return RA_ERR_VALUE;
    }
    if (D < 1 || D > RA_MAX_HEAD_DIM) {
        ra_set_error(RA_ERR_VALUE, "attention: head_dim must be in 1..%d, got %lld",
                     RA_MAX_HEAD_DIM, (long long)D);
        return RA_ERR_VALUE;
    }
    if (qps < 1 || kps < 1) {
        ra_set_error(RA_ERR_VALUE,
                     "attention: position strides must be >= 1 (q %lld, k %lld)",
                     (long long)qps, (long long)kps);
        return RA_ERR_VALUE;
    }
    return RA_OK;
}

static ra_status check_mask(const ra_attn_mask *m) {
    if ((m->q_segment_ids == NULL) != (m->kv_segment_ids == NULL)) {
        ra_set_error(RA_ERR_VALUE,
                     "attention: segment ids for queries and keys go "
                     "together (got one of them)");
        return RA_ERR_VALUE;
    }
    if (!RA_SOFTCAP_OK(m->softcap)) {
        ra_set_error(RA_ERR_VALUE,
                     "attention: softcap must be in [%g, %g] (or 0 for "
                     "none), got %g",
                     RA_SOFTCAP_MIN, RA_SOFTCAP_MAX, m->softcap);
        return RA_ERR_VALUE;
    }
    return RA_OK;
}

int ra_cpu_mask_is_set(const ra_attn_mask *m) {
    return m->q_segment_ids != NULL || m->has_window || m->softcap > 0;
}

ra_status ra_cpu_check_fwd(const ra_attn_fwd_params *p) {
    RA_CHECK(check_dims(p->dtype, p->batch, p->seqlen_q, p->seqlen_k, p->heads,
                        p->heads_kv, p->head_dim, p->q_pos_stride,
                        p->k_pos_stride));
    RA_CHECK(check_mask(&p->mask));
    ra_dtype acc = ra_acc_dtype(p->dtype);
    if (p->out_dtype != p->dtype && p->out_dtype != acc) {
        ra_set_error(RA_ERR_TYPE, "attention: out dtype %s for inputs %s",
                     ra_dtype_name(p->out_dtype), ra_dtype_name(p->dtype));
        return RA_ERR_TYPE;
    }
    if (p->accumulate && p->out_dtype != acc) {
        ra_set_error(RA_ERR_TYPE,
                     "attention: accumulate needs out dtype %s, got %s",
                     ra_dtype_name(acc), ra_dtype_name(p->out_dtype));
        return RA_ERR_TYPE;
    }
    return RA_OK;
}

ra_status ra_cpu_check_bwd(const ra_attn_bwd_params *p) {
    RA_CHECK(check_dims(p->dtype, p->batch, p->seqlen_q, p->seqlen_k, p->heads,
                        p->heads_kv, p->head_dim, p->q_pos_stride,
                        p->k_pos_stride));
    RA_CHECK(check_mask(&p->mask));
    RA_CHECK(ra_check_branches(p));
    ra_dtype acc = ra_acc_dtype(p->dtype);
    if ((p->out_dtype != p->dtype && p->out_dtype != acc) ||
        (p->grad_dtype != p->dtype && p->grad_dtype != acc)) {
        ra_set_error(RA_ERR_TYPE,
                     "attention backward: out dtype %s / grad dtype %s for "
                     "inputs %s",
                     ra_dtype_name(p->out_dtype), ra_dtype_name(p->grad_dtype),
                     ra_dtype_name(p->dtype));
        return RA_ERR_TYPE;
    }
    if (p->accumulate && p->grad_dtype != acc) {
        ra_set_error(RA_ERR_TYPE,
                     "attention backward: accumulate needs grad dtype %s, got %s",
                     ra_dtype_name(acc), ra_dtype_name(p->grad_dtype));
        return RA_ERR_TYPE;
    }
    return RA_OK;
}

ra_status ra_cpu_attn_fwd(const ra_attn_fwd_params *p) {
    RA_CHECK(ra_cpu_check_fwd(p));
    const int64_t B = p->batch, Sq = p->seqlen_q, Sk = p->seqlen_k;
    const int64_t H = p->heads, Hkv = p->heads_kv, D = p->head_dim;
    if (B == 0 || Sq == 0 || H == 0) return RA_OK;

    const ra_cpu_kernels *kn = ra_cpu_kernels_for(p->dtype);
    const int64_t Dp = ra_cpu_cdiv(D, kn->vw) * kn->vw, BK = RA_CPU_BK;
    const int64_t group = H / Hkv, nkb = ra_cpu_cdiv(Sk, BK);
    const ra_dtype lse_dtype = ra_acc_dtype(p->dtype);
    const size_t rs = (size_t)kn->real_size;
    /* per (batch, kv head): kt = nkb blocks of (D, BK); vr = (nkb*BK, Dp) */
    const int64_t kt_elems = nkb * D * BK, per_head = nkb * BK * (D + Dp);
    const int nt = ra_cpu_threads_for(
        p->num_threads, 4.0 * (double)B * (double)H * (double)Sq * (double)Sk * (double)D);
    const size_t scr_each = (kn->fwd_scratch(Dp) + 63) & ~(size_t)63;
    size_t kv_bytes = ra_cpu_bytes(B, Hkv, per_head, (int64_t)rs);
    size_t scr_bytes = scr_each * (size_t)nt;
    char *kv = NULL, *scr = NULL;
    ra_cpu_ids ids;
    ra_tile_mask tm;
    ra_status st = RA_OK;

    if (per_head > 0 && kv_bytes == 0) {
        ra_set_error(RA_ERR_OVERFLOW, "attention: scratch size overflows");
        return RA_ERR_OVERFLOW;
    }
    ra_cpu_tile_mask(p->causal, &p->mask, &tm);
    RA_CHECK(ra_cpu_ids_prepare(&p->mask, B, Sq, Sk, &ids));
    kv = (char *)ra_host_alloc(kv_bytes);
    if (kv == NULL) { st = RA_ERR_NOMEM; goto exit; }
    scr = (char *)ra_host_alloc(scr_bytes);
    if (scr == NULL) { st = RA_ERR_NOMEM; goto exit; }

    /* pack K (transposed blocks) and V (padded rows) per (b, kv head, block) */
    {
        const int64_t n_pack = B * Hkv * nkb;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t it = 0; it < n_pack; it++) {
            const int64_t kb = it % nkb, bh = it / nkb;
            const int64_t b = bh / Hkv, g = bh % Hkv;
            const int64_t j0 = kb * BK, n = Sk - j0 < BK ? Sk - j0 : BK;
            char *base = kv + (size_t)bh * (size_t)per_head * rs;
            const int64_t ko = b * p->k_batch_stride + g * p->k_head_stride +
                               j0 * p->k_seq_stride;
            const int64_t vo = b * p->v_batch_stride + g * p->v_head_stride +
                               j0 * p->v_seq_stride;
            kn->pack_t(ra_cpu_at(p->k, ko, p->dtype), p->k_seq_stride, p->dtype,
                       n, D, base + (size_t)(kb * D * BK) * rs);
            kn->pack_r(ra_cpu_at(p->v, vo, p->dtype), p->v_seq_stride, p->dtype,
                       n, D, Dp, 1.0,
                       base + (size_t)(kt_elems + j0 * Dp) * rs);
        }
    }

    /* work items (b, h, query block); causal: later blocks first */
    {
        const int64_t nqb = ra_cpu_cdiv(Sq, RA_CPU_BQ);
        const int64_t n_items = B * H * nqb;
#pragma omp parallel num_threads(nt)
        {
            int tid = 0;
#ifdef _OPENMP
            tid = omp_get_thread_num();
#endif
            void *my_scr = scr + (size_t)tid * scr_each;
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_items; it++) {
                const int64_t qb = nqb - 1 - it / (B * H), bh = it % (B * H);
                const int64_t b = bh / H, h = bh % H, g = h / group;
                const int64_t i0 = qb * RA_CPU_BQ;
                const char *base =
                    kv + (size_t)(b * Hkv + g) * (size_t)per_head * rs;
                ra_fwd_blk fb;
                memset(&fb, 0, sizeof fb);
                fb.q = ra_cpu_at(p->q, b * p->q_batch_stride +
                                           h * p->q_head_stride +
                                           i0 * p->q_seq_stride, p->dtype);
                fb.q_ss = p->q_seq_stride;
                fb.dtype = p->dtype;
                fb.nq = Sq - i0 < RA_CPU_BQ ? Sq - i0 : RA_CPU_BQ;
                fb.D = D;
                fb.Dp = Dp;
                fb.kt = base;
                fb.vr = base + (size_t)kt_elems * rs;
                fb.nk = Sk;
                fb.qpos0 = p->q_pos_offset + i0 * p->q_pos_stride;
                fb.qpos_st = p->q_pos_stride;
                fb.kpos0 = p->k_pos_offset;
                fb.kpos_st = p->k_pos_stride;
                fb.m = tm;
                ra_cpu_tile_ids(&ids, b, Sq, Sk, i0, 0, &fb.m);
                fb.scale = p->scale;
                fb.out = ra_cpu_atw(p->out, b * p->out_batch_stride +
                                                h * p->out_head_stride +
                                                i0 * p->out_seq_stride,
                                    p->out_dtype);
                fb.out_ss = p->out_seq_stride;
                fb.out_dtype = p->out_dtype;
                fb.lse = ra_cpu_atw(p->lse, b * p->lse_batch_stride +
                                                h * p->lse_head_stride +
                                                i0 * p->lse_seq_stride,
                                    lse_dtype);
                fb.lse_ss = p->lse_seq_stride;
                fb.lse_dtype = lse_dtype;
                fb.accumulate = p->accumulate;
                kn->fwd_block(&fb, my_scr);
            }
        }
    }

exit:
    ra_host_free(scr, scr_bytes);
    ra_host_free(kv, kv_bytes);
    ra_cpu_ids_free(&ids);
    return st;
}
