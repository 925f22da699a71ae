/*
 * attn_params.c -- the one place the kernel params are filled, and the
 * checks every entry point makes before a kernel trusts them (position
 * bounds, num_threads); attn_params.h.  Python-free: the CPython entry
 * points (attn_api*.c) and the XLA handlers (csrc/xla/) call the same
 * functions.
 */
#include "attn/attn_params.h"

#include <string.h>

ra_status ra_check_num_threads(int64_t n) {
    if (n >= 0 && n <= RA_MAX_THREADS) return RA_OK;
    ra_set_error(RA_ERR_VALUE,
                 "num_threads: expected 0 (the default: RINGATTN_NUM_THREADS, "
                 "else OpenMP's) or 1..%d, got %lld",
                 RA_MAX_THREADS, (long long)n);
    return RA_ERR_VALUE;
}

#define RA_VIEW_STRIDES(field, view)                                          \
    do {                                                                      \
        p->field##_batch_stride = (view).s0;                                  \
        p->field##_seq_stride = (view).s1;                                    \
        p->field##_head_stride = (view).s2;                                   \
    } while (0)

#define RA_CALL_FIELDS(p, c)                                                  \
    do {                                                                      \
        (p)->dtype = (c)->dtype;                                              \
        (p)->batch = (c)->batch;                                              \
        (p)->seqlen_q = (c)->seqlen_q;                                        \
        (p)->seqlen_k = (c)->seqlen_k;                                        \
        (p)->heads = (c)->heads;                                              \
        (p)->heads_kv = (c)->heads_kv;                                        \
        (p)->head_dim = (c)->head_dim;                                        \
        (p)->scale = (c)->scale;                                              \
        (p)->causal = (c)->causal;                                            \
        (p)->q_pos_offset = (c)->q_pos_offset;                                \
        (p)->q_pos_stride = (c)->q_pos_stride;                                \
        (p)->k_pos_offset = (c)->k_pos_offset;                                \
        (p)->k_pos_stride = (c)->k_pos_stride;                                \
        if ((c)->mask != NULL) (p)->mask = *(c)->mask;                        \
        (p)->accumulate = (c)->accumulate;                                    \
        (p)->num_threads = (c)->num_threads;                                  \
    } while (0)

void ra_attn_fwd_fill(ra_attn_fwd_params *p, const ra_attn_call *c,
                      ra_view q, ra_view k, ra_view v, ra_view out,
                      ra_dtype out_dtype, ra_view lse) {
    memset(p, 0, sizeof *p);
    RA_CALL_FIELDS(p, c);
    p->q = q.data;
    p->k = k.data;
    p->v = v.data;
    p->out = out.data;
    p->lse = lse.data;
    p->out_dtype = out_dtype;
    RA_VIEW_STRIDES(q, q);
    RA_VIEW_STRIDES(k, k);
    RA_VIEW_STRIDES(v, v);
    RA_VIEW_STRIDES(out, out);
    p->lse_batch_stride = lse.s0;
    p->lse_head_stride = lse.s1;
    p->lse_seq_stride = lse.s2;
}

void ra_attn_bwd_fill(ra_attn_bwd_params *p, const ra_attn_call *c,
                      const ra_view t[RA_BWD_NVIEWS], ra_dtype out_dtype,
                      ra_dtype grad_dtype, int deterministic) {
    memset(p, 0, sizeof *p);
    RA_CALL_FIELDS(p, c);
    p->q = t[RA_BWD_Q].data;
    p->k = t[RA_BWD_K].data;
    p->v = t[RA_BWD_V].data;
    p->out = t[RA_BWD_OUT].data;
    p->dout = t[RA_BWD_DOUT].data;
    p->lse = t[RA_BWD_LSE].data;
    p->delta = t[RA_BWD_DELTA].data;
    p->dq = t[RA_BWD_DQ].data;
    p->dk = t[RA_BWD_DK].data;
    p->dv = t[RA_BWD_DV].data;
    p->out_dtype = out_dtype;
    p->grad_dtype = grad_dtype;
    p->deterministic = deterministic;
    p->branch_head_stride = 1;   /* branches stay NULL: plain attention */
    RA_VIEW_STRIDES(q, t[RA_BWD_Q]);
    RA_VIEW_STRIDES(k, t[RA_BWD_K]);
    RA_VIEW_STRIDES(v, t[RA_BWD_V]);
    RA_VIEW_STRIDES(out, t[RA_BWD_OUT]);
    RA_VIEW_STRIDES(dout, t[RA_BWD_DOUT]);
    RA_VIEW_STRIDES(dq, t[RA_BWD_DQ]);
    RA_VIEW_STRIDES(dk, t[RA_BWD_DK]);
    RA_VIEW_STRIDES(dv, t[RA_BWD_DV]);
    p->lse_batch_stride = t[RA_BWD_DELTA].s0;
    p->lse_head_stride = t[RA_BWD_DELTA].s1;
    p->lse_seq_stride = t[RA_BWD_DELTA].s2;
}

ra_status ra_check_positions(const char *offset_name, int64_t offset,
                             const char *stride_name, int64_t stride,
                             int64_t len) {
    int64_t span = 0, reach = 0;
    if (stride < 1) {
        ra_set_error(RA_ERR_VALUE, "%s: expected >= 1, got %lld", stride_name,
                     (long long)stride);
        return RA_ERR_VALUE;
    }
    /* |offset| is taken only once offset is known to be in range */
    if (len < 0 || offset <= -RA_POS_LIMIT || offset >= RA_POS_LIMIT ||
        __builtin_mul_overflow(stride, len, &span) ||
        __builtin_add_overflow(offset < 0 ? -offset : offset, span, &reach) ||
        reach >= RA_POS_LIMIT) {
        ra_set_error(RA_ERR_VALUE,
                     "%s, %s: expected |offset| + stride * rows < 2^60 "
                     "(positions stay inside +-2^60), got offset %lld, "
                     "stride %lld, %lld rows",
                     offset_name, stride_name, (long long)offset,
                     (long long)stride, (long long)len);
        return RA_ERR_VALUE;
    }
    return RA_OK;
}
