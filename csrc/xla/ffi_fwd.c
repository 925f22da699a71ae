/*
 * ffi_fwd.c -- the forward handlers: attention, the ring's block forward
 * that continues a running state, the dilated forward and the LSE merge.
 *
 *   ringattn_attn_fwd       (q, k, v[, positions][, q ids, kv ids])
 *                           -> (out, lse)
 *   ringattn_attn_fwd_acc   (q, k, v, out, lse[, positions][, q ids, kv ids])
 *                           -> (out, lse)
 *                           out/lse float32 (float64) in and out, aliased
 *   ringattn_dilated_fwd    (q, k, v) -> (out, lse)            CPU only
 *   ringattn_merge          (out1, lse1, out2, lse2) -> (out, lse)
 *
 * q, out: (B, S_q, H, D); k, v: (B, S_k, H_kv, D); lse: (B, H, S_q), each
 * possibly behind vmap's leading dims.  Attributes: causal, scale,
 * num_threads, the masks' (ffi_args.h); q_pieces with positions;
 * segment_lengths and dilation_rates for the dilated forward.  out of the plain forward is q's dtype or the
 * acc dtype (the ring's first block starts its float32 state that way).
 */
#include <string.h>

#include "xla/ffi_args.h"
#include "xla/ffi_device.h"
#include "xla/ffi_handlers.h"

/* One (leading index of a) forward call: q, k, v, out, lse at the right
 * offsets, B rows of batch. */
typedef struct fwd_job {
    const ra_xla_qkv *d;
    int64_t B;
    const char *q, *k, *v;
    char *out, *lse;
    ra_dtype out_dtype;
    const ra_xla_opts *o;
    const int32_t *q_ids, *kv_ids;      /* NULL without segment ids */
} fwd_job;

static void fwd_params(ra_attn_fwd_params *p, const fwd_job *j,
                       const ra_xla_block *blk, int accumulate) {
    const ra_xla_qkv *d = j->d;
    const size_t es = ra_dtype_size(d->dtype), os = ra_dtype_size(j->out_dtype),
                 ls = ra_dtype_size(d->acc);
    memset(p, 0, sizeof *p);
    p->q = j->q + (size_t)(blk->q_off * d->H * d->D) * es;
    p->k = j->k + (size_t)(blk->k_off * d->Hkv * d->D) * es;
    p->v = j->v + (size_t)(blk->k_off * d->Hkv * d->D) * es;
    p->out = j->out + (size_t)(blk->q_off * d->H * d->D) * os;
    p->lse = j->lse + (size_t)blk->q_off * ls;
    p->dtype = d->dtype;
    p->out_dtype = j->out_dtype;
    p->batch = j->B;
    p->seqlen_q = blk->nq;
    p->seqlen_k = blk->nk;
    p->heads = d->H;
    p->heads_kv = d->Hkv;
    p->head_dim = d->D;
    /* dense row-major: (B, S, H, D) and (B, H, S) of the whole tensors */
    p->q_batch_stride = p->out_batch_stride = d->Sq * d->H * d->D;
    p->q_seq_stride = p->out_seq_stride = d->H * d->D;
    p->q_head_stride = p->out_head_stride = d->D;
    p->k_batch_stride = p->v_batch_stride = d->Sk * d->Hkv * d->D;
    p->k_seq_stride = p->v_seq_stride = d->Hkv * d->D;
    p->k_head_stride = p->v_head_stride = d->D;
    p->lse_batch_stride = d->H * d->Sq;
    p->lse_head_stride = d->Sq;
    p->lse_seq_stride = 1;
    p->scale = j->o->scale;
    p->causal = j->o->causal;
    p->q_pos_offset = blk->q_start;
    p->q_pos_stride = blk->q_stride;
    p->k_pos_offset = blk->k_start;
    p->k_pos_stride = blk->k_stride;
    ra_xla_block_mask(&p->mask, j->o, j->q_ids, j->kv_ids, d, blk->q_off,
                      blk->k_off);
    p->accumulate = accumulate;
    p->num_threads = j->o->num_threads;
}

/* Run one job over its position pieces: a single pair without a running
 * state is one plain kernel call; otherwise every block merges into the
 * state (a fresh one for a call without a state input). */
