/*
 * attn_params.h -- the plain parameter structs every attention kernel takes,
 * CPU and CUDA alike.  attn_api.c fills them in one place from the
 * Python arguments after every check has passed, so kernels may trust them.
 *
 * Layout (BSHD, as flash-attn and JAX):
 *   q, out, dout, dq : (B, S_q, H,    D)
 *   k, v, dk, dv     : (B, S_k, H_kv, D)
 *   lse, delta       : (B, H, S_q)   float32 (float64 when dtype is float64)
 * Strides are in elements; the last (D) dimension is always contiguous.
 * Query head h reads kv head h / (H / H_kv).
 *
 * Positions are affine so ring shards and dilated views reuse one kernel:
 *   pos_q(i) = q_pos_offset + i * q_pos_stride
 *   pos_k(j) = k_pos_offset + j * k_pos_stride
 * With causal set, key j is visible to query i iff pos_k(j) <= pos_q(i).
 * Both strides are >= 1, so positions increase along the sequence, and
 * every position lies strictly inside +-RA_POS_LIMIT (2^60): every entry
 * point checks |offset| + stride * length < RA_POS_LIMIT with
 * ra_check_positions before any work, so kernels may compute positions,
 * their differences and position +- window side (a side below 2^62) in
 * int64 without overflow.
 * The masks of ra_attn_mask narrow that further (a key is visible iff every
 * rule allows it), and soft-capping reshapes the scores.
 * A query row that sees no key gets out = 0 and lse = -inf, never NaN.
 */
#ifndef RA_ATTN_PARAMS_H
#define RA_ATTN_PARAMS_H

#include "core/ra_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RA_MAX_HEAD_DIM 256
#define RA_MAX_BRANCHES 16
#define RA_POS_LIMIT ((int64_t)1 << 60)

/* RA_OK if the positions offset + stride * i of `len` rows (i < len) keep
 * |offset| + stride * len < RA_POS_LIMIT and stride >= 1 (checked
 * arithmetic, any int64 input); else RA_ERR_VALUE naming offset_name and
 * stride_name with the bound and the values (attn_params.c). */
ra_status ra_check_positions(const char *offset_name, int64_t offset,
                             const char *stride_name, int64_t stride,
                             int64_t len);

/* Masks and soft-capping (DESIGN 2, "Masks"), shared by forward and
 * backward.  All zero means none: every rule is off.
 *
 *   documents: key j is visible to query i iff
 *       q_segment_ids[b, i] == kv_segment_ids[b, j]
 *     (int32, (B, S_q) and (B, S_k), strides in elements; both NULL or both
 *     set -- the Python layer passes q's ids for kv when only they are given)
 *   window (has_window = 1): key j is visible to query i iff
 *       pos_q(i) - window_left <= pos_k(j) <= pos_q(i) + window_right
 *     with the affine positions above; a side < 0 is unbounded
 *   softcap > 0: the scaled score s becomes softcap * tanh(s / softcap)
 *     before the softmax; lse is of the capped scores and the backward
 *     multiplies dS by 1 - tanh(s / softcap)^2.
 */
typedef struct ra_attn_mask {
    const int32_t *q_segment_ids, *kv_segment_ids;
    int64_t q_seg_batch_stride, q_seg_seq_stride;
    int64_t kv_seg_batch_stride, kv_seg_seq_stride;
    int has_window;
    int64_t window_left, window_right;
    double softcap;
} ra_attn_mask;

/* The softcaps every kernel takes: 0 (none) or RA_SOFTCAP_MIN..MAX, a range
 * the float32 arithmetic of the CPU and CUDA kernels holds without
 * overflow or a cap rounding to 0 or infinity (a cap of 1e30 is no cap at
 * any score a float can hold; one of 1e-30 flattens every row). */
#define RA_SOFTCAP_MIN 1e-30 /* attn_mask_args.c writes both in its message */
#define RA_SOFTCAP_MAX 1e30
#define RA_SOFTCAP_OK(c) \
    ((c) == 0.0 || ((c) >= RA_SOFTCAP_MIN && (c) <= RA_SOFTCAP_MAX))

