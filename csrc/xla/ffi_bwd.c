/*
 * ffi_bwd.c -- the backward handlers.
 *
 *   ringattn_attn_bwd_pre  (dout, out) -> delta = rowsum(dout * out)
 *   ringattn_attn_bwd      (dout, q, k, v, lse, delta[, positions]
 *                          [, q ids, kv ids]) -> (dq, dk, dv)
 *   ringattn_attn_bwd_acc  (dout, q, k, v, lse, delta, dq, dk, dv
 *                          [, positions][, q ids, kv ids])
 *                          -> (dq, dk, dv) float32 (float64), aliased: this
 *                          block's gradients are added in place
 *   ringattn_dilated_bwd   (dout, q, k, v, lse, delta) -> (dq, dk, dv)  CPU
 *
 * dout, q, dq: (B, S_q, H, D); k, v, dk, dv: (B, S_k, H_kv, D); lse, delta:
 * (B, H, S_q) acc dtype: lse is the final one over all keys.  Masks as
 * ffi_fwd.c's.  Gradients are deterministic (same bits on every run: no
 * atomics on either platform): the params ask for deterministic, so CUDA
 * runs the split tensor-core kernels, not the fused one, whose 16-bit dq
 * would need a float32 scratch ordered on XLA's stream (ringattn's pool
 * orders its blocks on ringattn's compute stream).
 */
#include <string.h>

#include "xla/ffi_args.h"
#include "xla/ffi_device.h"
#include "xla/ffi_handlers.h"

typedef struct bwd_job {
    const ra_xla_qkv *d;
    int64_t B;
    const char *dout, *q, *k, *v, *lse, *delta;
    char *dq, *dk, *dv;
    ra_dtype grad_dtype;
    const ra_xla_opts *o;
    const int32_t *q_ids, *kv_ids;      /* NULL without segment ids */
} bwd_job;

static void bwd_params(ra_attn_bwd_params *p, const bwd_job *j,
                       const ra_xla_block *blk, int accumulate) {
    const ra_xla_qkv *d = j->d;
    const size_t es = ra_dtype_size(d->dtype), gs = ra_dtype_size(j->grad_dtype),
                 ls = ra_dtype_size(d->acc);
    const size_t qrow = (size_t)(blk->q_off * d->H * d->D),
                 krow = (size_t)(blk->k_off * d->Hkv * d->D);
    ra_attn_mask mask;
    ra_xla_block_mask(&mask, j->o, j->q_ids, j->kv_ids, d, blk->q_off,
                      blk->k_off);
    const ra_attn_call call = {d->dtype, j->B, blk->nq, blk->nk, d->H, d->Hkv,
                               d->D, j->o->scale, j->o->causal, blk->q_start,
                               blk->q_stride, blk->k_start, blk->k_stride,
                               &mask, accumulate, j->o->num_threads};
    ra_view t[RA_BWD_NVIEWS];
    t[RA_BWD_Q] = ra_xla_rows_view(j->q + qrow * es, d->Sq, d->H, d->D);
    t[RA_BWD_K] = ra_xla_rows_view(j->k + krow * es, d->Sk, d->Hkv, d->D);
    t[RA_BWD_V] = ra_xla_rows_view(j->v + krow * es, d->Sk, d->Hkv, d->D);
    /* out is not read: delta = rowsum(dout * out) comes precomputed */
    t[RA_BWD_OUT] = ra_xla_rows_view(NULL, d->Sq, d->H, d->D);
    t[RA_BWD_DOUT] = ra_xla_rows_view(j->dout + qrow * es, d->Sq, d->H, d->D);
    t[RA_BWD_LSE] = ra_xla_bhs_view(j->lse + (size_t)blk->q_off * ls, d->H,
                                    d->Sq);
    t[RA_BWD_DELTA] = ra_xla_bhs_view(j->delta + (size_t)blk->q_off * ls,
                                      d->H, d->Sq);
    t[RA_BWD_DQ] = ra_xla_rows_view(j->dq + qrow * gs, d->Sq, d->H, d->D);
    t[RA_BWD_DK] = ra_xla_rows_view(j->dk + krow * gs, d->Sk, d->Hkv, d->D);
    t[RA_BWD_DV] = ra_xla_rows_view(j->dv + krow * gs, d->Sk, d->Hkv, d->D);
    ra_attn_bwd_fill(p, &call, t, d->dtype, j->grad_dtype, 1);
}

/* As fwd_pieces: one plain call, or blocks added into the gradients (zeroed
 * first for a call without gradient inputs). */