static ra_status fwd_pieces(const ra_xla_call *c, const fwd_job *j,
                            const ra_xla_pieces *pp, int accumulate) {
    ra_attn_fwd_params p;
    ra_xla_block blocks[RA_XLA_MAX_BLOCKS];
    if (!accumulate && ra_xla_single_block(pp, &blocks[0])) {
        fwd_params(&p, j, &blocks[0], 0);
        return ra_xla_run_fwd(c, &p);
    }
    if (!accumulate) {
        if (j->out_dtype != j->d->acc) {
            ra_set_error(RA_ERR_TYPE,
                         "out: a forward over several position pieces keeps "
                         "a %s running state, got %s",
                         ra_dtype_name(j->d->acc), ra_dtype_name(j->out_dtype));
            return RA_ERR_TYPE;
        }
        RA_CHECK(ra_xla_fill_state(c, j->out, j->lse, j->d->acc, j->B, j->d->Sq,
                                   j->d->H, j->d->D));
    }
    const int n = ra_xla_state_blocks(pp, j->o, blocks);
    for (int i = 0; i < n; i++) {
        fwd_params(&p, j, &blocks[i], 1);
        RA_CHECK(ra_xla_run_fwd(c, &p));
    }
    return RA_OK;
}

/* q, k, v: arguments 0..2; out, lse: results 0, 1 (out in `out_dtype` or
 * the acc dtype). */
static ra_status load_fwd(ra_xla_call *c, ra_xla_tensor *t, ra_xla_tensor *r,
                          ra_xla_qkv *d, ra_xla_opts *o, int state) {
    RA_CHECK(ra_xla_arg(c, 0, "q", 4, &t[0]));
    RA_CHECK(ra_xla_arg(c, 1, "k", 4, &t[1]));
    RA_CHECK(ra_xla_arg(c, 2, "v", 4, &t[2]));
    RA_CHECK(ra_xla_check_qkv(&t[0], &t[1], &t[2], d));
    RA_CHECK(ra_xla_ret(c, 0, "out", 4, &r[0]));
    RA_CHECK(ra_xla_ret(c, 1, "lse", 3, &r[1]));
    RA_CHECK(ra_xla_check_rows(&r[0], d, d->Sq, d->H, state ? d->acc : d->dtype,
                               d->acc));
    RA_CHECK(ra_xla_check_bhs(&r[1], d));
    return ra_xla_read_opts(c, d->D, o);
}

/* ids: the two id operands, or NULL */
static fwd_job make_job(const ra_xla_lead *l, const ra_xla_tensor *t,
                        const ra_xla_tensor *r, const ra_xla_qkv *d,
                        const ra_xla_opts *o, const ra_xla_tensor *ids,
                        int64_t it, int whole) {
    fwd_job j = {d, whole ? l->count * d->B : d->B,
                 ra_xla_item(l, &t[0], it, whole), ra_xla_item(l, &t[1], it, whole),
                 ra_xla_item(l, &t[2], it, whole), ra_xla_item(l, &r[0], it, whole),
                 ra_xla_item(l, &r[1], it, whole), r[0].dtype, o, NULL, NULL};
    if (ids != NULL) {
        j.q_ids = (const int32_t *)ra_xla_item(l, &ids[0], it, whole);
        j.kv_ids = (const int32_t *)ra_xla_item(l, &ids[1], it, whole);
    }
    return j;
}