typedef struct ra_attn_fwd_params {
    const void *q, *k, *v;
    void *out;                 /* out_dtype */
    void *lse;                 /* ra_acc_dtype(dtype) */
    ra_dtype dtype;            /* of q, k, v */
    ra_dtype out_dtype;        /* == dtype, or ra_acc_dtype(dtype) */

    int64_t batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim;

    int64_t q_batch_stride, q_seq_stride, q_head_stride;
    int64_t k_batch_stride, k_seq_stride, k_head_stride;
    int64_t v_batch_stride, v_seq_stride, v_head_stride;
    int64_t out_batch_stride, out_seq_stride, out_head_stride;
    int64_t lse_batch_stride, lse_head_stride, lse_seq_stride;

    double scale;              /* multiplies q.k */
    int causal;
    int64_t q_pos_offset, q_pos_stride;
    int64_t k_pos_offset, k_pos_stride;
    ra_attn_mask mask;

    /* accumulate = 1: out (out_dtype == ra_acc_dtype(dtype)) and lse hold a
     * running state -- the normalised output and lse over keys already seen
     * (lse = -inf, out = 0 for "nothing yet").  The kernel merges this call's
     * keys into it by the LSE rule in place.  accumulate = 0: overwrite. */
    int accumulate;

    int num_threads;           /* CPU: 0 = RINGATTN_NUM_THREADS / OpenMP default */
} ra_attn_fwd_params;

typedef struct ra_attn_bwd_params {
    const void *q, *k, *v, *out, *dout;
    const void *lse;           /* acc dtype, (B, H, S_q): the FINAL lse over all keys */
    void *delta;               /* acc dtype, (B, H, S_q): rowsum(dout * out) */
    void *dq, *dk, *dv;        /* grad_dtype */
    ra_dtype dtype;            /* of q, k, v */
    ra_dtype out_dtype;        /* of out and dout */
    ra_dtype grad_dtype;       /* of dq, dk, dv: == dtype, or ra_acc_dtype(dtype) */

    int64_t batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim;

    int64_t q_batch_stride, q_seq_stride, q_head_stride;
    int64_t k_batch_stride, k_seq_stride, k_head_stride;
    int64_t v_batch_stride, v_seq_stride, v_head_stride;
    int64_t out_batch_stride, out_seq_stride, out_head_stride;
    int64_t dout_batch_stride, dout_seq_stride, dout_head_stride;
    int64_t dq_batch_stride, dq_seq_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_seq_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_seq_stride, dv_head_stride;
    int64_t lse_batch_stride, lse_head_stride, lse_seq_stride; /* also delta's */

    double scale;
    int causal;
    int64_t q_pos_offset, q_pos_stride;
    int64_t k_pos_offset, k_pos_stride;

    ra_attn_mask mask;

    /* accumulate = 1: dq, dk, dv are added into (grad_dtype must then be the
     * acc dtype); 0: they are overwritten. */
    int accumulate;
    int deterministic;         /* same bits for the same inputs on every run */
    int num_threads;
    /* the scores are one branch of dilated attention (the ring's exchanged
     * rows, or the heads of one dilation offset): its configuration and the
     * global query head of the call's head j, branch_head0 +
     * branch_head_stride * j (stride >= 1; the fill functions set 1), so
     * that a pair several branches share gets its share of P; NULL for
     * plain attention.  Documents and causal may narrow the pairs further;
     * windows and softcaps are not taken with it. */
    const struct ra_dilated_config *branches;
    int64_t branch_head0;
    int64_t branch_head_stride;
} ra_attn_bwd_params;

/* out = merge of (out1, lse1) and (out2, lse2) by the LSE rule (DESIGN 3).
 * outs: (B, S, H, D) any float dtype each; lses: (B, H, S) acc dtype.
 * out/lse may alias out1/lse1 (in-place merge). */