static ra_status bwd_pieces(const ra_xla_call *c, const bwd_job *j,
                            const ra_xla_pieces *pp, int accumulate) {
    const ra_xla_qkv *d = j->d;
    ra_attn_bwd_params p;
    ra_xla_block blocks[RA_XLA_MAX_BLOCKS];
    if (!accumulate && ra_xla_single_block(pp, &blocks[0])) {
        bwd_params(&p, j, &blocks[0], 0);
        return ra_xla_run_bwd(c, &p);
    }
    if (!accumulate) {
        if (j->grad_dtype != d->acc) {
            ra_set_error(RA_ERR_TYPE,
                         "dq: a backward over several position pieces "
                         "accumulates in %s, got %s",
                         ra_dtype_name(d->acc), ra_dtype_name(j->grad_dtype));
            return RA_ERR_TYPE;
        }
        const size_t gs = ra_dtype_size(d->acc);
        RA_CHECK(ra_xla_zero(c, j->dq, (size_t)(j->B * d->Sq * d->H * d->D) * gs));
        RA_CHECK(ra_xla_zero(c, j->dk, (size_t)(j->B * d->Sk * d->Hkv * d->D) * gs));
        RA_CHECK(ra_xla_zero(c, j->dv, (size_t)(j->B * d->Sk * d->Hkv * d->D) * gs));
    }
    const int n = ra_xla_state_blocks(pp, j->o, blocks);
    for (int i = 0; i < n; i++) {
        bwd_params(&p, j, &blocks[i], 1);
        RA_CHECK(ra_xla_run_bwd(c, &p));
    }
    return RA_OK;
}

/* dout, q, k, v, lse, delta: arguments 0..5; dq, dk, dv: results 0..2. */
static ra_status load_bwd(ra_xla_call *c, ra_xla_tensor *t, ra_xla_tensor *g,
                          ra_xla_qkv *d, ra_xla_opts *o, int accumulate) {
    static const char *names[6] = {"dout", "q", "k", "v", "lse", "delta"};
    static const int cores[6] = {4, 4, 4, 4, 3, 3};
    for (int i = 0; i < 6; i++) RA_CHECK(ra_xla_arg(c, i, names[i], cores[i], &t[i]));
    RA_CHECK(ra_xla_check_qkv(&t[1], &t[2], &t[3], d));
    RA_CHECK(ra_xla_check_rows(&t[0], d, d->Sq, d->H, d->dtype, d->dtype));
    RA_CHECK(ra_xla_check_bhs(&t[4], d));
    RA_CHECK(ra_xla_check_bhs(&t[5], d));
    RA_CHECK(ra_xla_ret(c, 0, "dq", 4, &g[0]));
    RA_CHECK(ra_xla_ret(c, 1, "dk", 4, &g[1]));
    RA_CHECK(ra_xla_ret(c, 2, "dv", 4, &g[2]));
    const ra_dtype want = accumulate ? d->acc : d->dtype;
    RA_CHECK(ra_xla_check_rows(&g[0], d, d->Sq, d->H, want, d->acc));
    RA_CHECK(ra_xla_check_rows(&g[1], d, d->Sk, d->Hkv, g[0].dtype, g[0].dtype));
    RA_CHECK(ra_xla_check_rows(&g[2], d, d->Sk, d->Hkv, g[0].dtype, g[0].dtype));
    return ra_xla_read_opts(c, d->D, o);
}

/* ids: the two id operands, or NULL */
static bwd_job make_job(const ra_xla_lead *l, ra_xla_tensor *t,
                        ra_xla_tensor *g, const ra_xla_qkv *d,
                        const ra_xla_opts *o, const ra_xla_tensor *ids,
                        int64_t it, int whole) {
    bwd_job j = {d, whole ? l->count * d->B : d->B,
                 ra_xla_item(l, &t[0], it, whole), ra_xla_item(l, &t[1], it, whole),
                 ra_xla_item(l, &t[2], it, whole), ra_xla_item(l, &t[3], it, whole),
                 ra_xla_item(l, &t[4], it, whole), ra_xla_item(l, &t[5], it, whole),
                 ra_xla_item(l, &g[0], it, whole), ra_xla_item(l, &g[1], it, whole),
                 ra_xla_item(l, &g[2], it, whole), g[0].dtype, o, NULL, NULL};
    if (ids != NULL) {
        j.q_ids = (const int32_t *)ra_xla_item(l, &ids[0], it, whole);
        j.kv_ids = (const int32_t *)ra_xla_item(l, &ids[1], it, whole);
    }
    return j;
}

static ra_status attn_bwd(ra_xla_call *c, int accumulate) {
    const int base = accumulate ? 9 : 6;
    ra_xla_tensor t[9], g[3], pos, ids[2];
    ra_xla_qkv d;
    ra_xla_opts o;
    ra_xla_lead l;
    int nq = 1;
    RA_CHECK(load_bwd(c, t, g, &d, &o, accumulate));
    if (accumulate) {
        static const char *names[3] = {"running dq", "running dk", "running dv"};
        for (int i = 0; i < 3; i++) {
            RA_CHECK(ra_xla_arg(c, 6 + i, names[i], 4, &t[6 + i]));
            RA_CHECK(ra_xla_check_alias(&t[6 + i], &g[i]));
        }
    }
    RA_CHECK(ra_xla_lead_plan(&l, t, base, g, 3));
    RA_CHECK(ra_xla_optional_args(c, base, &o, &d, &l, &pos, &nq, ids));
    if (accumulate) {   /* XLA aliases them; copy if it could not */
        for (int i = 0; i < 3; i++)
            RA_CHECK(ra_xla_copy(c, g[i].data, t[6 + i].data,
                                 (size_t)(l.count * ra_xla_core_numel(&g[i])) *
                                     ra_dtype_size(d.acc)));
    }
    const int shared = pos.data == NULL || ra_xla_lead_shared(&pos);
    const int one = l.folded && shared;
    const int64_t iters = one ? 1 : l.count;
    ra_xla_pieces pp;
    /* positions shared by the batch are read once per call (on CUDA that
     * is a device-to-host copy: csrc/xla/README.md) */
    if (shared)
        RA_CHECK(ra_xla_load_pieces(c, &pos, nq, &l, 0, d.Sq, d.Sk, &pp));
    for (int64_t it = 0; it < iters; it++) {
        if (!shared)
            RA_CHECK(ra_xla_load_pieces(c, &pos, nq, &l, it, d.Sq, d.Sk, &pp));
        bwd_job j = make_job(&l, t, g, &d, &o, o.has_ids ? ids : NULL, it, one);
        RA_CHECK(bwd_pieces(c, &j, &pp, accumulate));
    }
    return RA_OK;
}