static ra_status attn_fwd(ra_xla_call *c, int accumulate) {
    const int base = accumulate ? 5 : 3;
    ra_xla_tensor t[5], r[2], pos, ids[2];
    ra_xla_qkv d;
    ra_xla_opts o;
    ra_xla_lead l;
    int nq = 1;
    RA_CHECK(load_fwd(c, t, r, &d, &o, accumulate));
    if (accumulate) {
        RA_CHECK(ra_xla_arg(c, 3, "running out", 4, &t[3]));
        RA_CHECK(ra_xla_arg(c, 4, "running lse", 3, &t[4]));
        RA_CHECK(ra_xla_check_alias(&t[3], &r[0]));
        RA_CHECK(ra_xla_check_alias(&t[4], &r[1]));
    }
    RA_CHECK(ra_xla_lead_plan(&l, &r[0], t, base));
    RA_CHECK(ra_xla_optional_args(c, base, &o, &d, &r[0], &l, &pos, &nq, ids));
    if (accumulate) {   /* XLA aliases them; copy if it could not */
        for (int i = 0; i < 2; i++)
            RA_CHECK(ra_xla_copy(c, r[i].data, t[3 + i].data,
                                 (size_t)(l.count * ra_xla_core_numel(&r[i])) *
                                     ra_dtype_size(d.acc)));
    }
    const int one = l.folded && (pos.data == NULL || ra_xla_lead_shared(&pos));
    const int64_t iters = one ? 1 : l.count;
    for (int64_t it = 0; it < iters; it++) {
        ra_xla_pieces pp;
        RA_CHECK(ra_xla_load_pieces(c, &pos, nq, &l, it, d.Sq, d.Sk, &pp));
        fwd_job j = make_job(&l, t, r, &d, &o, o.has_ids ? ids : NULL, it, one);
        RA_CHECK(fwd_pieces(c, &j, &pp, accumulate));
    }
    return RA_OK;
}

ra_status ra_xla_attn_fwd(ra_xla_call *c) { return attn_fwd(c, 0); }
ra_status ra_xla_attn_fwd_acc(ra_xla_call *c) { return attn_fwd(c, 1); }

/* ---- dilated ---------------------------------------------------------------- */

ra_status ra_xla_read_dilated(const ra_xla_call *c, const ra_xla_qkv *d,
                              ra_dilated_config *cfg) {
    int ns = 0, nr = 0;
    memset(cfg, 0, sizeof *cfg);
    if (d->Sk != d->Sq) {
        ra_set_error(RA_ERR_VALUE,
                     "k: dilated attention expects the sequence length of q "
                     "(%lld), got %lld",
                     (long long)d->Sq, (long long)d->Sk);
        return RA_ERR_VALUE;
    }
    RA_CHECK(ra_xla_attr_ints(c, "segment_lengths", cfg->segment_lengths,
                              RA_MAX_BRANCHES, &ns));
    RA_CHECK(ra_xla_attr_ints(c, "dilation_rates", cfg->dilation_rates,
                              RA_MAX_BRANCHES, &nr));
    if (ns < 1 || ns != nr) {
        ra_set_error(RA_ERR_VALUE,
                     "dilation_rates: expected %d values (one per segment "
                     "length, at least one), got %d",
                     ns, nr);
        return RA_ERR_VALUE;
    }
    for (int i = 0; i < ns; i++) {
        if (cfg->segment_lengths[i] < 1 || cfg->dilation_rates[i] < 1) {
            ra_set_error(RA_ERR_VALUE,
                         "segment_lengths, dilation_rates: expected positive "
                         "ints, got %lld and %lld at position %d",
                         (long long)cfg->segment_lengths[i],
                         (long long)cfg->dilation_rates[i], i);
            return RA_ERR_VALUE;
        }
    }
    cfg->n_branches = ns;
    return RA_OK;
}

ra_status ra_xla_dilated_fwd(ra_xla_call *c) {
    ra_xla_tensor t[3], r[2];
    ra_xla_qkv d;
    ra_xla_opts o;
    ra_xla_lead l;
    ra_dilated_config cfg;
    RA_CHECK(load_fwd(c, t, r, &d, &o, 0));
    RA_CHECK(ra_xla_no_masks(&o));
    RA_CHECK(ra_xla_read_dilated(c, &d, &cfg));
    RA_CHECK(ra_xla_lead_plan(&l, &r[0], t, 3));
    const int64_t iters = l.folded ? 1 : l.count;
    for (int64_t it = 0; it < iters; it++) {
        fwd_job j = make_job(&l, t, r, &d, &o, NULL, it, l.folded);
        const ra_xla_block all = {0, d.Sq, 0, 1, 0, d.Sk, 0, 1};
        ra_attn_fwd_params p;
        fwd_params(&p, &j, &all, 0);
        RA_CHECK(ra_xla_run_dilated_fwd(c, &p, &cfg));
    }
    return RA_OK;
}

/* ---- merge ------------------------------------------------------------------ */