typedef struct ra_merge_params {
    const void *out1, *lse1, *out2, *lse2;
    void *out, *lse;
    ra_dtype out1_dtype, out2_dtype, out_dtype;
    ra_dtype lse_dtype;        /* RA_FLOAT32 or RA_FLOAT64, all three lse */
    int64_t batch, seqlen, heads, head_dim;
    int64_t out1_batch_stride, out1_seq_stride, out1_head_stride;
    int64_t out2_batch_stride, out2_seq_stride, out2_head_stride;
    int64_t out_batch_stride, out_seq_stride, out_head_stride;
    int64_t lse1_batch_stride, lse1_head_stride, lse1_seq_stride;
    int64_t lse2_batch_stride, lse2_head_stride, lse2_seq_stride;
    int64_t lse_batch_stride, lse_head_stride, lse_seq_stride;
    int num_threads;
} ra_merge_params;

/* LongNet dilated attention configuration (DESIGN 2, "Dilated attention").
 * Branch i cuts positions into segments [s*w_i, (s+1)*w_i) counted from
 * position 0 and, for query head h, selects offset o = h mod r_i inside each
 * segment.  Branch results merge by the LSE rule. */
typedef struct ra_dilated_config {
    int n_branches;
    int64_t segment_lengths[RA_MAX_BRANCHES];
    int64_t dilation_rates[RA_MAX_BRANCHES];
} ra_dilated_config;

/* ---- filling the params (attn_params.c) --------------------------------
 * The CPython entry points (attn_api*.c) and the XLA handlers (csrc/xla/)
 * fill the kernel params with these functions only, so the two paths
 * cannot drift apart.  Python-free. */

/* One tensor as a kernel sees it: its first element and its element
 * strides over the first three dims -- (batch, seq, head) of a BSHD
 * tensor, (batch, head, seq) of lse / delta; the last dim is contiguous.
 * data NULL (and strides 0): a tensor the call does not use. */
typedef struct ra_view {
    void *data;
    int64_t s0, s1, s2;
} ra_view;

/* What a forward or backward kernel call takes besides its tensors. */
typedef struct ra_attn_call {
    ra_dtype dtype;            /* of q, k, v */
    int64_t batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim;
    double scale;
    int causal;
    int64_t q_pos_offset, q_pos_stride, k_pos_offset, k_pos_stride;
    const ra_attn_mask *mask;  /* NULL: no mask */
    int accumulate;
    int num_threads;           /* checked by ra_check_num_threads */
} ra_attn_call;

/* The tensors of a backward call, in this order. */
enum { RA_BWD_Q, RA_BWD_K, RA_BWD_V, RA_BWD_OUT, RA_BWD_DOUT, RA_BWD_LSE,
       RA_BWD_DELTA, RA_BWD_DQ, RA_BWD_DK, RA_BWD_DV, RA_BWD_NVIEWS };

void ra_attn_fwd_fill(ra_attn_fwd_params *p, const ra_attn_call *c,
                      ra_view q, ra_view k, ra_view v, ra_view out,
                      ra_dtype out_dtype, ra_view lse);
/* lse and delta share one stride set in the params: delta's. */
void ra_attn_bwd_fill(ra_attn_bwd_params *p, const ra_attn_call *c,
                      const ra_view t[RA_BWD_NVIEWS], ra_dtype out_dtype,
                      ra_dtype grad_dtype, int deterministic);

/* RA_OK if p->branches is NULL, or holds 1..RA_MAX_BRANCHES branches of
 * segment length and dilation rate >= 1 with branch_head0 >= 0,
 * branch_head_stride >= 1 (and the last head below 2^62) and p->mask sets
 * no window or softcap (documents are fine); else RA_ERR_VALUE naming
 * what is wrong.  Both backends check a backward call with it (inline:
 * cuda/ links no csrc/attn object, tools/cuda_selftest.cu included). */
