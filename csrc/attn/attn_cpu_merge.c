/*
 * attn_cpu_merge.c -- LSE merge of two partial attention results (DESIGN 3):
 *
 *   lse = logaddexp(lse1, lse2)
 *   out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2
 *
 *   out1, out2, out: (B, S, H, D), any float dtype each
 *   lse1, lse2, lse: (B, H, S), float32 or float64
 *
 * Computed in double, row by row (a row is (b, s, h)), rows shared among
 * OpenMP threads.  Each row reads both inputs before writing, so out/lse may
 * alias out1/lse1 (or out2/lse2).  Two empty rows (-inf, -inf) give (0, -inf);
 * a NaN lse on either side gives a NaN row.
 */
#include "attn/attn_cpu.h"
#include "attn/attn_cpu_kern.h"

ra_status ra_cpu_merge(const ra_merge_params *p) {
    const ra_dtype ld = p->lse_dtype;
    if (ld != RA_FLOAT32 && ld != RA_FLOAT64) {
        ra_set_error(RA_ERR_TYPE, "merge: lse dtype must be float32 or float64, got %s",
                     ra_dtype_name(ld));
        return RA_ERR_TYPE;
    }
    if (ra_dtype_size(p->out1_dtype) == 0 || ra_dtype_size(p->out2_dtype) == 0 ||
        ra_dtype_size(p->out_dtype) == 0) {
        ra_set_error(RA_ERR_TYPE, "merge: unsupported output dtype");
        return RA_ERR_TYPE;
    }
    const int64_t B = p->batch, S = p->seqlen, H = p->heads, D = p->head_dim;
    if (B < 0 || S < 0 || H < 0 || D < 0) {
        ra_set_error(RA_ERR_VALUE, "merge: negative size");
        return RA_ERR_VALUE;
    }
    const int64_t n_rows = B * S * H;
    const int nt = ra_cpu_threads_for(p->num_threads, 8.0 * (double)n_rows * (double)D);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t h = r % H, s = (r / H) % S, b = r / (H * S);
        const double l1 = ra_cpu_ld(p->lse1, b * p->lse1_batch_stride +
                                                 h * p->lse1_head_stride +
                                                 s * p->lse1_seq_stride, ld);
        const double l2 = ra_cpu_ld(p->lse2, b * p->lse2_batch_stride +
                                                 h * p->lse2_head_stride +
                                                 s * p->lse2_seq_stride, ld);
        /* a NaN max is taken too: NaN lse and weights (a NaN part makes
         * the row NaN); only two empty parts give the empty row */
        const double m = l1 > l2 || l1 != l1 ? l1 : l2;
        double w1 = 0.0, w2 = 0.0, lse = -INFINITY;
        if (!(l1 == -INFINITY && l2 == -INFINITY)) {
            const double e1 = exp(l1 - m), e2 = exp(l2 - m), sum = e1 + e2;
            lse = m + log(sum);
            w1 = e1 / sum;
            w2 = e2 / sum;
        }
        const int64_t o1 = b * p->out1_batch_stride + s * p->out1_seq_stride +
                           h * p->out1_head_stride;
        const int64_t o2 = b * p->out2_batch_stride + s * p->out2_seq_stride +
                           h * p->out2_head_stride;
        const int64_t oo = b * p->out_batch_stride + s * p->out_seq_stride +
                           h * p->out_head_stride;
        for (int64_t d = 0; d < D; d++) {
            double v = 0.0;
            if (w1 != 0.0) v += w1 * ra_cpu_ld(p->out1, o1 + d, p->out1_dtype);
            if (w2 != 0.0) v += w2 * ra_cpu_ld(p->out2, o2 + d, p->out2_dtype);
            ra_cpu_st(p->out, oo + d, p->out_dtype, v);
        }
        ra_cpu_st(p->lse, b * p->lse_batch_stride + h * p->lse_head_stride +
                              s * p->lse_seq_stride, ld, lse);
    }
    return RA_OK;
}