ra_status ra_xla_merge(ra_xla_call *c) {
    ra_xla_tensor t[4], out, lse;
    ra_xla_lead l;
    int nt = 0, present = 0;
    int64_t nt64 = 0;
    RA_CHECK(ra_xla_arg(c, 0, "out1", 4, &t[0]));
    RA_CHECK(ra_xla_arg(c, 1, "lse1", 3, &t[1]));
    RA_CHECK(ra_xla_arg(c, 2, "out2", 4, &t[2]));
    RA_CHECK(ra_xla_arg(c, 3, "lse2", 3, &t[3]));
    RA_CHECK(ra_xla_ret(c, 0, "out", 4, &out));
    RA_CHECK(ra_xla_ret(c, 1, "lse", 3, &lse));
    const int64_t B = ra_xla_dim(&out, 0), S = ra_xla_dim(&out, 1),
                  H = ra_xla_dim(&out, 2), D = ra_xla_dim(&out, 3);
    const int64_t rows[4] = {B, S, H, D}, bhs[3] = {B, H, S};
    const ra_dtype ld = t[1].dtype;
    if (ld != RA_FLOAT32 && ld != RA_FLOAT64) {
        ra_set_error(RA_ERR_TYPE, "lse1: expected float32 or float64");
        return RA_ERR_TYPE;
    }
    for (int i = 0; i < 4; i += 2) {
        RA_CHECK(ra_xla_check_dims(&t[i], rows, "(batch, seq, heads, head_dim)"));
        RA_CHECK(ra_xla_check_dims(&t[i + 1], bhs, "(batch, heads, seq)"));
        RA_CHECK(ra_xla_check_dtype(&t[i + 1], ld, "the dtype of lse1"));
        if (t[i].dtype == RA_DTYPE_OTHER) {
            ra_set_error(RA_ERR_TYPE, "%s: expected a float dtype", t[i].name);
            return RA_ERR_TYPE;
        }
    }
    RA_CHECK(ra_xla_check_dims(&lse, bhs, "(batch, heads, seq)"));
    RA_CHECK(ra_xla_check_dtype(&lse, ld, "the dtype of lse1"));
    if (out.dtype == RA_DTYPE_OTHER) {
        ra_set_error(RA_ERR_TYPE, "out: expected a float dtype");
        return RA_ERR_TYPE;
    }
    RA_CHECK(ra_xla_attr_int(c, "num_threads", &nt64, &present));
    nt = nt64 > 0 && nt64 < 4096 ? (int)nt64 : 0;
    RA_CHECK(ra_xla_lead_plan(&l, &out, t, 4));
    const int64_t iters = l.folded ? 1 : l.count;
    for (int64_t it = 0; it < iters; it++) {
        ra_merge_params p;
        memset(&p, 0, sizeof p);
#define RA_AT(x) ra_xla_item(&l, &(x), it, l.folded)
        p.out1 = RA_AT(t[0]);
        p.lse1 = RA_AT(t[1]);
        p.out2 = RA_AT(t[2]);
        p.lse2 = RA_AT(t[3]);
        p.out = RA_AT(out);
        p.lse = RA_AT(lse);
#undef RA_AT
        p.out1_dtype = t[0].dtype;
        p.out2_dtype = t[2].dtype;
        p.out_dtype = out.dtype;
        p.lse_dtype = ld;
        p.batch = l.folded ? l.count * B : B;
        p.seqlen = S;
        p.heads = H;
        p.head_dim = D;
        p.out1_batch_stride = p.out2_batch_stride = p.out_batch_stride = S * H * D;
        p.out1_seq_stride = p.out2_seq_stride = p.out_seq_stride = H * D;
        p.out1_head_stride = p.out2_head_stride = p.out_head_stride = D;
        p.lse1_batch_stride = p.lse2_batch_stride = p.lse_batch_stride = H * S;
        p.lse1_head_stride = p.lse2_head_stride = p.lse_head_stride = S;
        p.lse1_seq_stride = p.lse2_seq_stride = p.lse_seq_stride = 1;
        p.num_threads = nt;
        RA_CHECK(ra_xla_run_merge(c, &p));
    }
    return RA_OK;
}