ra_status ra_xla_attn_bwd(ra_xla_call *c) { return attn_bwd(c, 0); }
ra_status ra_xla_attn_bwd_acc(ra_xla_call *c) { return attn_bwd(c, 1); }

ra_status ra_xla_dilated_bwd(ra_xla_call *c) {
    ra_xla_tensor t[6], g[3];
    ra_xla_qkv d;
    ra_xla_opts o;
    ra_xla_lead l;
    ra_dilated_config cfg;
    RA_CHECK(load_bwd(c, t, g, &d, &o, 0));
    RA_CHECK(ra_xla_no_masks(&o));
    RA_CHECK(ra_xla_read_dilated(c, &d, &cfg));
    RA_CHECK(ra_xla_lead_plan(&l, t, 6, g, 3));
    const int64_t iters = l.folded ? 1 : l.count;
    for (int64_t it = 0; it < iters; it++) {
        bwd_job j = make_job(&l, t, g, &d, &o, NULL, it, l.folded);
        const ra_xla_block all = {0, d.Sq, 0, 1, 0, d.Sk, 0, 1};
        ra_attn_bwd_params p;
        bwd_params(&p, &j, &all, 0);
        RA_CHECK(ra_xla_run_dilated_bwd(c, &p, &cfg));
    }
    return RA_OK;
}

/* ---- delta ------------------------------------------------------------------ */

ra_status ra_xla_bwd_preprocess(ra_xla_call *c) {
    ra_xla_tensor t[2], delta;
    ra_xla_lead l;
    ra_xla_qkv d;
    RA_CHECK(ra_xla_arg(c, 0, "dout", 4, &t[0]));
    RA_CHECK(ra_xla_arg(c, 1, "out", 4, &t[1]));
    RA_CHECK(ra_xla_ret(c, 0, "delta", 3, &delta));
    if (t[0].dtype == RA_DTYPE_OTHER) {
        ra_set_error(RA_ERR_TYPE, "dout: expected a float dtype");
        return RA_ERR_TYPE;
    }
    memset(&d, 0, sizeof d);
    d.B = ra_xla_dim(&t[0], 0);
    d.Sq = ra_xla_dim(&t[0], 1);
    d.H = d.Hkv = ra_xla_dim(&t[0], 2);
    d.D = ra_xla_dim(&t[0], 3);
    d.dtype = t[0].dtype;
    d.acc = ra_acc_dtype(d.dtype);
    RA_CHECK(ra_xla_check_rows(&t[1], &d, d.Sq, d.H, d.dtype, d.dtype));
    RA_CHECK(ra_xla_check_bhs(&delta, &d));
    int nt = 0;
    RA_CHECK(ra_xla_attr_threads(c, &nt));
    RA_CHECK(ra_xla_lead_plan(&l, t, 2, &delta, 1));
    const int64_t iters = l.folded ? 1 : l.count;
    for (int64_t it = 0; it < iters; it++) {
        /* the kernel reads only dout, out and delta; q, k, v alias dout */
        const ra_attn_call call = {d.dtype, l.folded ? l.count * d.B : d.B,
                                   d.Sq, d.Sq, d.H, d.H, d.D, 1.0, 0, 0, 1, 0,
                                   1, NULL, 0, nt};
        const ra_view dout = ra_xla_rows_view(
                          ra_xla_item(&l, &t[0], it, l.folded), d.Sq, d.H, d.D),
                      none = {NULL, 0, 0, 0};
        const ra_view views[RA_BWD_NVIEWS] = {
            dout, dout, dout,
            ra_xla_rows_view(ra_xla_item(&l, &t[1], it, l.folded), d.Sq, d.H,
                             d.D),
            dout, none,
            ra_xla_bhs_view(ra_xla_item(&l, &delta, it, l.folded), d.H, d.Sq),
            none, none, none};
        ra_attn_bwd_params p;
        ra_attn_bwd_fill(&p, &call, views, d.dtype, d.dtype, 0);
        RA_CHECK(ra_xla_run_bwd_preprocess(c, &p));
    }
    return RA_OK;
}