static inline ra_status ra_check_branches(const ra_attn_bwd_params *p) {
    const ra_dilated_config *c = p->branches;
    if (c == NULL) return RA_OK;
    if (c->n_branches < 1 || c->n_branches > RA_MAX_BRANCHES) {
        ra_set_error(RA_ERR_VALUE, "attention backward: branches: expected 1 "
                     "to %d branches, got %d", RA_MAX_BRANCHES, c->n_branches);
        return RA_ERR_VALUE;
    }
    for (int i = 0; i < c->n_branches; i++) {
        if (c->segment_lengths[i] < 1 || c->dilation_rates[i] < 1) {
            ra_set_error(RA_ERR_VALUE, "attention backward: branch %d: "
                         "expected segment length and dilation rate >= 1, "
                         "got %lld and %lld", i,
                         (long long)c->segment_lengths[i],
                         (long long)c->dilation_rates[i]);
            return RA_ERR_VALUE;
        }
    }
    const int64_t last = p->heads > 0 ? p->heads - 1 : 0;
    const int64_t lim = (int64_t)1 << 62;
    if (p->branch_head0 < 0 || p->branch_head_stride < 1 ||
        p->branch_head0 >= lim ||
        (last > 0 && p->branch_head_stride > (lim - p->branch_head0) / last)) {
        ra_set_error(RA_ERR_VALUE, "attention backward: branch_head0 >= 0 and "
                     "branch_head_stride >= 1 with the last head below 2^62 "
                     "expected, got %lld and %lld for %lld heads",
                     (long long)p->branch_head0,
                     (long long)p->branch_head_stride, (long long)p->heads);
        return RA_ERR_VALUE;
    }
    if (p->mask.has_window || p->mask.softcap > 0) {
        ra_set_error(RA_ERR_VALUE, "attention backward: a dilated branch "
                     "takes no window or softcap (documents only)");
        return RA_ERR_VALUE;
    }
    return RA_OK;
}

/* A dilated attention call (ra_cpu_dilated_*, ra_cuda_dilated_*): no
 * masks, position strides 1, 1..RA_MAX_BRANCHES branches of segment
 * length and rate >= 1; else the named error.  Inline: cuda/ links no
 * csrc/attn object. */
static inline ra_status ra_check_dilated(const ra_dilated_config *cfg, int64_t qps,
                                         int64_t kps, const ra_attn_mask *m) {
    if (m->q_segment_ids != NULL || m->kv_segment_ids != NULL || m->has_window ||
        m->softcap != 0.0) {
        ra_set_error(RA_ERR_UNSUPPORTED,
                     "dilated attention: takes no segment ids, window or softcap");
        return RA_ERR_UNSUPPORTED;
    }
    if (qps != 1 || kps != 1) {
        ra_set_error(RA_ERR_VALUE,
                     "dilated attention: position strides must be 1 (q %lld, k %lld)",
                     (long long)qps, (long long)kps);
        return RA_ERR_VALUE;
    }
    if (cfg == NULL || cfg->n_branches < 1 || cfg->n_branches > RA_MAX_BRANCHES) {
        ra_set_error(RA_ERR_VALUE, "dilated attention: need 1..%d branches",
                     RA_MAX_BRANCHES);
        return RA_ERR_VALUE;
    }
    for (int i = 0; i < cfg->n_branches; i++) {
        if (cfg->segment_lengths[i] < 1 || cfg->dilation_rates[i] < 1) {
            ra_set_error(RA_ERR_VALUE,
                         "dilated attention: branch %d has segment length %lld "
                         "and rate %lld (both must be >= 1)",
                         i, (long long)cfg->segment_lengths[i],
                         (long long)cfg->dilation_rates[i]);
            return RA_ERR_VALUE;
        }
    }
    return RA_OK;
}

/* num_threads of every entry point: 0 is the default (RINGATTN_NUM_THREADS,
 * else OpenMP's), 1..RA_MAX_THREADS that many; anything else is
 * RA_ERR_VALUE naming num_threads. */
ra_status ra_check_num_threads(int64_t n);

#ifdef __cplusplus
}
#endif
#endif /* RA_ATTN_PARAMS_H */
